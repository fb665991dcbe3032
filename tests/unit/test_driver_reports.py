"""The records ZeroTrainer hands back (StepMetrics, ResizeReport) read as the dicts users have
always read, and the driver's one view of the owners' model layout (ModelView)."""

from __future__ import annotations

import json

import pytest

from zero_ray.control.handlers import LossTotals, ModelLayout, OwnerStatus, ParamInfo, StepResult
from zero_ray.cli.operator_commands import format_detached
from zero_ray.core.reply_combine import CombinedStep, combine_steps
from zero_ray.driver.pool import ModelView
from zero_ray.driver.reports import ResizeReport, StepMetrics


def _results(*, counted: bool = False, nonfinite: bool = False) -> list[StepResult]:
    def totals(loss_sum: float) -> LossTotals:
        return LossTotals(loss_sum=loss_sum, samples=2, items=6, count=3 if counted else 0, counted=counted)

    return [StepResult(totals=totals(3.0), grad_norm=2.0, lr=0.1, compute_seconds=0.2, data_seconds=0.05,
                       bytes_sent={"reduce_scatter": 10, "all_gather": 5}, rank=0,
                       nonfinite_loss_ranks=(1,) if nonfinite else (), skipped=nonfinite),
            StepResult(totals=totals(9.0), grad_norm=2.0, lr=0.1, compute_seconds=0.4, data_seconds=0.01,
                       bytes_sent={"reduce_scatter": 7}, rank=1, skipped=nonfinite)]


def _reply(*, counted: bool = False, nonfinite: bool = False) -> CombinedStep:
    return combine_steps(CombinedStep.of(r) for r in _results(counted=counted, nonfinite=nonfinite))


def test_step_metrics_read_as_the_dict_they_replace() -> None:
    m = StepMetrics.of(_reply(), step=4, samples=4, seconds=0.5, sent_ahead=True)
    expected = {"step": 4, "loss": 3.0, "grad_norm": 2.0, "lr": 0.1, "skipped": False, "loss_scale": 0.0,
                "samples": 4, "items": 12, "items_per_second": 24.0, "step_seconds": 0.5,
                "owner_compute_seconds": 0.4, "data_wait_seconds": 0.05, "bytes_sent": 22, "sent_ahead": True}
    assert dict(m) == expected and list(m) == list(expected)  # the same keys, in the same order
    assert m == expected and m["items"] == m.item_count == 12 and m.get("count") is None
    assert "count" not in m and "nonfinite_loss_ranks" not in m and "eval_loss" not in m
    assert json.loads(json.dumps(dict(m))) == expected
    with pytest.raises(KeyError):
        m["item_count"]  # the field's key is "items": Mapping.items stays a method
    assert dict(m.items()) == expected


def test_step_metrics_optional_fields_appear_when_set() -> None:
    m = StepMetrics.of(_reply(counted=True, nonfinite=True), step=1, samples=4, seconds=0.0, sent_ahead=False)
    assert m["count"] == 6 and m["loss"] == 2.0  # the mean over counted items: 12 / 6
    assert m["nonfinite_loss_ranks"] == [1] and m["nonfinite_grad_ranks"] == [] and m["skipped"]
    assert m["items_per_second"] == 0.0
    evaluated = m.with_eval_loss(1.25)
    assert evaluated["eval_loss"] == 1.25 and "eval_loss" not in m and len(evaluated) == len(m) + 1


def test_resize_report_reads_as_a_dict() -> None:
    report = ResizeReport(previous_world_size=2, world_size=4, bytes_sent=100, seconds=1.5)
    assert report["world_size"] == 4 and report["previous_world_size"] == 2
    assert dict(report) == {"previous_world_size": 2, "world_size": 4, "bytes_sent": 100, "seconds": 1.5}
    assert dict(ResizeReport.unchanged(3)) == {"previous_world_size": 3, "world_size": 3, "bytes_sent": 0,
                                               "seconds": 0.0}


def test_model_view_of_the_owners_layout() -> None:
    layout = ModelLayout(numel=26, padded_numel=28, buckets=1,
                         params=(ParamInfo(name="w", shape=(4, 5), trainable=True),
                                 ParamInfo(name="b", shape=(4,), trainable=False),
                                 ParamInfo(name="s", shape=(), trainable=True)))
    view = ModelView.of(layout)
    assert view.numel == 26 and list(view.shapes) == ["w", "b", "s"] and view.shapes["w"] == (4, 5)
    assert view.trainable == {"w", "s"} and view.trainable_numel == 21
    assert ModelView.of(None) == ModelView(numel=0, shapes={}, trainable=frozenset())


def test_detached_runs_printed_from_typed_statuses() -> None:
    owners = [OwnerStatus(rank=r, step=3 + r, phase="idle", generation=r, ip=f"10.0.0.{r}") for r in range(2)]
    text = format_detached({"abc123": owners})
    assert text.splitlines()[-1].split() == ["abc123", "2", "3/4", "1", "idle", "10.0.0.0,10.0.0.1"]
    assert format_detached({}) == "no detached runs"
