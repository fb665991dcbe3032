"""Offload: where an owner keeps its optimizer state (ZeRO-Infinity's NVMe tier).

Pure settings: the owner's side is ``owner/tensors/state_files.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zero_ray.errors import ConfigError

OPTIMIZER_TIERS = (None, "nvme")
PARAM_TIERS = (None, "nvme")


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Optimizer state, and at stage 3 parameters, kept off the owner's memory.

    optimizer: None (in memory, the default) or "nvme": the element-wise optimizer state
        (Adam's moments, SGD's momentum) lives in files on the owner's local disk under
        ``path``, mapped into the owner, and is streamed through the update one parameter
        group at a time: the next group's state is read ahead while this one steps, and each
        group's pages leave the owner's memory once it has stepped (the kernel writes them
        back). Bit for bit the same run as without it. "cpu" (ZeRO-Offload's host memory, for
        GPU owners) is not built: on a CPU owner the state already is in host memory.
    params: None (in memory, the default) or "nvme", at stage 3 only: each owner's parameter
        shards (its fp32 master weights; the compute-dtype copy too where that differs) and the
        step's reduced gradient shards live in files under ``path`` as well. A shard is read in
        on the comm stream just before its unit's all-gather (so ``prefetch_depth`` applies to
        the reads too) and let go after it; the update streams them with the optimizer state,
        one group at a time. Bit for bit the same run as without it.
    path: a directory on each owner's node, e.g. a local NVMe mount. Owners of one node may
        share it: each owner's files are unlinked as soon as they are made. Each file is checked
        by block checksums; one the disk changed makes its owner count as lost (restored from its
        peer's copy or the checkpoint), never used.
    """

    optimizer: str | None = None
    params: str | None = None
    path: str | None = None

    def __post_init__(self) -> None:
        for what, tier, tiers in (("optimizer", self.optimizer, OPTIMIZER_TIERS), ("params", self.params, PARAM_TIERS)):
            if tier == "cpu":
                raise ConfigError(f"Offload({what}='cpu') would keep that state in host memory, for GPU owners, which "
                                  "zero_ray does not do yet; on CPU owners it already is in host memory, so it would "
                                  f"move nothing. Offload({what}='nvme', path=...) keeps it on local disk, which is "
                                  "what saves memory there")
            if tier not in tiers:
                raise ConfigError(f"Offload({what}={tier!r}) is not one of {tiers}")
            if tier == "nvme" and not (isinstance(self.path, (str, os.PathLike)) and str(self.path)):
                raise ConfigError(f"Offload({what}='nvme') needs path=, a directory on each owner's local disk "
                                  f"(got {self.path!r})")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))

    @property
    def optimizer_on_nvme(self) -> bool:
        return self.optimizer == "nvme"

    @property
    def params_on_nvme(self) -> bool:
        return self.params == "nvme"

    @property
    def any_on_nvme(self) -> bool:
        return self.optimizer_on_nvme or self.params_on_nvme
