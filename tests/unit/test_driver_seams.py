"""The driver's seams stay closed (issue 44), read from the sources as test_layering reads the
imports: the pool owns its fan-out, FanOut is handed data rather than callbacks into the pool,
a batch does not call back into the pool, the controller is handed what it reads rather than
reaching into the pool's spec, and controller.py names every path to the owners around
``Controller.run``."""

from __future__ import annotations

import ast
import inspect
import os

from tests_paths import REPO_ROOT

from zero_ray.driver import controller
from zero_ray.driver.fanout import FanOut

DRIVER = os.path.join(REPO_ROOT, "zero_ray", "driver")


def _attribute_chains(path: str) -> list[str]:
    """Every dotted attribute chain in the file (``self._pool.fan.collect`` -> "self._pool.fan.collect")."""
    chains = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name):
                chains.append(".".join([cur.id, *reversed(parts)]))
    return chains


def test_nothing_outside_the_pool_touches_its_fan_out() -> None:
    found = []
    for name in sorted(os.listdir(DRIVER)):
        if name.endswith(".py") and name not in ("pool.py", "fanout.py"):
            found += [f"{name}: {c}" for c in _attribute_chains(os.path.join(DRIVER, name)) if ".fan." in c + "."]
    assert found == []


def test_the_controller_reads_nothing_of_the_pool_s_spec() -> None:
    chains = _attribute_chains(os.path.join(DRIVER, "controller.py"))
    assert [c for c in chains if "_pool.spec" in c] == []


def test_a_batch_does_not_call_back_into_the_pool() -> None:
    chains = _attribute_chains(os.path.join(DRIVER, "batch_staging.py"))
    assert [c for c in chains if "pool" in c.lower()] == []


def test_fan_out_takes_no_callbacks() -> None:
    params = inspect.signature(FanOut.__init__).parameters
    assert [p for p, v in params.items() if "Callable" in str(v.annotation)] == []


def test_the_controller_names_every_path_around_its_loop() -> None:
    doc = controller.__doc__ or ""
    for path in ("job_status", "load_checkpoint", "take_over", "use_filesystem", "SavePhase.AWAIT"):
        assert path in doc, f"controller.py's docstring does not say why {path} reaches the owners around run"


