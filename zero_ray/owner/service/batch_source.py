"""Where an owner's pieces of global batches come from.

Two sources, named by the ``Piece`` a Step or Evaluate request carries:

- staged batches: ``ZeroTrainer.step(batch)`` puts each owner's piece in Ray's object store and
  hands the reference to the owner in a Ray call (``PartitionOwner.stage_batch``), which Ray
  resolves and reference-counts (no out-of-band ObjectRef, so nothing stays pinned); the
  request names it by key and the owner takes it, waiting a bounded time for it to arrive. When
  the staging call fails (its piece never comes) the driver sees that call fail and aborts the
  step's generation, which ends the wait at once.
- datasets: ``ZeroTrainer.fit`` ships a map-style dataset (or a factory for one) to every owner
  once; a request carries indices and the owner builds its piece with ``collate_fn``. A source
  of ``zero_ray.data`` arrives as a factory that opens it here (``BlockReader``): it reads whole
  blocks, and prefetches the next global batches' blocks given the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from zero_ray.control.handlers import Piece
from zero_ray.data.reader import BlockReader
from zero_ray.errors import CollectiveError, ConfigError

Collate = Callable[[list[Any]], Any]


def default_collate(samples: list[Any]) -> Any:
    """``torch.utils.data.default_collate``: stacks tensors and numbers, recursing into tuples,
    lists and dicts (a ``TensorDataset``'s ``(x, y)`` items become ``[X, Y]``)."""
    from torch.utils.data import default_collate as collate

    return collate(samples)


@dataclass(frozen=True, kw_only=True)
class HeldDataset:
    """A dataset an owner holds and how it turns samples into a piece."""

    dataset: Any
    collate: Collate


class PieceSource:
    """An owner's staged batches and datasets."""

    def __init__(self) -> None:
        self._staged: dict[str, Any] = {}
        self._arrived = threading.Condition()
        self._datasets: dict[str, HeldDataset] = {}
        self._aborted = -1  # the newest generation whose waits were abandoned

    # -- staged batches ----------------------------------------------------------------------------
    def stage(self, key: str, piece: Any) -> None:
        with self._arrived:
            self._staged[key] = piece
            self._arrived.notify_all()

    def drop_staged(self, *, keep_generation: int | None = None) -> None:
        """Forget staged pieces (of generations other than ``keep_generation``): after an
        interrupted step nothing will take them."""
        with self._arrived:
            self._staged = {k: v for k, v in self._staged.items()
                            if keep_generation is not None and k.split(":", 1)[0] == str(keep_generation)}

    def abort(self, generation: int) -> None:
        """Wake every take waiting for a piece of ``generation`` (or an earlier one): it fails
        now instead of waiting out its timeout for a piece whose staging failed."""
        with self._arrived:
            self._aborted = max(self._aborted, generation)
            self._arrived.notify_all()

    # -- datasets -----------------------------------------------------------------------------------
    def register(self, name: str, source: Any, *, factory: bool, collate: Collate | None) -> int:
        """Hold ``source`` (a dataset, or a zero-argument factory returning one) as ``name``;
        returns its length."""
        dataset = source() if factory else source
        old = self._datasets.get(name)
        if old is not None and isinstance(old.dataset, BlockReader):
            old.dataset.close()  # a later fit() replaced it: end its prefetch threads
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(f"dataset {name!r} is a {type(dataset).__name__}; fit() needs a map-style dataset "
                              "(__len__ and __getitem__), such as a torch.utils.data.Dataset or a datasets.Dataset")
        self._datasets[name] = HeldDataset(dataset=dataset, collate=collate or default_collate)
        return len(dataset)

    def has(self, name: str) -> bool:
        return name in self._datasets

    # -- pieces -----------------------------------------------------------------------------------
    def take(self, piece: Piece, *, timeout_s: float, generation: int | None = None, step: int | None = None) -> Any:
        """The batch ``piece`` names: a staged batch (removed once taken) or the collated samples.
        Waiting for a staged batch of ``generation`` ends when that generation is aborted.
        ``step``: the global batch a training piece belongs to (a block source prefetches the
        ones after it)."""
        if piece.batch_key:
            deadline = time.monotonic() + timeout_s
            with self._arrived:
                while piece.batch_key not in self._staged:
                    if generation is not None and generation <= self._aborted:
                        raise CollectiveError(f"generation {generation} was aborted while this owner waited for "
                                              f"the batch staged as {piece.batch_key!r}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise CollectiveError(f"the batch staged as {piece.batch_key!r} did not reach this owner "
                                              f"within {timeout_s:g}s")
                    self._arrived.wait(left)
                return self._staged.pop(piece.batch_key)
        held = self._datasets.get(piece.dataset)
        if held is None:
            raise ConfigError(f"this owner holds no dataset named {piece.dataset!r} (it holds "
                              f"{sorted(self._datasets)}); register it with fit() first")
        if isinstance(held.dataset, BlockReader):
            return held.collate(held.dataset.read(piece.indices, step=step))
        return held.collate(_samples(held.dataset, piece.indices, piece.dataset))


def _samples(dataset: Any, indices: Sequence[int], name: str) -> list[Any]:
    size = len(dataset)
    bad = [i for i in indices if i >= size]
    if bad:
        raise ConfigError(f"indices {bad[:5]} are outside dataset {name!r} of {size} samples")
    return [dataset[i] for i in indices]
