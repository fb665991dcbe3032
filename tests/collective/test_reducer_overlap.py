"""The gradient reducers' overlap, without Ray: one rank of two over a recording group.

The group records every collective (a copy of the buffer, the thread it ran on, when it began)
and acts as if the other rank contributed zeros, so each recorded buffer and each reduced slice
can be compared bit for bit with plain autograd's gradients. Checked: buckets are reduced in
index order on the communication thread while backward still runs (stage 2 every micro-batch,
stages 0-1 during the last one), with exactly the gradients a synchronous reduction sees; the
stage-2 staging memory is bounded; close() after a failed or blocked collective returns at once.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

import zero_ray as zr
from zero_ray.collective.collective_api import SoloGroup, chunks
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.stages import stage_plan
from zero_ray.errors import CollectiveError, ModelError
from zero_ray.models import mlp, mse_loss
from zero_ray.core.precision import LossScaleConfig
from zero_ray.owner.step.model_state import STAGING_BUFFERS, ModelState
from zero_ray.owner.step.param_group import ParamGroup
from zero_ray.owner.step.reducer import GradReducer
from zero_ray.owner.step.run_spec import EngineSpec

COMM_THREAD = "zero_ray-grads-0"


@dataclass(frozen=True, kw_only=True)
class Call:
    op: str
    buf: torch.Tensor
    thread: str
    at: float


class RecordingGroup(SoloGroup):
    """Rank 0 of 2; the absent peer contributes zeros. ``block`` makes every collective wait
    until ``abort()`` and then fail, like one blocked on a dead peer; ``fail_at`` fails the
    collective with that index."""

    def __init__(self, *, block: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        self.world_size = 2
        self.calls: list[Call] = []
        self._aborted = threading.Event()
        self._block, self._fail_at = block, fail_at

    def _record(self, op: str, buf: torch.Tensor) -> None:
        self.calls.append(Call(op=op, buf=buf.clone(), thread=threading.current_thread().name, at=time.perf_counter()))
        if self._block:
            self._aborted.wait(timeout=30)
            raise CollectiveError(f"{op}: the group was aborted")
        if self._fail_at == len(self.calls) - 1:
            raise CollectiveError(f"{op}: peer lost")

    def reduce_scatter_(self, buf: torch.Tensor, *, op: str = "reduce_scatter") -> torch.Tensor:
        self._record(op, buf)
        return chunks(buf, self.world_size)[self.rank]

    def all_reduce_(self, buf: torch.Tensor) -> None:
        self._record("all_reduce", buf)

    def abort(self) -> None:
        self._aborted.set()


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps, so that what runs beside backward can be seen."""

    finished_at = 0.0

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def, override]
        time.sleep(0.2)
        SlowBackward.finished_at = time.perf_counter()
        return grad


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(SlowBackward.apply(torch.relu(self.a(x))))


LINEAR = 16 * 16 + 16  # one Linear(16, 16) per bucket


class Shard:
    """What a test reads of a rank's model state: its groups (one per bucket) and layout."""

    def __init__(self, state: ModelState) -> None:
        self.state = state
        self.layout: FlatLayout = state.layout
        self.buckets: list[ParamGroup] = state.groups

    def release_grads(self) -> None:
        self.state.end_step()


def _bind(stage: int, module: torch.nn.Module, group: RecordingGroup, *, bucket_numel: int,
          micro_batches: int | None = None) -> tuple[Shard, GradReducer]:
    """``module`` as rank 0 of 2 binds it; without ``micro_batches`` the reducer is not told
    how many micro-batches a step has and learns it from the first step."""
    spec = EngineSpec(model_fn=lambda: module, loss_fn=mse_loss, optimizers=(zr.SGD(lr=0.1),), plan=stage_plan(stage),
                      compute_dtype=torch.float32, device="cpu", seed=0, bucket_bytes=bucket_numel * 4,
                      grad_accum_steps=micro_batches or 1, max_grad_norm=None, loss_scale=LossScaleConfig())
    state = ModelState(spec, rank=0, group=group, device=torch.device("cpu"))  # type: ignore[arg-type]
    state.reducer.micro_batches = micro_batches
    return Shard(state), state.reducer


def _micro_batches(k: int, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(5, width, generator=g), torch.randn(5, width, generator=g)) for _ in range(k)]


