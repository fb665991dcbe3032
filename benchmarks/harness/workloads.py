"""The models a benchmark trains: a model, its loss, its data, and how FSDP2 wraps it.

Model and batch factories are module-level functions bound with ``functools.partial`` so that
they pickle by reference and rebuild identically on every actor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from zero_ray.core.batching import Batch
from zero_ray.errors import ConfigError
from zero_ray.models import GPT, GPTConfig, lm_loss, mlp, mse_loss

ModelFn = Callable[[], torch.nn.Module]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
BatchFn = Callable[[torch.Generator, int], Batch]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One benchmark model.

    name: the key used on the command line and in the results.
    model_fn / loss_fn: as a ZeroTrainer takes them.
    make_batch: ``(generator, global_samples) -> batch``.
    per_rank_batch: samples each rank gets; the global batch is ``per_rank_batch * world_size``.
    fsdp_units: class names of the submodules FSDP2 shards as units (then the root).
    blocks: class names of the repeated blocks whose ``forward`` the hand-compiled systems
        ``torch.compile`` one by one: what ``ZeroConfig(compile=True)`` finds itself
        (``core.stage3_units.repeated_blocks``), so eager and compiled systems compile the same regions.
    description: one line for the report.
    """

    name: str
    model_fn: ModelFn
    loss_fn: LossFn
    make_batch: BatchFn
    per_rank_batch: int
    fsdp_units: tuple[str, ...]
    description: str
    blocks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"workload name={self.name!r} must be a non-empty identifier")
        for field in ("model_fn", "loss_fn", "make_batch"):
            if not callable(getattr(self, field)):
                raise ConfigError(f"workload {self.name!r}: {field}={getattr(self, field)!r} must be callable")
        if not isinstance(self.per_rank_batch, int) or self.per_rank_batch < 1:
            raise ConfigError(f"workload {self.name!r}: per_rank_batch={self.per_rank_batch!r} must be an integer >= 1")

    def global_batch(self, world_size: int) -> int:
        return self.per_rank_batch * world_size

    def batches(self, count: int, *, world_size: int, seed: int) -> list[Batch]:
        """``count`` global batches, the same for every system (one seeded generator)."""
        if count < 1:
            raise ConfigError(f"{count=} batches: need at least one")
        g = torch.Generator().manual_seed(seed)
        return [self.make_batch(g, self.global_batch(world_size)) for _ in range(count)]

    def compiled_by_hand(self) -> Workload:
        """This workload with each of its ``blocks``' ``forward`` torch.compile'd in ``model_fn``,
        as a user compiles a model in one process (the reference for ``ZeroConfig(compile=True)``)."""
        if not self.blocks:
            raise ConfigError(f"workload {self.name!r} names no blocks to compile")
        return replace(self, model_fn=functools.partial(compiled_model, self.model_fn, self.blocks))

    def num_params(self) -> int:
        """Distinct parameters of one replica (tied weights once)."""
        torch.manual_seed(0)
        return sum(p.numel() for p in self.model_fn().parameters())


def compiled_model(model_fn: ModelFn, blocks: tuple[str, ...]) -> torch.nn.Module:
    """``model_fn()`` with the ``forward`` of every submodule whose class is named in ``blocks``
    replaced by ``torch.compile(forward)`` on the instance (module-level: it pickles to actors)."""
    module = model_fn()
    found = 0
    for sub in module.modules():
        if type(sub).__name__ in blocks:
            sub.forward = torch.compile(sub.forward)  # type: ignore[method-assign]
            found += 1
    if not found:  # compiling nothing would time eager under a compiled name
        raise ConfigError(f"no module of {type(module).__name__} is one of the blocks {blocks} to compile")
    return module


def _regression_batch(g: torch.Generator, n: int, *, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def _token_batch(g: torch.Generator, n: int, *, vocab: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, length), generator=g)


def mlp_workload(*, width: int = 1024, depth: int = 8, per_rank_batch: int = 32) -> Workload:
    """``mlp(width, depth)`` regressing random targets with MSE (the issues' benchmark model)."""
    if width < 1 or depth < 1:
        raise ConfigError(f"mlp width={width} and depth={depth} must be >= 1")
    return Workload(name="mlp", model_fn=functools.partial(mlp, width, depth), loss_fn=mse_loss,
                    make_batch=functools.partial(_regression_batch, width=width), per_rank_batch=per_rank_batch,
                    fsdp_units=("Linear",), blocks=("Linear",),
                    description=f"mlp({width}, {depth}): {depth} x (Linear({width},{width}) + ReLU), MSE, "
                                f"batch {per_rank_batch}/rank")


# Small enough for a single CPU thread per rank to take well under a second a step, large
# enough that communication is not all there is: about 3.2M parameters.
GPT_BENCH = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256)


def gpt_workload(*, cfg: GPTConfig = GPT_BENCH, per_rank_batch: int = 8) -> Workload:
    """A small GPT (tied embeddings) on random tokens, next-token cross entropy."""
    return Workload(name="gpt", model_fn=functools.partial(GPT, cfg), loss_fn=lm_loss,
                    make_batch=functools.partial(_token_batch, vocab=cfg.vocab_size, length=cfg.block_size + 1),
                    per_rank_batch=per_rank_batch, fsdp_units=("Block",), blocks=("Block",),
                    description=f"GPT(layers={cfg.n_layer}, embd={cfg.n_embd}, heads={cfg.n_head}, "
                                f"ctx={cfg.block_size}, vocab={cfg.vocab_size}), tied embeddings, "
                                f"batch {per_rank_batch}x{cfg.block_size}/rank")


WORKLOADS: Mapping[str, Callable[..., Workload]] = {"mlp": mlp_workload, "gpt": gpt_workload}
