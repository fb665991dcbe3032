"""A run's metrics, read back from Ray's Prometheus endpoint the way a scraper sees them."""

from __future__ import annotations

import functools
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest
import ray
import torch

import zero_ray as zr
from zero_ray.driver import metrics as zm
from zero_ray.models import mlp, mse_loss

pytestmark = pytest.mark.usefixtures("ray_session")

MODEL = functools.partial(mlp, 8, 2)
# Ray exports what a process records every metrics_report_interval_ms (10 s by default); a
# few intervals cover a loaded machine.
DEADLINE_S = 90.0

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g)


def parse_prometheus(text: str) -> list[Sample]:
    """(name, labels, value) for every sample line of the Prometheus text format."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        tags = {k: re.sub(r"\\(.)", r"\1", v) for k, v in _LABEL.findall(labels or "")}
        samples.append((name, tags, float(value)))
    return samples


def _local_endpoint() -> str:
    """The metrics endpoint of the driver's node: where the driver's own metrics are served."""
    here = ray.util.get_node_ip_address()
    for node in ray.nodes():
        if node.get("Alive") and node.get("NodeManagerAddress") == here:
            port = node.get("MetricsExportPort")
            if not port:
                pytest.skip("this Ray has no metrics agent (ray[default] is not installed)")
            return f"http://127.0.0.1:{port}/metrics"
    raise AssertionError(f"the driver's node {here} is not among ray.nodes()")


Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str, run_id: str) -> Series:
    """This run's zero_ray series at ``url``, keyed by (name, sorted labels other than Ray's own)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, OSError):
        return {}  # the agent may still be coming up; the caller scrapes again
    series: Series = {}
    for name, labels, value in parse_prometheus(text):
        if name.startswith("ray_zero_ray_") and labels.get("run_id") == run_id:
            ours = tuple(sorted((k, v) for k, v in labels.items() if k in ("rank", "category", "le")))
            series[(name, ours)] = value
    return series


def _poll_until(url: str, run_id: str, check: Callable[[Series], None]) -> None:
    """Scrape until ``check`` passes (it asserts), or re-raise its last failure at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    series: Series = {}
    while True:
        # Seen here with Ray 2.60: a gauge in one scrape can be missing from later ones until it is
        # set again, so keep what every scrape has shown, as Prometheus's stored series do.
        series.update(_scrape(url, run_id))
        try:
            check(series)
            return
        except (AssertionError, KeyError) as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id}'s metrics at {url} after {DEADLINE_S}s: {err!r}; "
                                     f"saw {series}") from err
        time.sleep(0.5)  # between scrapes only; the check above is what ends the wait


def test_step_counter_loss_traffic_and_memory_reach_rays_metrics_endpoint() -> None:
    url = _local_endpoint()
    steps = 3
    with zr.ZeroTrainer(MODEL, mse_loss, config=zr.ZeroConfig(stage=2, world_size=2)) as trainer:
        for i in range(steps):
            last = trainer.step(_batch(8, seed=i))
        comm = trainer.comm_report()
        memory = trainer.memory_report()
        state_name = zm.prometheus_name(zm.MODEL_STATE_BYTES)

        def check(series: Series) -> None:
            assert series[(zm.prometheus_name(zm.STEPS, counter=True), ())] == steps
            assert series[(zm.prometheus_name(zm.LOSS), ())] == pytest.approx(last["loss"], rel=1e-9)
            assert series[(zm.prometheus_name(zm.STEP_SECONDS) + "_count", ())] == steps
            assert series[(zm.prometheus_name(zm.SAMPLES_PER_SECOND), ())] > 0
            assert series[(zm.prometheus_name(zm.ITEMS_PER_SECOND), ())] > 0
            # the step's own record is the run's total; per rank is what comm_report() recorded
            assert series[(zm.prometheus_name(zm.STEP_BYTES_SENT), ())] == last["bytes_sent"] == \
                sum(c["total"] for c in comm)
            for r in (0, 1):
                assert series[(zm.prometheus_name(zm.BYTES_SENT), (("rank", str(r)),))] == comm[r]["total"] > 0
                for category in zm.MODEL_STATE_CATEGORIES:
                    key = (state_name, (("category", category), ("rank", str(r))))
                    assert series[key] == memory[r][category]
            # The categories partition the total: a sum over them in PromQL counts no byte twice.
            assert sum(v for (name, _), v in series.items() if name == state_name) == sum(m["total"] for m in memory)

        # While the run is alive: that is when a scraper sees it.
        _poll_until(url, trainer.run_id, check)


def test_the_prometheus_parser_reads_labels_with_escapes() -> None:
    text = '# HELP x y\nray_a_total{run_id="r\\"1",rank="0"} 3.0\nray_b 1e3 1700000000\n'
    assert parse_prometheus(text) == [("ray_a_total", {"run_id": 'r"1', "rank": "0"}, 3.0), ("ray_b", {}, 1000.0)]
