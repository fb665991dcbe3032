"""Offload: where an owner keeps its optimizer state (ZeRO-Infinity's NVMe tier).

Pure settings: the owner's side is ``owner/offload.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zero_ray.errors import ConfigError

OPTIMIZER_TIERS = (None, "nvme")


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Optimizer state kept off the owner's memory.

    optimizer: None (in memory, the default) or "nvme": the element-wise optimizer state
        (Adam's moments, SGD's momentum) lives in files on the owner's local disk under
        ``path``, mapped into the owner, and is streamed through the update one parameter
        group at a time: the next group's state is read ahead while this one steps, and each
        group's pages leave the owner's memory once it has stepped (the kernel writes them
        back). Bit for bit the same run as without it. "cpu" (ZeRO-Offload's host memory, for
        GPU owners) is not built: on a CPU owner the state already is in host memory.
    path: a directory on each owner's node, e.g. a local NVMe mount. Owners of one node may
        share it: each owner's files are unlinked as soon as they are made. Each file is checked
        by block checksums; one the disk changed makes its owner count as lost (restored from its
        peer's copy or the checkpoint), never used.
    """

    optimizer: str | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        if self.optimizer == "cpu":
            raise ConfigError("Offload(optimizer='cpu') would keep the optimizer state in host memory, for GPU "
                              "owners, which zero_ray does not do yet; on CPU owners that state already is in host "
                              "memory, so it would move nothing. Offload(optimizer='nvme', path=...) keeps it on "
                              "local disk, which is what saves memory there")
        if self.optimizer not in OPTIMIZER_TIERS:
            raise ConfigError(f"Offload(optimizer={self.optimizer!r}) is not one of {OPTIMIZER_TIERS}")
        if self.optimizer == "nvme" and not (isinstance(self.path, (str, os.PathLike)) and str(self.path)):
            raise ConfigError(f"Offload(optimizer='nvme') needs path=, a directory on each owner's local disk "
                              f"(got {self.path!r})")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))

    @property
    def optimizer_on_nvme(self) -> bool:
        return self.optimizer == "nvme"
