"""Fake handlers and helpers for the control-plane tests (no Ray needed)."""

from __future__ import annotations

import dataclasses

from dataclasses import replace

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from zero_ray.control._generated import common_pb2
from zero_ray.control.auth import PROTOCOL_VERSION, Credentials
from zero_ray.control.client import ClientConfig, CoordinatorClient, OwnerClient
from zero_ray.control.handlers import (
    CheckpointResult,
    CollectiveEvent,
    EvaluateArgs,
    EvaluateResult,
    FailureContext,
    Flight,
    Heartbeat,
    JobStatus,
    LoadResult,
    LossTotals,
    MetricsEvent,
    ModelLayout,
    OwnerStats,
    OwnerStatus,
    ParamInfo,
    Piece,
    RankStatus,
    ResizeResult,
    SavePhase,
    SaveResult,
    SetupResult,
    StepArgs,
    StepResult,
)
from zero_ray.control.server import ControlServer, ServerConfig

# Every wait in these tests is bounded by this, so a bug fails a test instead of hanging it.
WAIT_S = 10.0
LOOPBACK = "127.0.0.1"
# A dataset piece: names and indices (up to 2**64 - 1) must arrive unchanged.
ARGS = StepArgs(step=7, piece=Piece(dataset="train", indices=(0, 5, 2**40, 2**64 - 1)), global_samples=256,
                generation=2, samples_seen=2**40)
TOTALS = LossTotals(loss_sum=2.5, samples=128, count=1536.0, counted=True, items=1536.0)
LAYOUT = ModelLayout(numel=72, padded_numel=80, buckets=2,
                     params=(ParamInfo(name="0.weight", shape=(8, 8), trainable=True),
                             ParamInfo(name="0.bias", shape=(8,), trainable=False)))
# A resize's description as the owners exchange it: integer keys (parameter indices) included.
DESCRIPTION = {"steps_done": 3, "scale": 65536.0, "layout": {"specs": [["0.weight", [8, 8], "float32"]],
                                                             "groups": [[0]]},
               "table": {0: {"scalars": {"step": 3.0}, "elementwise": ["exp_avg"]}}, "replicated": False}
OWNER_STATUS = OwnerStatus(rank=1, world_size=4, generation=2, step=9, samples_seen=72, phase="idle",
                           busy=False, detached=True, node_id="n1", host="h1", ip="10.0.0.6", pid=77,
                           control_address="10.0.0.6:4000", layout=LAYOUT)

# A rank waiting in its 12th reduce-scatter; the 11th finished (a float up to 2**53 and
# a byte count above 2**32 must arrive unchanged).
FLIGHT = Flight(rank=1, phase="backward (step 4, micro-batch 0)", phase_since=1.5e9, now=1.5e9 + 21.25,
                current=CollectiveEvent(op="reduce_scatter", group="zr-g2", seq=12, nbytes=2**33, started=1.5e9 + 1),
                recent=(CollectiveEvent(op="reduce_scatter", group="zr-g2", seq=11, nbytes=64, started=1.5e9,
                                        ended=1.5e9 + 0.5),))


