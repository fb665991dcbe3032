"""The relay step timeline's summary: each phase's and each gap's median and spread, in the
order a step passes them (pure: milliseconds)."""

from __future__ import annotations

import pytest

from benchmarks.relay_step_timeline import PHASES, summarize


def test_phases_and_gaps_are_summarized_in_order() -> None:
    # Ten steps whose phases lie 1 ms apart, the k-th step's whole timeline shifted by k ms
    # and its last phase a further k ms late: the gaps are 1 ms but the last, which spreads.
    rows = [{p: i + k + (k if p == PHASES[-1] else 0) for i, p in enumerate(PHASES)} for k in range(10)]
    table = {name: (median, p10, p90) for name, median, p10, p90 in summarize(rows)}
    assert list(table)[: len(PHASES)] == list(PHASES)
    assert table[PHASES[0]] == (4.5, 1, 9)
    assert table[f"{PHASES[0]} -> {PHASES[1]}"] == (1, 1, 1)
    assert table[f"{PHASES[-2]} -> {PHASES[-1]}"] == (5.5, 2, 10)
    assert len(table) == 2 * len(PHASES) - 1


def test_a_step_missing_a_phase_is_refused() -> None:
    with pytest.raises(KeyError):
        summarize([{p: 0.0 for p in PHASES[1:]}])
