"""Counting a rank's model-state bytes from the tensors it actually holds."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero_ray.core.memory_formulas import StateBytes

CATEGORIES = ("params", "grads", "optimizer", "optimizer_master", "optimizer_moments", "optimizer_scalars",
              "padding", "padding_params", "padding_grads", "padding_optimizer", "nvme")


class StateCounter:
    """Bytes by category; padding elements counted apart (``padding_<category>``)."""

    def __init__(self) -> None:
        self.report: dict[str, int] = dict.fromkeys(CATEGORIES, 0)

    def add(self, category: str, tensor: torch.Tensor, real: int) -> None:
        """``tensor`` holds ``real`` non-padding elements of ``category``."""
        size = tensor.element_size()
        self.report[category] += real * size
        pad = (tensor.numel() - real) * size
        self.report["padding"] += pad
        self.report["padding_" + category.split("_")[0]] += pad

    def add_whole(self, category: str, tensor: torch.Tensor) -> None:
        """All of ``tensor``'s bytes under ``category`` (a category reported apart)."""
        self.report[category] = self.report.get(category, 0) + tensor.numel() * tensor.element_size()

    def finish(self) -> dict[str, int]:
        """The report with ``optimizer`` (master + moments: the paper's K per element) and
        ``total`` filled in; ``total`` also holds the optimizer's per-parameter scalars (e.g.
        Adam's step counts: 4 bytes per parameter fragment, outside the paper's formula).
        ``nvme``: the part of it held in files on local disk (``Offload``, padding included)."""
        r = self.report
        r["optimizer"] = r["optimizer_master"] + r["optimizer_moments"]
        r["total"] = r["params"] + r["grads"] + r["optimizer"] + r["padding"] + r["optimizer_scalars"]
        return r


def state_bytes(report: dict[str, int]) -> StateBytes:
    """A memory report's model state by category, padding counted with its category."""
    return StateBytes(params=report.get("params", 0) + report.get("padding_params", 0),
                      grads=report.get("grads", 0) + report.get("padding_grads", 0),
                      optimizer=report.get("optimizer", 0) + report.get("padding_optimizer", 0))


def held_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once; empty
    placeholders not at all): an independent count of what a rank holds."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
