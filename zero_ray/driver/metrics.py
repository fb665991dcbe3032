"""A run's metrics, exported through Ray's own metrics pipeline (``ray.util.metrics``).

Ray sends what a process records to the metrics agent of its node, which serves it in the
Prometheus text format at ``http://<node address>:<MetricsExportPort>/metrics`` (the port is in
``ray.nodes()``; ``ray.init(_metrics_export_port=...)`` or ``ray start --metrics-export-port``
fixes it). Ray prefixes every name with ``ray_`` and counters also get a ``_total`` suffix, so
``zero_ray_steps`` is scraped as ``ray_zero_ray_steps_total``. Values reach the endpoint on the
recorder's next export, every ``metrics_report_interval_ms`` (10 s by default), not at once.

Everything the driver records is tagged ``run_id`` (the trainer's control-plane job id), so runs
that share a cluster, or a Prometheus, stay apart.

Steps are recorded on a thread of their own every ``PUBLISH_S``, as Ray Train reports on its own
schedule rather than from the training loop: the stepper only appends each step's metrics to
``RunMetrics.completed``, so no step waits on Ray's metric calls (six per step). Every step is
still recorded (the counter and the histogram count each one; the gauges end at the last), at
most ``PUBLISH_S`` later, which is well inside Ray's own export interval.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence

import ray
from ray.util.metrics import Counter, Gauge, Histogram

from zero_ray.driver.reports import StepMetrics

log = logging.getLogger(__name__)

PREFIX = "zero_ray_"

# The categories of trainer.memory_report() that add up to its "total": the finer ones
# ("optimizer_master", "padding_grads", ...) are parts of these and would count bytes twice
# in a sum over the category tag.
MODEL_STATE_CATEGORIES: tuple[str, ...] = ("params", "grads", "optimizer", "optimizer_scalars", "padding")

# Step times on anything from a toy model on a laptop to a large model on a slow network.
STEP_SECONDS_BOUNDARIES: list[float] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]

# The names as they are recorded; the endpoint shows them as "ray_" + name (+ "_total").
STEPS = PREFIX + "steps"
STEP_SECONDS = PREFIX + "step_seconds"
LOSS = PREFIX + "loss"
SAMPLES_PER_SECOND = PREFIX + "samples_per_second"
ITEMS_PER_SECOND = PREFIX + "items_per_second"
BYTES_SENT = PREFIX + "bytes_sent"
STEP_BYTES_SENT = PREFIX + "step_bytes_sent"
MODEL_STATE_BYTES = PREFIX + "model_state_bytes"

# How often completed steps are recorded: a tenth of Ray's default export interval (10 s), so the
# endpoint shows a step at most one export late, as when each step was recorded at once.
PUBLISH_S = 1.0


def prometheus_name(name: str, *, counter: bool = False) -> str:
    """The name under which Ray's metrics endpoint serves a metric recorded as ``name``."""
    return "ray_" + name + ("_total" if counter else "")


