"""Activation checkpointing (ZeRO-R's P_a, and P_a+cpu with host offload), applied to a module.

``apply_activation_checkpointing`` wraps the forward of each chosen unit in torch's
non-reentrant ``checkpoint``: autograd keeps the unit's inputs and nothing inside it; backward
recomputes the unit's forward (with the forward's RNG state) when it first needs one of its
tensors. Parameter names are untouched (the module's own ``forward`` is replaced on the
instance, no wrapper module is inserted), so layouts, checkpoints and exports are the same with
or without it.

With ``offload`` the saved inputs go to host memory (pinned on a GPU, copied without blocking)
through torch's ``save_on_cpu`` hooks, entered around the checkpoint: the checkpoint saves its
inputs under the hooks around it and everything inside under its own, so exactly the inputs move.

With ``partition`` (P_a, tensor parallelism T > 1) ``PartitionedInputs`` hooks, entered the same
way, keep only this TP rank's 1/T of each input (flattened, zero-padded to a multiple of T; on
the host too with ``offload``) and all-gather it over the TP group when backward unpacks it, which
is just before the recomputation. An input is replicated over the TP group (a unit holds whole
colwise/rowwise pairs, so what enters it is every rank's same tensor), so the gathered tensor is
the one saved. Only the unit's positional inputs pass through the hooks (torch keeps keyword
tensors, the mask and position embeddings every block shares, by reference): the hidden state.

At stage 3 the recomputation runs while the unit is gathered for its backward (the scheduler
gathers it when gradients reach its outputs, before autograd unpacks anything inside it), and
through ``reentry`` (UnitScheduler.recompute), which enters the unit as its forward's hooks did:
a compiled unit recomputed otherwise recompiles and saves other tensors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_ray.collective.collective_api import Collective

log = logging.getLogger(__name__)


def offload_hooks() -> contextlib.AbstractContextManager[None]:
    """Saved-tensor hooks that keep what autograd saves in host memory until backward."""
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


class SavedInputs:
    """What the checkpointed units' inputs hold on this rank, counted as the hooks keep them:
    ``kept_bytes`` (the tensors held, a slice with P_a), ``whole_bytes`` (the inputs' own size)
    and ``gathered_bytes`` (inputs rebuilt by all-gather before a recomputation), since the start."""

    kept_bytes: int
    whole_bytes: int
    gathered_bytes: int

    def __init__(self) -> None:
        self.kept_bytes = self.whole_bytes = self.gathered_bytes = 0


class _Slice:
    """One input as P_a keeps it: this rank's piece of the flattened, padded tensor."""

    __slots__ = ("piece", "shape", "numel", "device")

    def __init__(self, piece: torch.Tensor, shape: torch.Size, numel: int, device: torch.device) -> None:
        self.piece, self.shape, self.numel, self.device = piece, shape, numel, device


class PartitionedInputs(torch.autograd.graph.saved_tensors_hooks):
    """P_a's saved-tensor hooks over a TP ``group`` (see the module docstring); its all-gathers
    are counted as ``tp_activation`` bytes by the group."""

    def __init__(self, group: Collective, ledger: SavedInputs, *, offload: bool) -> None:
        self.group, self.ledger, self.offload = group, ledger, offload
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Slice:
        size, flat = self.group.world_size, t.detach().reshape(-1)
        n = flat.numel()
        per = -(-n // size)
        lo, hi = min(n, self.group.rank * per), min(n, (self.group.rank + 1) * per)
        piece = torch.zeros(per, dtype=t.dtype, device=t.device)
        piece[:hi - lo].copy_(flat[lo:hi])  # a copy: the whole input is freed with the forward's references
        if self.offload and t.device.type != "cpu":  # P_a+cpu; on a CPU owner the slice is in host memory already
            host = torch.empty(per, dtype=t.dtype, pin_memory=True)
            piece = host.copy_(piece, non_blocking=True)
        self.ledger.kept_bytes += piece.numel() * piece.element_size()
        self.ledger.whole_bytes += n * t.element_size()
        return _Slice(piece, t.shape, n, t.device)

    def _unpack(self, kept: _Slice) -> torch.Tensor:
        size, per = self.group.world_size, kept.piece.numel()
        buf = torch.empty(size * per, dtype=kept.piece.dtype, device=kept.device)
        buf.view(size, per)[self.group.rank].copy_(kept.piece, non_blocking=True)
        self.group.all_gather_(buf, op="activation")
        self.ledger.gathered_bytes += kept.numel * buf.element_size()
        return buf[:kept.numel].view(kept.shape)


Hooks = Callable[[], contextlib.AbstractContextManager[Any]]
# Stage 3's call of a unit's forward, given (path, module, forward, args, kwargs): on the
# recomputation (a call of ``forward``, bypassing the module's hooks) it runs the unit's hooks
# as the forward did (UnitScheduler.recompute).
Reentry = Callable[[str, nn.Module, Callable[..., Any], Any, Any], Any]


def _reentered(forward: Callable[..., Any], reentry: Reentry, path: str, module: nn.Module,
               *args: Any, **kwargs: Any) -> Any:
    return reentry(path, module, forward, args, kwargs)


def _run_checkpointed(forward: Callable[..., Any], hooks: Hooks | None, ledger: SavedInputs | None,
                      *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    if ledger is not None:  # whole inputs kept (P_a's hooks count their slices themselves)
        for t in args:
            if isinstance(t, torch.Tensor):  # what checkpoint saves: its positional tensors
                ledger.kept_bytes += t.numel() * t.element_size()
                ledger.whole_bytes += t.numel() * t.element_size()
    with hooks() if hooks is not None else contextlib.nullcontext():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _no_kv_cache(module: nn.Module) -> None:
    """A Hugging Face model that builds a key/value cache in training would append to it again
    when a unit is recomputed: turn the cache off, as Hugging Face's own gradient checkpointing
    does."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        log.warning("activation checkpointing: setting the model's config.use_cache=False (a cache filled in "
                    "forward would be filled again by the recomputation)")
        config.use_cache = False


def apply_activation_checkpointing(module: nn.Module, paths: Sequence[str], *, offload: bool,
                                   partition: Collective | None = None,
                                   ledger: SavedInputs | None = None, reentry: Reentry | None = None) -> list[str]:
    """Checkpoint each submodule at ``paths`` (in place); returns the paths wrapped.
    ``partition``: the TP group P_a splits the inputs over (``ledger`` counts what it keeps).
    ``reentry``: stage 3's call of each recomputed forward (``Reentry``)."""
    _no_kv_cache(module)
    hooks: Hooks | None = offload_hooks if offload else None
    counted = ledger
    if partition is not None:
        hooks = functools.partial(PartitionedInputs, partition, ledger or SavedInputs(), offload=offload)
        counted = None
    for path in paths:
        sub = module.get_submodule(path)
        forward = sub.forward
        if reentry is not None:
            forward = functools.partial(_reentered, forward, reentry, path, sub)
        sub.forward = functools.partial(_run_checkpointed, forward, hooks, counted)  # type: ignore[method-assign]
    return list(paths)