def _run_step(module: torch.nn.Module, reducer: GradReducer, micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
              backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> None:
    for i, batch in enumerate(micro):
        reducer.begin_micro_batch()
        backward(mse_loss(module, batch))
        reducer.end_micro_batch(last=i == len(micro) - 1)


def _flat_grads(shard: Shard, ref: torch.nn.Module) -> list[torch.Tensor]:
    """The reference module's gradients laid out as the shard's padded buckets."""
    params = list(ref.parameters())
    out = []
    for b in shard.buckets:
        flat = torch.zeros(b.bucket.padded_numel)
        for i in b.bucket.params:
            p = shard.layout.params[i]
            flat[p.offset:p.end] = params[i].grad.reshape(-1)
        out.append(flat)
    return out


def _reference_grads(shard: Shard, ref: torch.nn.Module,
                     micro: Sequence[tuple[torch.Tensor, torch.Tensor]], *, accumulate: bool) -> list[list[torch.Tensor]]:
    """Per micro-batch (or once, accumulated over all of them), the bucketed gradients."""
    out = []
    for batch in micro:
        if not accumulate:
            ref.zero_grad(set_to_none=True)
        mse_loss(ref, batch).backward()
        if not accumulate:
            out.append(_flat_grads(shard, ref))
    return out if not accumulate else [_flat_grads(shard, ref)]


def _stage2_step(module: torch.nn.Module) -> tuple[Shard, GradReducer, RecordingGroup, list[list[torch.Tensor]]]:
    """One stage-2 step of two micro-batches, one Linear per bucket; with each micro-batch's
    bucketed gradients from plain autograd on a copy of the module."""
    ref = copy.deepcopy(module)
    group = RecordingGroup()
    shard, reducer = _bind(2, module, group, bucket_numel=LINEAR)
    micro = _micro_batches(2)
    expected = _reference_grads(shard, ref, micro, accumulate=False)
    _run_step(module, reducer, micro)
    return shard, reducer, group, expected


@pytest.mark.parametrize("depth", [3, 5])
def test_stage2_reduces_buckets_in_order_on_the_comm_thread_with_plain_autograd_gradients(depth: int) -> None:
    torch.manual_seed(0)
    module = mlp(16, depth)
    shard, reducer, group, expected = _stage2_step(module)
    nb = len(shard.buckets)
    assert nb == depth
    assert [c.op for c in group.calls] == ["reduce_scatter"] * (2 * nb)
    assert {c.thread for c in group.calls} == {COMM_THREAD}
    for k, call in enumerate(group.calls):
        assert torch.equal(call.buf, expected[k // nb][k % nb]), f"micro-batch {k // nb}, bucket {k % nb}"
    for b in shard.buckets:
        want = torch.zeros(b.bucket.shard_numel).add_(expected[0][b.bucket.index].chunk(2)[0])
        want.add_(expected[1][b.bucket.index].chunk(2)[0])
        assert torch.equal(b.grad_shard, want)
    assert all(p.grad is None for p in module.parameters())  # dropped once staged
    # Constant staging: STAGING_BUFFERS of the largest bucket however deep the model is.
    largest = max(b.bucket.padded_numel for b in shard.buckets) * 4
    assert largest <= reducer.peak_staging_bytes() <= STAGING_BUFFERS * largest
    reducer.close()


def test_stage2_with_one_bucket_keeps_one_staging_buffer() -> None:
    torch.manual_seed(0)
    module = mlp(16, 2)
    group = RecordingGroup()
    shard, reducer = _bind(2, module, group, bucket_numel=10**6)
    _run_step(module, reducer, _micro_batches(3))
    assert len(shard.buckets) == 1 and len(group.calls) == 3
    assert reducer.peak_staging_bytes() == shard.buckets[0].bucket.padded_numel * 4
    reducer.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_bucket_is_reduced_while_backward_still_runs(stage: int) -> None:
    torch.manual_seed(0)
    module = TwoLayers()
    ref = copy.deepcopy(module)
    group = RecordingGroup()
    shard, reducer = _bind(stage, module, group, bucket_numel=LINEAR)
    assert len(shard.buckets) == 2  # b's parameters in bucket 0, a's in bucket 1
    micro = _micro_batches(2)
    expected = _reference_grads(shard, ref, micro, accumulate=stage < 2)
    op = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce_scatter"}[stage]
    for step in range(2):
        group.calls.clear()
        _run_step(module, reducer, micro)
        per_step = 2 if stage < 2 else 4
        assert [c.op for c in group.calls] == [op] * per_step
        assert {c.thread for c in group.calls} == {COMM_THREAD}
        # Stages 0-1 learn in the first step which micro-batch is the last; from then on, and
        # for stage 2 always, bucket 0 is reduced during the slow part of backward.
        overlapped = stage == 2 or step == 1
        first = group.calls[-2]
        assert (first.at < SlowBackward.finished_at) is overlapped
        if stage < 2:
            for call, want in zip(group.calls, expected[0]):
                assert torch.equal(call.buf, want)  # both micro-batches accumulated, nothing more
            shard.release_grads()  # as the engine does after the update
    reducer.close()


def test_stage1_overlaps_from_the_first_step_when_told_the_micro_batches() -> None:
    torch.manual_seed(0)
    module = TwoLayers()
    group = RecordingGroup()
    shard, reducer = _bind(1, module, group, bucket_numel=LINEAR, micro_batches=2)
    _run_step(module, reducer, _micro_batches(2))
    assert len(group.calls) == 2 and group.calls[0].at < SlowBackward.finished_at
    with pytest.raises(ModelError, match="more followed"):
        _run_step(module, reducer, _micro_batches(3))  # the count is fixed per step
    reducer.close()


def test_a_gradient_arriving_after_its_bucket_was_reduced_is_an_error() -> None:
    torch.manual_seed(0)
    module = mlp(16, 3)
    shard, reducer = _bind(2, module, RecordingGroup(), bucket_numel=LINEAR)

    def twice(loss: torch.Tensor) -> None:
        loss.backward(retain_graph=True)
        loss.backward()

    with pytest.raises(ModelError, match="arrived after its bucket was reduced"):
        _run_step(module, reducer, _micro_batches(1), backward=twice)
    reducer.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_failed_collective_fails_the_micro_batch_and_close_returns(stage: int) -> None:
    torch.manual_seed(0)
    module = mlp(16, 4)
    group = RecordingGroup(fail_at=0)
    shard, reducer = _bind(stage, module, group, bucket_numel=LINEAR, micro_batches=1)
    with pytest.raises(CollectiveError, match="peer lost"):
        _run_step(module, reducer, _micro_batches(1))
    start = time.perf_counter()
    reducer.close()
    assert time.perf_counter() - start < 5
    assert all(not b.grad_shard.any() for b in shard.buckets if b.grad_shard is not None)
    assert all(not b.grads.any() for b in shard.buckets if b.grads is not None)


@pytest.mark.parametrize("stage", [1, 2])
def test_close_cancels_queued_collectives_and_zeroes_what_an_interrupted_one_wrote(stage: int) -> None:
    torch.manual_seed(0)
    module = mlp(16, 2)  # two buckets: both staging buffers, so backward itself never waits
    group = RecordingGroup(block=True)
    shard, reducer = _bind(stage, module, group, bucket_numel=LINEAR, micro_batches=1)
    reducer.begin_micro_batch()
    mse_loss(module, _micro_batches(1)[0]).backward()  # bucket 0 blocks; the others queue behind it
    time.sleep(0.1)
    assert len(group.calls) == 1
    threading.Timer(0.2, group.abort).start()  # what the owner's abort does from its gRPC thread
    start = time.perf_counter()
    reducer.close()
    assert time.perf_counter() - start < 10
    assert len(group.calls) == 1  # the queued buckets never ran
    assert all(not b.grad_shard.any() for b in shard.buckets if b.grad_shard is not None)
    assert all(not b.grads.any() for b in shard.buckets if b.grads is not None)


def test_stage2_groups_reduce_every_micro_batch_through_staging() -> None:
    torch.manual_seed(0)
    shard, reducer = _bind(2, mlp(16, 2), RecordingGroup(), bucket_numel=LINEAR)
    assert all(g.policy.grads.value == "per_micro_batch" and g.policy.params.value == "whole" for g in shard.buckets)
    assert reducer.peak_staging_bytes() == 0  # staging buffers are allocated on first use
    reducer.close()


class Reversed(torch.nn.Module):
    """Registered a, b, c but applied c first: backward produces a's gradients first, the
    opposite of the bucket order (reverse registration: c, b, a)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.relu(self.b(torch.relu(self.c(x)))))


def test_stage2_gradients_out_of_bucket_order_get_a_temporary_buffer_and_stay_exact() -> None:
    torch.manual_seed(0)
    shard, reducer, group, expected = _stage2_step(Reversed())
    assert len(group.calls) == 6
    for k, call in enumerate(group.calls):
        assert torch.equal(call.buf, expected[k // 3][k % 3])  # still in bucket order, exact
    bucket = shard.buckets[0].bucket.padded_numel * 4
    assert reducer.peak_staging_bytes() == (STAGING_BUFFERS + 1) * bucket  # the pool and one temporary
    reducer.close()
