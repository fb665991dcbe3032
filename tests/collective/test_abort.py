"""Aborting a gloo group ends every wait on it, on both sides, even between two live ranks
blocked on each other (gloo cannot cancel a posted wait; ``RingGroup.abort`` closes the
connections instead). Real actors, Ray's key-value store."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

pytestmark = pytest.mark.usefixtures("ray_session")

TIMEOUT_S = 300.0  # the group's own timeout: far beyond the bound below, only the abort ends the waits


@ray.remote(num_cpus=0, max_concurrency=2)  # a wait and the abort, on two threads
class Member:
    def __init__(self) -> None:
        self.group = None

    def form(self, name: str, rank: int, world_size: int) -> None:
        from zero_ray.collective.ray_group import form_group

        self.group = form_group(backend="gloo", group_name=name, rank=rank, world_size=world_size,
                                timeout_s=TIMEOUT_S)

    def receive_from(self, peer: int) -> str:
        from zero_ray.errors import CollectiveError

        try:
            self.group.send_recv([], [(torch.zeros(4), peer)], op="wait")
        except CollectiveError as err:
            return f"failed: {err}"
        return "received"

    def abort(self) -> None:
        self.group.abort()


def test_an_abort_ends_two_live_ranks_waiting_on_each_other() -> None:
    members = [Member.remote() for _ in range(3)]
    try:
        name = f"abort-{uuid.uuid4().hex[:8]}"
        ray.get([m.form.remote(name, r, 3) for r, m in enumerate(members)], timeout=120)
        waits = [members[0].receive_from.remote(1), members[1].receive_from.remote(0)]
        ready, _ = ray.wait(waits, timeout=1.0)
        assert ready == []  # both blocked: neither sends
        ray.get(members[0].abort.remote(), timeout=60)
        got = ray.get(waits, timeout=60)  # without closing the connections: blocked for TIMEOUT_S
        assert all(g.startswith("failed: wait on rank") for g in got), got
    finally:
        for m in members:
            ray.kill(m)
