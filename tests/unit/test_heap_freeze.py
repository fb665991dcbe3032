"""freeze_heap (issue 44: fit's bimodal latency came from full collections of a million-object
heap in the relays' and the driver's processes): what a process tracks when it first calls it is
out of every later collection, once per process, and what it builds afterwards is still
collected. In a child process, so that this test's own process keeps its collector as it is."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.tests_paths import REPO_ROOT as ROOT

CHILD = textwrap.dedent("""
    import gc, weakref
    from zero_ray.control.heap_freeze import freeze_heap

    class Node:
        pass

    held = [Node() for _ in range(10_000)]  # what the process holds when it joins the tree
    assert gc.get_freeze_count() == 0
    assert freeze_heap() is True
    frozen = gc.get_freeze_count()
    assert frozen >= 10_000, frozen
    assert freeze_heap() is False and gc.get_freeze_count() == frozen  # a re-plan changes nothing
    a, b = Node(), Node()  # built after the freeze: a cycle, dropped
    a.other, b.other = b, a
    alive = weakref.ref(a)
    del a, b
    gc.collect()
    assert alive() is None, "a cycle built after the freeze was not collected"
    print("ok", frozen)
""")


def test_the_heap_is_frozen_once_and_what_comes_after_is_collected() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok ")
