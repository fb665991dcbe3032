"""A RecoveryReport's decision and source are typed (Action, Source) and set once, yet read as
the strings they replaced: in its summary (the event log, ``zero-ray status``), in comparisons
and in JSON."""

from __future__ import annotations

import json

import pytest

from zero_ray.core.elastic_policy import Action, Source
from zero_ray.driver.recovery import NotRestored, Outcome, RecoveryReport, Restored
from zero_ray.errors import ConfigError


def _report(outcome: Outcome, source: Source | None) -> RecoveryReport:
    return RecoveryReport(failed_step=4, call="step 5", error="rank 1 died", lost={1: "stream closed"},
                          decision=outcome.decision, reason="ranks [1] were lost", source=source,
                          world_size_before=3, world_size_after=3, resume_step=3, replayed_steps=2, detect_s=0.25,
                          abort_s=0.5, restore_s=1.0, replay_s=2.0, outcome=outcome)


@pytest.mark.parametrize(("outcome", "decision"), [(Outcome.REFORMED, Action.REFORM),
                                                   (Outcome.RESTORED, Action.RESTORE), (Outcome.FAILED, Action.FAIL)])
def test_the_decision_is_the_outcome_s(outcome: Outcome, decision: Action) -> None:
    assert outcome.decision is decision


def test_the_summary_reads_as_before() -> None:
    restored = _report(Outcome.RESTORED, Source.PEER)
    assert restored.summary() == ("step 5 failed (lost ranks [1]): restore from peer, 3 -> 3 owners, replayed 2 steps; "
                                  "detect 0.25s, abort 0.50s, restore 1.00s, replay 2.00s")
    failed = _report(Outcome.FAILED, None)
    assert failed.summary().startswith("step 5 failed (lost ranks [1]): fail, 3 -> 3 owners")


def test_decision_and_source_compare_and_serialise_as_their_values() -> None:
    r = _report(Outcome.RESTORED, Source.CHECKPOINT)
    assert (r.decision, r.source) == ("restore", "checkpoint")
    assert json.loads(json.dumps({"decision": r.decision, "source": r.source})) == {"decision": "restore",
                                                                                    "source": "checkpoint"}
    assert f"{r.source}" == str(r.source) == "checkpoint"


def test_a_restore_record_is_validated() -> None:
    assert Restored(source=Source.PEER, resume_step=0, world_size=2, seconds=0.1).resume_step == 0
    with pytest.raises(ConfigError, match="step -1 at 2 owners"):
        Restored(source=Source.PEER, resume_step=-1, world_size=2, seconds=0.1)
    assert NotRestored().reason is None