class RunMetrics:
    """The driver's metrics for one training run: the steps in ``completed`` recorded every
    ``publish_s`` on a thread of its own from ``start`` on, and what remains at ``close``.

    Recording never raises: a metrics pipeline that is missing or misbehaving must not fail a
    training step, so errors are logged (once) and the step carries on.
    """

    def __init__(self, run_id: str, *, publish_s: float = PUBLISH_S) -> None:
        self.run_id = run_id
        self._warned = False
        # Appended by the stepper (a deque's append and popleft are thread-safe), drained here.
        self.completed: deque[StepMetrics] = deque()
        self._publish_s = publish_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish, name="zero_ray-metrics", daemon=True)
        tags = {"run_id": run_id}
        self._steps = Counter(STEPS, description="Optimizer steps completed by the run.",
                              tag_keys=("run_id",)).set_default_tags(tags)
        self._step_seconds = Histogram(STEP_SECONDS, description="Wall time of a step seen by the driver (s).",
                                       boundaries=STEP_SECONDS_BOUNDARIES,
                                       tag_keys=("run_id",)).set_default_tags(tags)
        self._loss = Gauge(LOSS, description="Mean loss over the last step's global batch, before the update.",
                           tag_keys=("run_id",)).set_default_tags(tags)
        self._samples_per_second = Gauge(SAMPLES_PER_SECOND, description="Global samples per second in the last step.",
                                         tag_keys=("run_id",)).set_default_tags(tags)
        self._items_per_second = Gauge(ITEMS_PER_SECOND,
                                       description="Items per second in the last step: tokens when loss_fn returns "
                                                   "(loss_sum, count) or batches are token ids, else samples.",
                                       tag_keys=("run_id",)).set_default_tags(tags)
        self._bytes_sent = Gauge(BYTES_SENT, description="Bytes a rank sent over collectives in the last step "
                                                         "(recorded by trainer.comm_report()).",
                                 tag_keys=("run_id", "rank")).set_default_tags(tags)
        self._step_bytes_sent = Gauge(STEP_BYTES_SENT, description="Bytes every rank together sent over "
                                                                   "collectives in the last step.",
                                      tag_keys=("run_id",)).set_default_tags(tags)
        self._model_state = Gauge(MODEL_STATE_BYTES,
                                  description="Model-state bytes a rank holds, by category (measured from tensors).",
                                  tag_keys=("run_id", "rank", "category")).set_default_tags(tags)

    def start(self) -> None:
        """Record completed steps from now on (the run is up)."""
        self._thread.start()

    def close(self) -> None:
        """Record the steps still in ``completed`` and stop."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)

    def _publish(self) -> None:
        """Every ``publish_s`` until closed, then once more: each completed step recorded as it
        was when each was recorded at once. Nothing per rank: a gauge per owner per step would
        cost the driver O(owners) a step, which the relay tree exists to avoid (``record_comm``
        records them on request)."""
        stopping = False
        while not stopping:
            stopping = self._stop.wait(self._publish_s)
            while self.completed:  # in order, as when each step was recorded at once
                metrics = self.completed.popleft()
                try:
                    seconds = float(metrics.step_seconds)
                    self._steps.inc(1)
                    self._step_seconds.observe(seconds)
                    self._loss.set(float(metrics.loss))
                    if seconds > 0:
                        self._samples_per_second.set(float(metrics.samples) / seconds)
                        self._items_per_second.set(float(metrics.item_count) / seconds)
                    self._step_bytes_sent.set(float(metrics.bytes_sent))
                except Exception:
                    self._warn("step")

    def record_comm(self, reports: Sequence[Mapping[str, int]]) -> None:
        """Record ``trainer.comm_report()``: per rank, the bytes it sent in the last step."""
        try:
            for report in reports:
                self._bytes_sent.set(float(report["total"]), tags={"rank": str(report["rank"])})
        except Exception:
            self._warn("traffic")

    def record_memory(self, reports: Sequence[Mapping[str, int]]) -> None:
        """Record ``trainer.memory_report()``: per rank, bytes by model-state category."""
        try:
            for report in reports:
                rank = str(report["rank"])
                for category in MODEL_STATE_CATEGORIES:
                    self._model_state.set(float(report.get(category, 0)), tags={"rank": rank, "category": category})
        except Exception:
            self._warn("memory")

    def _warn(self, what: str) -> None:
        # Once per run: a broken pipeline would otherwise log on every step.
        if not self._warned:
            self._warned = True
            log.warning("run %s: could not record %s metrics; training goes on", self.run_id, what, exc_info=True)
        else:
            log.debug("run %s: could not record %s metrics", self.run_id, what, exc_info=True)


def metrics_endpoints() -> list[str]:
    """``http://ADDRESS:PORT/metrics`` of every live node's Ray metrics agent: what Prometheus
    scrapes (the driver's metrics are on the driver's node). Needs ``ray.init()`` first."""
    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return urls