class FakeOwner:
    """An OwnerHandler recording its calls; ``step`` can be made to block."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.steps: list[StepArgs] = []
        self.aborts: list[tuple[str, int]] = []
        self.block_steps = False
        self.step_entered = threading.Event()
        self.release_step = threading.Event()
        self.beats = 0
        # When set, heartbeats after the first wait on this (to simulate a hung owner).
        self.hang_heartbeats: threading.Event | None = None
        self.fail_with: BaseException | None = None
        self.received: list[tuple[str, tuple[Any, ...]]] = []  # the arguments of the membership calls
        self.phase = "computing"  # what failure_context reports

    def step(self, args: StepArgs) -> StepResult:
        self.calls.append("step")
        self.steps.append(args)
        if self.fail_with is not None:
            raise self.fail_with
        if self.block_steps:
            self.step_entered.set()
            if not self.release_step.wait(WAIT_S):
                raise TimeoutError("the test never released the step")
        return self.step_result(args)

    def step_result(self, args: StepArgs) -> StepResult:
        """What a step that was let through answers (a subclass computes its own)."""
        return StepResult(totals=TOTALS, grad_norm=0.75, skipped=False, loss_scale=65536.0, compute_seconds=0.125,
                          rank=1, bytes_sent={"reduce_scatter": 1 << 33, "all_gather": 7})

    def evaluate(self, args: EvaluateArgs) -> EvaluateResult:
        self.calls.append("evaluate")
        return EvaluateResult(totals=replace(TOTALS, samples=len(args.piece.indices)), rank=1)

    def save(self, path: str, step: int, phase: SavePhase) -> SaveResult:
        self.calls.append("save")
        return SaveResult(path=f"{path}/rank-1", step=step, bytes_written=1234)

    def load(self, path: str, step: int) -> LoadResult:
        self.calls.append("load")
        if not path:
            raise FileNotFoundError("no checkpoint at ''")
        return LoadResult(step=step, bytes_read=4321)

    def abort(self, reason: str, generation: int) -> bool:
        self.calls.append("abort")
        self.aborts.append((reason, generation))
        return self.block_steps

    def heartbeat(self) -> Heartbeat:
        self.beats += 1
        if self.hang_heartbeats is not None and self.beats > 1:
            self.hang_heartbeats.wait(WAIT_S)
        return Heartbeat(rank=1, step=self.beats, state="running", timestamp=1700000000.0 + self.beats,
                         rss_bytes=1 << 30)

    def stats(self) -> OwnerStats:
        self.calls.append("stats")
        return OwnerStats(step=9, rank=1, world_size=4, stage=3, memory_bytes={"params": 100, "optimizer": 800},
                          bytes_sent={"all_gather": 5}, inside_node_bytes=3, cross_node_bytes=2)

    def _called(self, name: str, *args: Any) -> None:
        self.calls.append(name)
        self.received.append((name, args))
        if self.fail_with is not None:
            raise self.fail_with

    def setup(self) -> SetupResult:
        self._called("setup")
        return SetupResult(rank=1, layout=LAYOUT)

    def reform(self, generation: int) -> bool:
        self._called("reform", generation)
        return generation % 2 == 0

    def set_peers(self, backup: int, ward: int) -> None:
        self._called("set_peers", backup, ward)

    def snapshots(self, committed_step: int, layout_complete: bool) -> Any:
        self._called("snapshots", committed_step, layout_complete)
        return {1: {"step": committed_step, "world_size": 4, "scalars": DESCRIPTION}}

    def resize_info(self) -> Any:
        self._called("resize_info")
        return DESCRIPTION

    def reshard(self, *, old_world: int, new_world: int, generation: int, description: Any) -> int:
        self._called("reshard", old_world, new_world, generation, description)
        return 1 << 40

    def rebuild(self, *, position: int, world_size: int, generation: int, restore: Any) -> int:
        self._called("rebuild", position, world_size, generation, restore)
        return 0 if restore is None else 123

    def status(self) -> OwnerStatus:
        self._called("status")
        return OWNER_STATUS

    def close(self) -> None:
        self._called("close")

    def flight(self) -> Flight:
        self._called("flight")
        return FLIGHT

    def failure_context(self) -> FailureContext:
        return FailureContext(rank=1, phase=self.phase)


STATUS = JobStatus(
    world_size=2, stage=2, step=1200, last_loss=2.3412, state="running",
    ranks=(
        RankStatus(rank=0, node="10.0.0.5", healthy=True, state="running", last_heartbeat=1700000000.0,
                   memory={"params": 3 << 30, "grads": 1 << 30}),
        RankStatus(rank=1, node="10.0.0.6", healthy=False, state="lost", last_heartbeat=0.0, memory={}),
    ),
)


class FakeCoordinator:
    """A CoordinatorHandler recording its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.world_size = 2
        self.metric_steps = 3

    def status(self, flight: bool = False) -> JobStatus:
        self.calls.append(("status", flight))
        return dataclasses.replace(STATUS, flight=("no rank diverged from the others",)) if flight else STATUS

    def checkpoint(self, path: str | None) -> CheckpointResult:
        self.calls.append(("checkpoint", path))
        return CheckpointResult(path=path or "/ckpt/default/step-1200", step=1200)

    def stop(self, reason: str) -> str:
        self.calls.append(("stop", reason))
        return "stopping"

    def resize(self, world_size: int) -> ResizeResult:
        self.calls.append(("resize", world_size))
        previous, self.world_size = self.world_size, world_size
        return ResizeResult(previous_world_size=previous, world_size=world_size)

    def metrics(self, cancelled: threading.Event) -> Iterator[MetricsEvent]:
        self.calls.append(("metrics", None))
        for step in range(1, self.metric_steps + 1):
            if cancelled.is_set():
                return
            yield MetricsEvent(step=step, loss=1.0 / step, step_seconds=0.5, tokens_per_second=1000.0 * step,
                               values={"lr": 1e-4})


@dataclass
class Served:
    """A started server, its fake handler and a connected client."""

    server: ControlServer
    handler: Any  # FakeOwner or FakeCoordinator
    client: OwnerClient | CoordinatorClient
    credentials: Credentials

    @property
    def address(self) -> str:
        return self.server.address

    def client_config(self, **overrides: object) -> ClientConfig:
        values: dict[str, object] = {"address": self.address, "credentials": self.credentials, "timeout_s": WAIT_S}
        values.update(overrides)
        return ClientConfig(**values)  # type: ignore[arg-type]


def server_config(credentials: Credentials, **overrides: object) -> ServerConfig:
    values: dict[str, object] = {"host": LOOPBACK, "credentials": credentials, "threads": 4, "max_streams": 2,
                                 "grace_s": 0.0}
    values.update(overrides)
    return ServerConfig(**values)  # type: ignore[arg-type]


def raw_channel(address: str) -> grpc.Channel:
    """A plain channel, for calls that bypass the typed clients' header and token."""
    return grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])


def header(credentials: Credentials, *, job_id: str | None = None,
           protocol_version: int = PROTOCOL_VERSION) -> common_pb2.RequestHeader:
    """A RequestHeader as a well-behaved client sends it, or with one field wrong."""
    return common_pb2.RequestHeader(job_id=credentials.job_id if job_id is None else job_id,
                                    protocol_version=protocol_version)
