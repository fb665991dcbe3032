"""OwnerEngine: one rank's training step (no Ray here; the actor wraps it).

A step: split this rank's piece of the global batch into micro-batches; forward and backward
each with its loss weighted by ``samples / global_samples`` (so the sum over all ranks and
micro-batches is exactly the global-mean gradient, uneven splits included); let the model state
combine gradients; agree with the other ranks, in one small all-reduce, on the global norm and
on which parameters got a gradient anywhere and on which ranks saw a non-finite loss or
gradient; unscale and check for overflow, clip by the global norm, update this rank's slices of
the parameters that did (``torch.optim`` skips the others), and publish them.

A step whose loss or reduced gradient is non-finite on any rank is not applied anywhere
(``ZeroConfig.on_nonfinite``): every rank learns it from the same all-reduce, so all decide
alike, and the RNG and buffers its forward changed are put back (``owner/step/rollback.py``). The
owner never raises for it: the result says so and the driver raises (or counts a skip).

What a rank holds, and so how gradients are combined and parameters reach the module, is the
``ModelState``: parameter groups whose policies say it (``zero_ray.owner.step.model_state``).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from zero_ray.collective.flight_recorder import FlightRecorder
from zero_ray.collective.collective_api import Collective
from zero_ray.core.records import LossTotals, StepResult
from zero_ray.core.devices import allocator_figures
from zero_ray.core.stall_diagnosis import IDLE
from zero_ray.core.batching import Batch, batch_size, split_batch, split_sizes, to_device
from zero_ray.core.optim_state import StateTable
from zero_ray.core.run_position import Position
from zero_ray.core.precision import LossScaler
from zero_ray.core.restore_plan import RunCounters, TransferDescription
from zero_ray.core.updated_params import UpdateShare
from zero_ray.errors import ConfigError, ModelError
from zero_ray.owner.step.rank_collectives import Fabric
from zero_ray.owner.step.model_state import ModelState
from zero_ray.owner.step.rollback import StepGuard
from zero_ray.owner.step.run_spec import EngineSpec


class StepPhase(enum.Enum):
    """Where a rank is in its step; an interrupted step is safe to discard until UPDATING."""

    IDLE = "idle"
    COMPUTING = "computing"  # forward, backward and gradient reduction: weights untouched
    UPDATING = "updating"  # the optimizer is changing weights / gathering updated parameters


def loss_terms(out: Any) -> tuple[torch.Tensor, float | None]:
    """``loss_fn``'s result as (loss, count): a scalar mean (count None) or the pair
    ``(loss_sum, count)`` with count an int or a 0-d tensor."""
    count: float | None = None
    loss = out
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise ModelError(f"loss_fn returned a {type(out).__name__} of {len(out)} items; return the mean loss, "
                             "or the pair (loss_sum, count)")
        loss, raw = out
        if isinstance(raw, torch.Tensor):
            if raw.numel() != 1:
                raise ModelError(f"loss_fn's count must be an int or a 0-d tensor; got shape {tuple(raw.shape)}")
            raw = raw.item()
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not (math.isfinite(raw) and raw >= 0):
            raise ModelError(f"loss_fn's count={raw!r} must be a finite number of items >= 0")
        count = float(raw)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        if count is not None:
            raise ModelError(f"loss_fn's loss_sum must be a scalar tensor (the sum of per-item losses); got {shape}")
        raise ModelError(f"loss_fn must return a scalar tensor (the mean loss over the batch) or the pair "
                         f"(loss_sum, count); got {shape}")
    return loss.reshape(()), count


def items_of(piece: Batch, samples: int, count: float | None) -> float:
    """The throughput unit of a piece: its count, else the tokens of an integer (token) batch,
    else its samples."""
    if count is not None:
        return count
    first = piece if isinstance(piece, torch.Tensor) else next(iter(piece.values() if isinstance(piece, Mapping)
                                                                    else piece), None)
    if isinstance(first, torch.Tensor) and not first.is_floating_point() and first.dim() >= 2:
        return float(first.numel())
    return float(samples)


class _Tally:
    """A loss summed over micro-batches: per-item sums and counts, or per-sample means."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.count = 0.0
        self.counted: bool | None = None

    def add(self, loss: torch.Tensor, count: float | None, samples: int) -> None:
        counted = count is not None
        if self.counted is not None and counted != self.counted:
            raise ModelError("loss_fn returned a pair (loss_sum, count) for some micro-batches and a mean for others; "
                             "return one form throughout")
        self.counted = counted
        value = float(loss.detach().float())
        if count is None:
            self.loss_sum += value * samples
        else:
            self.loss_sum += value
            self.count += count

    def totals(self, samples: int, piece: Batch) -> LossTotals:
        counted = bool(self.counted)
        return LossTotals(loss_sum=self.loss_sum, samples=samples, count=self.count if counted else 0.0,
                          counted=counted, items=items_of(piece, samples, self.count if counted else None))


