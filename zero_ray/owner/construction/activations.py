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

At stage 3 the recomputation runs while the unit is gathered for its backward (the scheduler
gathers it when gradients reach its outputs, before autograd unpacks anything inside it).
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

log = logging.getLogger(__name__)


def offload_hooks() -> contextlib.AbstractContextManager[None]:
    """Saved-tensor hooks that keep what autograd saves in host memory until backward."""
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def _run_checkpointed(forward: Callable[..., Any], offload: bool, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return forward(*args, **kwargs)
    with offload_hooks() if offload else contextlib.nullcontext():
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


def apply_activation_checkpointing(module: nn.Module, paths: Sequence[str], *, offload: bool) -> list[str]:
    """Checkpoint each submodule at ``paths`` (in place); returns the paths wrapped."""
    _no_kv_cache(module)
    for path in paths:
        sub = module.get_submodule(path)
        sub.forward = functools.partial(_run_checkpointed, sub.forward, offload)  # type: ignore[method-assign]
    return list(paths)
