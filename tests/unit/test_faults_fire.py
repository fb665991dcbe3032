"""The fault hooks fail loudly: a hook point that is missing raises as the hooks install, and a
fault that never fired fails ``assert_fired``; the rank a fault is keyed by is never silently
unknown; the mid-step kills a test plans are compared with those carried out."""

from __future__ import annotations

import types

import pytest
import torch

from tests.faults import Fault, _building_rank, _wrap, assert_fired, fired_kills, marker, planned_kills


def test_wrap_names_a_missing_hook_point() -> None:
    owner = types.SimpleNamespace(present=lambda: 1)
    with pytest.raises(AttributeError, match="renamed_away"):
        _wrap(owner, "renamed_away", lambda *a, **k: None)


def test_wrap_refuses_a_non_callable() -> None:
    owner = types.SimpleNamespace(value=3)
    with pytest.raises(AttributeError, match="not callable"):
        _wrap(owner, "value", lambda *a, **k: None)


def test_wrap_calls_the_hook_before_the_original() -> None:
    seen: list[str] = []
    owner = types.SimpleNamespace(f=lambda x: seen.append(f"f{x}") or x * 2)
    _wrap(owner, "f", lambda x: seen.append(f"hook{x}"))
    assert owner.f(4) == 8
    assert seen == ["hook4", "f4"]


def test_assert_fired_fails_for_a_fault_that_did_not_fire(tmp_path) -> None:
    fault = Fault(point="backward", rank=1, dir=str(tmp_path))
    with pytest.raises(AssertionError, match="never fired"):
        assert_fired(fault)
    with open(marker(str(tmp_path), "backward"), "w", encoding="ascii") as fh:
        fh.write("123.5")
    assert assert_fired(fault) == 123.5


def test_every_hook_point_exists_in_the_library() -> None:
    # In a child process: installing wraps library functions for the rest of the process.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from tests.faults import _install; _install()"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_the_building_rank_is_never_silently_unknown() -> None:
    with pytest.raises(AssertionError, match="not called by a zero_ray.owner.step.model_state.ModelState"):
        _building_rank()


def test_planned_and_fired_kills_by_marker(tmp_path) -> None:
    x = torch.zeros(6, 2)
    x[0, 0], x[3, 0] = -101.0, -102.0
    assert planned_kills([(x, x)]) == {0, 1}
    (tmp_path / "killed101").touch()
    (tmp_path / "ckpt").mkdir()
    assert fired_kills(str(tmp_path)) == {0}  # kill 1 never happened: a test comparing the two fails