class _NonFinite:
    """Which ranks saw a non-finite loss (their own piece) and which hold a non-finite slice of
    the reduced gradient (their update range; every rank where the gradient is replicated)."""

    def __init__(self, loss_ranks: list[int], grad_ranks: list[int]) -> None:
        self.loss_ranks, self.grad_ranks = tuple(loss_ranks), tuple(grad_ranks)


class OwnerEngine:
    """One rank's model state and step."""

    def __init__(self, spec: EngineSpec, *, rank: int, group: Collective, nodes: Sequence[str] | None = None,
                 flight: FlightRecorder | None = None) -> None:
        self.spec = spec
        self.flight = flight if flight is not None else FlightRecorder()  # the owner's, kept across engines
        self.rank = rank
        self.world_size = group.world_size
        self.group = group
        self.device = torch.device(spec.device)
        # nodes: the node of every rank (the actor asks Ray; None: one node), for the Topology
        self.fabric = Fabric(spec.topology, group, nodes, tensor_parallel=spec.tensor_parallel)
        # Known at setup, so the step reads them rather than asking the plan and the fabric again.
        self._whole: bool = spec.plan.updates_whole_buffer  # this rank updates every element it holds
        self._speaks_for_tp: bool = self.fabric.ranks.tp_rank(rank) == 0  # see _reported
        # The data rank: every TP rank of a data-parallel rank reads that rank's samples.
        self.data_rank, self.data_world_size = self.fabric.data_rank, self.fabric.data_world_size
        self.state = ModelState(spec, rank=rank, group=group, device=self.device, fabric=self.fabric)
        self.layout = self.state.layout
        self.module = self.state.module
        self.scaler = LossScaler(config=spec.loss_scale, enabled=spec.compute_dtype == torch.float16)
        # The run's position as the driver counts it (core/run_position.py): set from each completed
        # step's arguments, a loaded checkpoint or moved counters; the engine counts nothing itself.
        self.position = Position()
        self.guard = StepGuard(self.module, self.device)
        self.last_bytes: dict[str, int] = {}
        self.last_peers: dict[int, int] = {}  # the last step's bytes by the world rank they went to
        self._phase = StepPhase.IDLE  # the engine's own: moved by its step, updating() and discard_step()

    @property
    def phase(self) -> StepPhase:
        """Where this rank is in its step (read by heartbeats, aborts and failure reports)."""
        return self._phase

    def _move(self, to: StepPhase, *, expected: StepPhase) -> None:
        assert self._phase is expected, f"rank {self.rank}: {to.value} from {self._phase.value}, not {expected.value}"
        self._phase = to

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around a change of the model state outside a step (a peer snapshot, a new layout's
        copy). It counts as updating until it is done: if it raises, the phase stays UPDATING, so
        ``discard_step`` reports the state inconsistent and it is restored, never retried on top."""
        self._move(StepPhase.UPDATING, expected=StepPhase.IDLE)
        yield
        self._move(StepPhase.IDLE, expected=StepPhase.UPDATING)

    # -- the step -------------------------------------------------------------------------------
    def _micro_batches(self, piece: Batch) -> tuple[int, list[int]]:
        samples = batch_size(piece)
        sizes = split_sizes(samples, self.spec.grad_accum_steps)
        if min(sizes) == 0:
            raise ConfigError(f"this rank's {samples} samples cannot fill grad_accum_steps={self.spec.grad_accum_steps} "
                              "micro-batches; use a global batch of at least world_size * grad_accum_steps")
        return samples, sizes

    def step(self, piece: Batch, *, global_samples: int, position: Position | None = None) -> StepResult:
        """Forward and backward over this rank's piece of the global batch, then the update.
        ``position``: the driver's position before this step (default: this engine's); once the
        step completes the engine is at ``position.after(global_samples)``. A step refused for
        non-finite values (``on_nonfinite="raise"``) changes nothing, the position included.

        ``loss_fn`` returns the mean loss over its batch, or the pair ``(loss_sum, count)``: the
        sum of per-item losses and the number of items. A mean is weighted by ``samples /
        global_samples``; a sum is differentiated as ``loss_sum / global_samples`` and the
        reduced gradient rescaled by ``global_samples / global_count`` once the step's count is
        summed over every rank and micro-batch: the gradient of the single-process mean over
        all items, uneven splits and accumulation included."""
        self.group.counters.reset()
        spec = self.spec
        at = self.position if position is None else position
        samples, sizes = self._micro_batches(piece)
        scale = self.scaler.scale
        kept = self.guard.keep()
        self._phase = StepPhase.COMPUTING  # from IDLE, or a step that raised and was not discarded
        self.state.optimizer.read_ahead()  # offloaded: the update's first group comes in while this computes
        tally = _Tally()
        compute = 0.0
        self.module.train()
        flight = self.flight
        with self.state.sync.computing():
            for i, micro in enumerate(split_batch(piece, sizes)):
                t0 = time.perf_counter()
                self.state.begin_micro_batch()
                flight.phase(f"forward (step {at.step + 1}, micro-batch {i})")
                loss, count = loss_terms(spec.loss_fn(self.module, to_device(micro, self.device, spec.compute_dtype)))
                weight = (sizes[i] if count is None else 1.0) / global_samples
                scaled = loss.float() * (weight * scale)
                flight.phase(f"backward (step {at.step + 1}, micro-batch {i})")
                scaled.backward()
                compute += time.perf_counter() - t0
                self.state.end_micro_batch(last=i == len(sizes) - 1)
                tally.add(loss, count, sizes[i])
            lr = self.state.optimizer.lr()  # what this step uses; the scheduler moves it afterwards
            flight.phase(f"update (step {at.step + 1})")
            norm, skipped, bad = self._update(inv_scale=1.0 / scale, count=tally.count if tally.counted else None,
                                              global_samples=global_samples,
                                              loss_finite=math.isfinite(tally.loss_sum))
            self.state.end_step()
        self._phase = StepPhase.IDLE  # COMPUTING, or UPDATING once the update began
        flight.phase(IDLE)
        self.last_bytes = self.group.counters.snapshot()
        self.last_peers = self.group.counters.by_peer()
        refused = bad is not None and spec.on_nonfinite == "raise"
        if bad is not None:
            self.guard.restore(kept)
        if not refused:
            self.position = at.after(global_samples)
        return StepResult(rank=self.rank, totals=self._reported(tally.totals(samples, piece)), grad_norm=norm, skipped=skipped, lr=lr,
                          loss_scale=scale, compute_seconds=compute, bytes_sent=self.last_bytes,
                          nonfinite_loss_ranks=bad.loss_ranks if bad else (),
                          nonfinite_grad_ranks=bad.grad_ranks if bad else (), refused=refused)

    def evaluate(self, piece: Batch) -> LossTotals:
        """This rank's loss on ``piece``, forward only: the module in eval mode (dropout off),
        no gradients, no change to any state (at stage 3 units are gathered and freed)."""
        _, sizes = self._micro_batches(piece)
        tally = _Tally()
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), self.state.sync.computing(), self.state.forward_only():
                for i, (size, micro) in enumerate(zip(sizes, split_batch(piece, sizes))):
                    self.flight.phase(f"evaluate forward (micro-batch {i})")
                    loss, count = loss_terms(self.spec.loss_fn(self.module, to_device(micro, self.device,
                                                                                     self.spec.compute_dtype)))
                    tally.add(loss, count, size)
        finally:
            self.module.train(was_training)
            self.flight.phase(IDLE)
        return self._reported(tally.totals(batch_size(piece), piece))

    def _reported(self, totals: LossTotals) -> LossTotals:
        """What this rank reports of its piece's loss: the T ranks of a TP group read the same
        samples, so TP rank 0 speaks for them and the others report none; summed over every
        rank's reply (the driver's, a relay's) the totals are then the data-parallel ranks' own."""
        if self._speaks_for_tp:
            return totals
        return LossTotals(loss_sum=0.0, samples=0, count=0.0, counted=False, items=0.0)

    def _update(self, *, inv_scale: float, count: float | None, global_samples: int,
                loss_finite: bool) -> tuple[float, bool, _NonFinite | None]:
        """Returns the global norm (before clipping), whether the update was skipped, and the
        non-finite ranks when the step was not applied for them (None otherwise: fp16 overflow
        is a skip alone)."""
        spec = self.spec
        grads: list[torch.Tensor] = []
        for g in self.state.update_grads():
            g = g if g.dtype == torch.float32 else g.float()
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            grads.append(g)
        # Each rank's update slice is either the whole buffer (replicated optimizer: every rank
        # already has the full reduced gradient) or its shard (the squares are summed across
        # ranks), in one all-reduce with the items counted, the marks of the parameters that
        # got a gradient, and per rank whether its loss and its slice's squares were finite.
        ranks = self.fabric.ranks
        if ranks.size > 1:
            # Tensor parallelism: the norm spans the TP shards too, so it is always summed, a
            # replicated parameter counted once per TP group; TP ranks of one DP rank read the
            # same samples, so one of them counts the items (core/tensor_parallel_ranks.py).
            sharded, replicated = self.state.tp_squares(grads)
            sq = sharded + replicated
            squares: float | None = ranks.squares_share(self.rank, sharded=sharded, replicated=replicated,
                                                        whole=self._whole)
            count = None if count is None else ranks.count_share(self.rank, count)
        else:
            sq = sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads)
            squares = None if self._whole else sq
        share = UpdateShare(rank=self.rank, world_size=self.world_size, squares=squares, count=count,
                            marks=tuple(self.state.used_marks()), loss_nonfinite=not loss_finite,
                            grad_nonfinite=not math.isfinite(sq))
        sums = share.unpack(self.state.all_reduce_values(share.pack()))
        if sums.squares is not None:
            # with shard groups every shard is summed once per group holding it
            sq = sums.squares if self.fabric.replicas == 1 else sums.squares / self.fabric.replicas
        used = self.state.expand_marks(list(sums.used))
        loss_ranks, grad_ranks = list(sums.loss_ranks), list(sums.grad_ranks)
        if sums.count is not None:
            total = sums.count
            if not total > 0:
                raise ModelError(f"the step's loss covers {total:g} items over every rank and micro-batch; "
                                 "loss_fn's (loss_sum, count) needs a positive total count")
            factor = global_samples / total  # the step differentiated loss_sum / global_samples
            for g in grads:
                g.mul_(factor)
            sq *= factor * factor
        norm = math.sqrt(sq) if math.isfinite(sq) else math.inf
        grads_finite = not grad_ranks and math.isfinite(norm)
        # A non-finite loss is the batch's, never overflow; non-finite gradients from finite
        # losses are what fp16 loss scaling expects now and then: the scaler backs off and skips.
        if loss_ranks or (not grads_finite and not self.scaler.enabled):
            return norm, True, _NonFinite(loss_ranks, grad_ranks)
        # Without fp16 there is no scale to move (update() would only say so): asked only when enabled.
        if self.scaler.enabled and self.scaler.update(found_inf=not grads_finite):
            return norm, True, None
        if spec.max_grad_norm is not None:
            coef = min(1.0, spec.max_grad_norm / (norm + 1e-6))
            for g in grads:
                g.mul_(coef)
        self._move(StepPhase.UPDATING, expected=StepPhase.COMPUTING)
        self.state.apply_update(grads, used=used)
        return norm, False, None

    # -- recovery ---------------------------------------------------------------------------------
    def discard_step(self) -> bool:
        """Forget an interrupted step. Returns whether the model state is still consistent
        (the step never reached its update), i.e. whether training may simply continue."""
        consistent = self._phase is not StepPhase.UPDATING
        self.state.discard()
        self._phase = StepPhase.IDLE
        self.flight.phase(IDLE)
        return consistent

    def rebind(self, group: Collective) -> None:
        """Use a re-formed group (a new generation) from the next step on."""
        self.group = group
        self.state.rebind(group)
        self.fabric = self.state.fabric
        self._speaks_for_tp = self.fabric.ranks.tp_rank(self.rank) == 0

    def counters(self) -> RunCounters:
        """What a moved or restored model state continues from besides its tensors (equal on
        every rank): the run's position, the loss scaler, hyperparameters and schedulers."""
        return RunCounters(position=self.position, scale=self.scaler.scale,
                           growth_tracker=self.scaler.growth_tracker, hyper=self.state.optimizer.hyper_state())

    def set_counters(self, counters: RunCounters) -> None:
        self.position = counters.position
        self.state.optimizer.load_hyper_state(counters.hyper)
        self.scaler.scale, self.scaler.growth_tracker = counters.scale, counters.growth_tracker

    def transfer_description(self, table: StateTable | None = None) -> TransferDescription:
        """This rank's part of what a transfer of its state is planned from (``table``: the
        merged state table when the caller has one, else the entries of what this rank updates)."""
        optimizer = self.state.optimizer
        return TransferDescription(layout=self.layout.describe(),
                                   whole_params=tuple(sorted(optimizer.whole_plan.assignee)),
                                   replicated=self.spec.plan.updates_whole_buffer,
                                   table=dict(optimizer.table() if table is None else table),
                                   counters=self.counters())

    # -- reports ----------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        report = {"rank": self.rank, **self.state.memory_report()}
        report["numel"] = self.layout.numel
        report["padded_numel"] = self.layout.padded_numel
        if self.device.type == "cuda":  # the allocator's view beside the tensor count
            report.update(allocator_figures(torch.cuda.memory_stats(self.device)).report())
        return report

    def comm_report(self) -> dict[str, int]:
        """The last step's bytes sent, by collective, in all, and inside this rank's node / to others."""
        return {"rank": self.rank, **self.last_bytes, "total": sum(self.last_bytes.values()),
                **self.fabric.split(self.last_peers)}

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self.state.master_fragments()
