"""Median/min/max summaries of timing samples."""

from __future__ import annotations

import math

import pytest

from benchmarks.harness.stats import Summary, summarise
from zero_ray.errors import ConfigError


def test_odd_count_takes_the_middle_value() -> None:
    s = summarise([0.3, 0.1, 0.2, 5.0, 0.25])
    assert s == Summary(median=0.25, min=0.1, max=5.0, n=5)


def test_even_count_averages_the_two_middle_values() -> None:
    s = summarise([4.0, 1.0, 3.0, 2.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 4.0, 4)


def test_one_sample() -> None:
    assert summarise([7]) == Summary(median=7.0, min=7.0, max=7.0, n=1)


def test_scaled_converts_units() -> None:
    s = summarise([0.001, 0.002, 0.004]).scaled(1e3)
    assert s.median == pytest.approx(2.0) and s.min == pytest.approx(1.0) and s.max == pytest.approx(4.0)
    assert s.n == 3


def test_median_is_robust_to_one_long_step() -> None:
    # A shared machine's stray long step must not move the headline number.
    assert summarise([0.1] * 9 + [100.0]).median == pytest.approx(0.1)


@pytest.mark.parametrize("bad", [[], [1.0, math.nan], [math.inf]])
def test_rejects_empty_and_non_finite(bad: list[float]) -> None:
    with pytest.raises(ConfigError):
        summarise(bad)


def test_summary_validates_its_fields() -> None:
    with pytest.raises(ConfigError, match="n=0"):
        Summary(median=1.0, min=1.0, max=1.0, n=0)
    with pytest.raises(ConfigError, match="inconsistent"):
        Summary(median=3.0, min=1.0, max=2.0, n=2)
