"""Model-state byte counting shared by the stage 0-2 and stage 3 states."""

from __future__ import annotations

import torch

CATEGORIES = ("params", "grads", "optimizer", "optimizer_master", "optimizer_moments",
              "padding", "padding_params", "padding_grads", "padding_optimizer")


class StateBytes:
    """Bytes by category from the tensors actually held; padding elements counted apart."""

    def __init__(self) -> None:
        self.report: dict[str, int] = dict.fromkeys(CATEGORIES, 0)

    def count(self, category: str, tensor: torch.Tensor, real: int) -> None:
        """``tensor`` holds ``real`` non-padding elements of ``category``."""
        size = tensor.element_size()
        self.report[category] += real * size
        pad = (tensor.numel() - real) * size
        self.report["padding"] += pad
        self.report["padding_" + category.split("_")[0]] += pad
