"""Every method of both services round-trips plain values over real gRPC on loopback."""

from __future__ import annotations

import grpc
import pytest
from dataclasses import replace

from control_fakes import ARGS, STATUS, TOTALS, WAIT_S, Served, header, raw_channel

from zero_ray.control._generated import coordinator_pb2, coordinator_pb2_grpc
from zero_ray.control.auth import bearer_metadata
from zero_ray.control.handlers import (
    CheckpointResult,
    Heartbeat,
    LoadResult,
    OwnerStats,
    ResizeResult,
    SaveResult,
    EvaluateArgs,
    EvaluateResult,
    Piece,
    StepArgs,
    StepResult,
)
from zero_ray.errors import CheckpointError, ConfigError, ControlError, OwnerError


def test_status_round_trip(coordinator: Served) -> None:
    assert coordinator.client.status() == STATUS
    flight = coordinator.client.status(flight=True)
    assert flight.flight == ("no rank diverged from the others",) and flight.step == STATUS.step
    assert coordinator.handler.calls == [("status", False), ("status", True)]


def test_coordinator_actions(coordinator: Served) -> None:
    client, handler = coordinator.client, coordinator.handler
    assert client.checkpoint() == CheckpointResult(path="/ckpt/default/step-1200", step=1200)
    assert client.checkpoint("/ckpt/now") == CheckpointResult(path="/ckpt/now", step=1200)
    assert client.stop("maintenance") == "stopping"
    assert client.resize(4) == ResizeResult(previous_world_size=2, world_size=4)
    # An empty proto string reaches the handler as None: "use the configured directory".
    assert handler.calls == [("checkpoint", None), ("checkpoint", "/ckpt/now"), ("stop", "maintenance"),
                             ("resize", 4)]


def test_metrics_stream_ends_with_training(coordinator: Served) -> None:
    with coordinator.client.metrics(timeout_s=10.0) as events:
        steps = [event.step for event in events]
    assert steps == [1, 2, 3]


def test_step_round_trip(owner: Served) -> None:
    result = owner.client.step(ARGS, timeout_s=5.0)
    assert result == StepResult(totals=TOTALS, grad_norm=0.75, skipped=False, loss_scale=65536.0,
                                compute_seconds=0.125, rank=1,
                                bytes_sent={"reduce_scatter": 1 << 33, "all_gather": 7})
    assert owner.handler.steps == [ARGS]  # the piece's dataset and indices arrive untouched
    staged = replace(ARGS, piece=Piece(batch_key="2:7"))
    owner.client.step(staged, timeout_s=5.0)
    assert owner.handler.steps[-1] == staged


def test_a_refused_non_finite_step_round_trips(owner: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = StepResult(totals=replace(TOTALS, loss_sum=float("inf")), grad_norm=float("inf"), skipped=True,
                         loss_scale=1.0, compute_seconds=0.5, rank=3, nonfinite_loss_ranks=(3,),
                         nonfinite_grad_ranks=(0, 1, 2, 3), refused=True)
    monkeypatch.setattr(owner.handler, "step", lambda args: refused)
    assert owner.client.step(ARGS, timeout_s=5.0) == refused


def test_evaluate_round_trip(owner: Served) -> None:
    result = owner.client.evaluate(EvaluateArgs(piece=Piece(dataset="eval", indices=(3, 4)), generation=2))
    assert result == EvaluateResult(totals=replace(TOTALS, samples=2), rank=1)
    assert owner.handler.calls == ["evaluate"]


def test_a_piece_names_one_source() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        Piece(batch_key="0:1", dataset="train")
    with pytest.raises(ConfigError, match="exactly one"):
        Piece()
    with pytest.raises(ConfigError, match="indices belong to a dataset"):
        Piece(batch_key="0:1", indices=(1,))


def test_owner_state_calls(owner: Served) -> None:
    client = owner.client
    assert client.save("/ckpt/s", 7) == SaveResult(path="/ckpt/s/rank-1", step=7, bytes_written=1234)
    assert client.load("/ckpt/s", 7) == LoadResult(step=7, bytes_read=4321)
    assert client.stats() == OwnerStats(step=9, rank=1, world_size=4, stage=3,
                                        memory_bytes={"params": 100, "optimizer": 800}, bytes_sent={"all_gather": 5},
                                        inside_node_bytes=3, cross_node_bytes=2)
    assert client.abort("peer lost", 2) is False
    assert owner.handler.aborts == [("peer lost", 2)]


def test_heartbeat_stream_delivers_heartbeats(owner: Served) -> None:
    with owner.client.heartbeats(0.02) as beats:
        received = [next(beats) for _ in range(3)]
    assert [beat.step for beat in received] == [1, 2, 3]
    assert received[0] == Heartbeat(rank=1, step=1, state="running", timestamp=1700000001.0, rss_bytes=1 << 30)


@pytest.mark.parametrize(("raised", "code"), [
    (ConfigError("lr=-1 must be > 0"), grpc.StatusCode.INVALID_ARGUMENT),
    (OwnerError("rank 3 died", rank=3), grpc.StatusCode.ABORTED),
    (CheckpointError("shard 2 is missing"), grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_handler_exceptions_become_status_codes(owner: Served, raised: Exception, code: grpc.StatusCode) -> None:
    owner.handler.fail_with = raised
    with pytest.raises(ControlError) as info:
        owner.client.step(ARGS)
    assert info.value.__cause__.code() is code
    message = str(info.value)
    assert "PartitionOwner.Step" in message and type(raised).__name__ in message and str(raised) in message


def test_missing_checkpoint_is_not_found(owner: Served) -> None:
    with pytest.raises(ControlError, match="NOT_FOUND.*FileNotFoundError"):
        owner.client.load("", 3)


def test_invalid_arguments_are_refused_before_the_handler(coordinator: Served) -> None:
    with pytest.raises(ConfigError, match="global_samples=-1"):
        StepArgs(step=1, piece=Piece(batch_key="0:1"), global_samples=-1, generation=0)
    with pytest.raises(ConfigError, match="world_size=0"):
        coordinator.client.resize(0)
    # The server checks as well, for clients that skip the local check.
    with raw_channel(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.ResizeRequest(header=header(coordinator.credentials), world_size=0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Resize(request, timeout=WAIT_S, metadata=bearer_metadata(coordinator.credentials.token))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "world_size=0" in info.value.details()
    assert coordinator.handler.calls == []
