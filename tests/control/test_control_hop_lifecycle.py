"""A relay hop's own thread (issue 44): its children's calls run on one asyncio loop thread the
hop starts with its first step and ends on close() (or when it is dropped), in bounded time,
with a step in flight coming back failed, not hung; steps from many server threads share that
one thread; hops closed one after another print nothing."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from control_fakes import WAIT_S
from relay_stand_ins import ServedTree, relay_args, tree_fixtures

from zero_ray.control.relay_hop import RelayHop, hop_children
from zero_ray.core.reply_combine import CombinedStep
from zero_ray.errors import RelayError

HOP_THREAD = "zero_ray-relay-hop"
CLOSE_S = 2.0  # closing takes milliseconds (channels closed, gRPC's tasks drained)


served, tree = tree_fixtures("job-hop-life", ["node-a"] * 2)


def _hop(tree: ServedTree) -> RelayHop:
    relay = tree.tree.node_relay("node-a")
    return RelayHop(host=relay.host, children=hop_children(tree.tree, relay.id, owners=tree.owner_clients, relays={}))


def _hop_threads() -> int:
    return sum(t.name == HOP_THREAD for t in threading.enumerate())


def test_the_first_step_starts_one_thread_and_close_ends_it(tree: ServedTree) -> None:
    before = _hop_threads()
    hop = _hop(tree)
    assert _hop_threads() == before  # built and never called: nothing runs
    for step in range(3):
        reply = hop.relay_step(relay_args(step, 2))
        assert reply.failure is None and reply.ranks.covers(2) and reply.totals.samples == 8
    assert _hop_threads() == before + 1
    began = time.monotonic()
    hop.close()
    assert time.monotonic() - began < CLOSE_S
    assert _hop_threads() == before
    hop.close()  # idempotent
    with pytest.raises(RelayError, match="was closed"):
        hop.relay_step(relay_args(3, 2))


def test_closing_under_a_step_fails_its_children_in_bounded_time(tree: ServedTree) -> None:
    for owner in tree.owners:  # both held in their steps: neither reply can beat close()
        owner.block_steps = True
    hop = _hop(tree)
    replies: list[CombinedStep] = []
    stepping = threading.Thread(target=lambda: replies.append(hop.relay_step(relay_args(0, 2, timeout_s=WAIT_S))))
    stepping.start()
    assert all(owner.step_entered.wait(WAIT_S) for owner in tree.owners)
    began = time.monotonic()
    hop.close()
    stepping.join(CLOSE_S)
    assert not stepping.is_alive() and time.monotonic() - began < CLOSE_S
    (reply,) = replies
    failure = reply.failure
    assert failure is not None and failure.node == "node-a" and failure.detail.type == "RelayError"
    assert failure.rank in (0, 1) and "was closed" in failure.detail.message
    assert reply.ranks.covers(2) and reply.totals.samples == 0


def test_a_hop_dropped_unclosed_ends_its_thread(tree: ServedTree) -> None:
    before = _hop_threads()
    hop = _hop(tree)
    assert hop.relay_step(relay_args(0, 2)).failure is None
    assert _hop_threads() == before + 1
    del hop
    gc.collect()
    assert _hop_threads() == before


def test_steps_from_many_threads_share_the_hops_one_thread(tree: ServedTree) -> None:
    before = _hop_threads()
    hop = _hop(tree)
    try:
        replies: dict[int, CombinedStep] = {}
        callers = [threading.Thread(target=lambda s=s: replies.__setitem__(s, hop.relay_step(relay_args(s, 2))))
                   for s in range(6)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(WAIT_S)
        assert sorted(replies) == list(range(6)) and _hop_threads() == before + 1
        for step, reply in replies.items():  # each its own step's figures: grad_norm is 0.5 + step
            assert reply.failure is None and reply.agreed is not None and reply.agreed.value.grad_norm == 0.5 + step
    finally:
        hop.close()


def test_hops_closed_one_after_another_print_nothing() -> None:
    """A process of its own, so that its stderr holds only what the hops printed: each closing
    hop drains gRPC's tasks of its cancelled calls before its loop closes."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hops_run.py")
    proc = subprocess.run([sys.executable, script, "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [None, None, "RelayError"]  # the last closed mid-step
    for noise in ("Traceback", "Event loop is closed", "Exception in callback", "Task was destroyed", "pending",
                  "never retrieved"):
        assert noise not in proc.stderr, proc.stderr[-4000:]
