"""The driver's view of the model the owners laid out (``ModelView``), and the owners a new
driver adopts (``Adopted``): what ``OwnerPool`` starts from, kept apart from its membership code."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zero_ray.control.handlers import ModelLayout


@dataclass(frozen=True, kw_only=True)
class ModelView:
    """The driver's view of the model the owners laid out (``ModelLayout``, the owners' one
    description of it, converted here once): every parameter's shape by name, in layout order,
    and which are trained."""

    numel: int
    shapes: Mapping[str, tuple[int, ...]]
    trainable: frozenset[str]

    @classmethod
    def of(cls, layout: ModelLayout | None) -> ModelView:
        """The view of ``layout``; empty for an owner without model state (None)."""
        if layout is None:
            return cls(numel=0, shapes={}, trainable=frozenset())
        return cls(numel=layout.numel, shapes={p.name: tuple(p.shape) for p in layout.params},
                   trainable=frozenset(p.name for p in layout.params if p.trainable))

    @property
    def trainable_numel(self) -> int:
        return sum(math.prod(shape) for name, shape in self.shapes.items() if name in self.trainable)


@dataclass(frozen=True, kw_only=True)
class Adopted:
    """Owners already running (a detached run a new driver attaches to), in rank order."""

    actors: list[Any]
    generation: int
    layout: ModelLayout | None
