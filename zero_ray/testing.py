"""Reference runs in plain PyTorch: one process, and DDP over Ray actors on gloo.

What a ZeroTrainer's results are checked against, by the tests, the benchmarks and users
checking their own model: ``single_process`` (the arithmetic every stage must reproduce) and
``DDPRun`` / ``ddp_params`` (the data-parallel system ZeRO replaces). Nothing in zero_ray imports
this module.

Both see the same data as a ZeroTrainer: the global batch split along dim 0 as evenly as
possible. DDP averages gradients over ranks, so with uneven splits each rank's loss is
weighted by ``world_size * samples / global_samples`` to make DDP's average the global mean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes
from zero_ray.core.optimizer_plan import OptimizerFactory, SchedulerFactory

ModelFn = Callable[[], torch.nn.Module]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
Factories = OptimizerFactory | Sequence[OptimizerFactory]

__all__ = ["DDPRun", "DDPWorker", "Factories", "LossFn", "ModelFn", "build_optimizers", "ddp_params",
           "single_process"]


def build_optimizers(optimizer: Factories, module: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers the factory (or each of the factories) builds over ``module``."""
    factories = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return [f(module) for f in factories]


def single_process(model_fn: ModelFn, loss_fn: LossFn, optimizer: Factories, batches: Sequence[Batch], *,
                   seed: int = 0, max_grad_norm: float | None = None,
                   lr_scheduler: SchedulerFactory | None = None,
                   pieces: tuple[int, int] = (1, 1)) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``torch.manual_seed(seed); model_fn()`` with the optimizers ``optimizer`` builds
    (a factory or a list of them, as a ZeroTrainer takes) on whole batches, the scheduler
    factory applied to each; return the final parameters and the per-step losses.

    ``pieces=(ranks, micro_batches)``: run each batch as that many ranks and micro-batches split
    it, accumulating each piece's loss weighted by its share of the batch: the distributed
    computation in one process, for models whose forward depends on the piece it sees (a branch
    only some ranks take), and the measure of data-parallel noise."""
    torch.manual_seed(seed)
    module = model_fn()
    opts = build_optimizers(optimizer, module)
    scheds = [lr_scheduler(o) for o in opts] if lr_scheduler is not None else []
    losses = []
    ranks, micro = pieces
    for batch in batches:
        for opt in opts:
            opt.zero_grad()
        if ranks * micro > 1:
            n = batch_size(batch)
            total = 0.0
            for piece in split_batch(batch, split_sizes(n, ranks)):
                for part in split_batch(piece, split_sizes(batch_size(piece), micro)):
                    part_loss = loss_fn(module, part)
                    (part_loss * (batch_size(part) / n)).backward()
                    total += float(part_loss.detach()) * batch_size(part)
            loss = torch.tensor(total / n)
        else:
            loss = loss_fn(module, batch)
            loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_grad_norm)
        for opt in opts:
            opt.step()
        for sched in scheds:
            sched.step()
        losses.append(float(loss.detach()))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, losses


class DDPWorker:
    """One rank of PyTorch DistributedDataParallel on the gloo group Ray forms."""

    def __init__(self, *, rank: int, world_size: int, group_name: str, model_fn: ModelFn, loss_fn: LossFn,
                 optimizer: Factories, seed: int, max_grad_norm: float | None, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self._model_fn, self._loss_fn, self._optimizer = model_fn, loss_fn, optimizer
        self._seed, self._max_grad_norm = seed, max_grad_norm

    def setup(self) -> None:
        """Join the gloo group and build the seeded module, wrapped in DDP, and its optimizers."""
        import ray.util.collective as col
        from torch.nn.parallel import DistributedDataParallel

        from zero_ray.compat.ray_private import process_group_of

        col.init_collective_group(self.world_size, self.rank, backend="gloo", group_name=self.group_name)
        pg = process_group_of(self.group_name)
        torch.manual_seed(self._seed)
        self.module = DistributedDataParallel(self._model_fn(), process_group=pg)
        self.opts = build_optimizers(self._optimizer, self.module.module)

    def step(self, piece: Batch, global_samples: int) -> tuple[float, float]:
        """One optimizer step on this rank's piece; returns (loss * samples, seconds)."""
        start = time.perf_counter()
        for opt in self.opts:
            opt.zero_grad()
        n = batch_size(piece)
        loss = self._loss_fn(self.module, piece)
        (loss * (self.world_size * n / global_samples)).backward()
        if self._max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self._max_grad_norm)
        for opt in self.opts:
            opt.step()
        return float(loss) * n, time.perf_counter() - start

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the parameters by name (without DDP's ``module.`` prefix)."""
        return {n: p.detach().clone() for n, p in self.module.module.named_parameters()}

    def close(self) -> None:
        """Leave the gloo group."""
        import ray.util.collective as col

        col.destroy_collective_group(self.group_name)


class DDPRun:
    """``world_size`` DDPWorker actors trained on the same global batches as a ZeroTrainer."""

    def __init__(self, model_fn: ModelFn, loss_fn: LossFn, optimizer: Factories, *, world_size: int,
                 seed: int = 0, max_grad_norm: float | None = None, num_cpus: float = 1.0,
                 timeout_s: float = 300.0) -> None:
        import uuid

        name = f"ddp-{uuid.uuid4().hex[:8]}"
        cls = ray.remote(num_cpus=num_cpus)(DDPWorker)
        self.workers = [cls.remote(rank=r, world_size=world_size, group_name=name, model_fn=model_fn, loss_fn=loss_fn,
                                   optimizer=optimizer, seed=seed, max_grad_norm=max_grad_norm,
                                   threads=max(1, int(num_cpus))) for r in range(world_size)]
        self.world_size = world_size
        self.timeout_s = timeout_s
        ray.get([w.setup.remote() for w in self.workers], timeout=timeout_s)

    def step(self, batch: Batch) -> dict[str, float]:
        """One step on the global batch split over the ranks; returns the global mean ``loss``
        and the slowest rank's ``step_seconds``."""
        n = batch_size(batch)
        pieces = split_batch(batch, split_sizes(n, self.world_size))
        out = ray.get([w.step.remote(p, n) for w, p in zip(self.workers, pieces)], timeout=self.timeout_s)
        return {"loss": sum(o[0] for o in out) / n, "step_seconds": max(o[1] for o in out)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0's parameters by name (every rank holds the same)."""
        return ray.get(self.workers[0].state_dict.remote(), timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Leave the group where it still closes, and kill the actors."""
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=10)
        except Exception:  # a broken group may not close; the actors are killed anyway
            pass
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def ddp_params(model_fn: ModelFn, loss_fn: LossFn, optimizer: Factories, batches: Sequence[Batch], *,
               world_size: int, max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Train ``batches`` with PyTorch DDP on ``world_size`` actors; the final parameters."""
    ddp = DDPRun(model_fn, loss_fn, optimizer, world_size=world_size, max_grad_norm=max_grad_norm)
    try:
        for batch in batches:
            ddp.step(batch)
        return ddp.state_dict()
    finally:
        ddp.shutdown()
