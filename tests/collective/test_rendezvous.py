"""Forming a gloo group can be aborted at any point: ranks waiting for a member that never
arrives give up the moment they are told to (not at the formation timeout), and the same
processes then form the next group and reduce over it. Real actors, Ray's key-value store."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import ray
import torch

pytestmark = pytest.mark.usefixtures("ray_session")

FORMATION_TIMEOUT_S = 300.0  # far beyond every wait below: only an abort can end the first formation


class Member:
    """One process that forms groups like a partition owner does."""

    def __init__(self) -> None:
        self.abort_event = threading.Event()
        self.group: Any = None

    def form(self, name: str, rank: int, world_size: int) -> str:
        from zero_ray.collective.ray_group import destroy_group, form_group
        from zero_ray.collective.rendezvous import RendezvousAborted

        if self.group is not None:
            destroy_group(self.group.group_name)
            self.group = None
        try:
            self.group = form_group(backend="gloo", group_name=name, rank=rank, world_size=world_size,
                                    timeout_s=FORMATION_TIMEOUT_S, abort=self.abort_event)
        except RendezvousAborted as err:
            return f"aborted: {err}"
        return "formed"

    def abort(self) -> None:
        self.abort_event.set()

    def rearm(self) -> None:
        self.abort_event = threading.Event()

    def all_reduce(self, value: float) -> list[float]:
        t = torch.full((6,), value)  # a multiple of the world size, as flat buffers are
        self.group.all_reduce_(t)
        return t.tolist()

    def close(self) -> None:
        from zero_ray.collective.ray_group import destroy_group

        if self.group is not None:
            destroy_group(self.group.group_name)


def _wait_for_rendezvous_keys(name: str, pending: list[Any], *, at_least: int, attempts: int = 240) -> None:
    """Until the members have written ``at_least`` keys of ``name``'s rendezvous, waiting on
    their ``pending`` calls in between (bounded; a call that returns is a failure here)."""
    import ray.experimental.internal_kv as kv

    from zero_ray.collective.rendezvous import NAMESPACE

    for _ in range(attempts):
        if len(kv._internal_kv_list(f"{name}/".encode(), namespace=NAMESPACE)) >= at_least:
            return
        done, _ = ray.wait(pending, timeout=0.5)
        assert not done, f"a member finished forming a group one member short: {ray.get(done)}"
    raise AssertionError(f"the members never reached the rendezvous of {name}")


def test_an_aborted_formation_ends_at_once_and_the_next_one_forms() -> None:
    cls = ray.remote(num_cpus=0.1, max_concurrency=2)(Member)
    members = [cls.remote() for _ in range(3)]
    try:
        # Ranks 0 and 1 of a group of 3 whose rank 2 never arrives (as if it died first).
        waiting = [m.form.remote("zero_ray-test-rdzv-g1", r, 3) for r, m in enumerate(members[:2])]
        _wait_for_rendezvous_keys("zero_ray-test-rdzv-g1", waiting, at_least=2)  # both are inside the rendezvous
        ready, _ = ray.wait(waiting, timeout=2.0)
        assert not ready  # stuck waiting for rank 2, as a survivor would be
        ray.get([m.abort.remote() for m in members[:2]], timeout=30)
        outcomes = ray.get(waiting, timeout=30)  # well before the 300 s formation timeout
        assert all(o.startswith("aborted: ") for o in outcomes), outcomes
        # The same processes form the next generation, with the third member, and reduce over it.
        ray.get([m.rearm.remote() for m in members], timeout=30)
        assert ray.get([m.form.remote("zero_ray-test-rdzv-g2", r, 3) for r, m in enumerate(members)],
                       timeout=120) == ["formed"] * 3
        sums = ray.get([m.all_reduce.remote(float(r + 1)) for r, m in enumerate(members)], timeout=60)
        assert sums == [[6.0] * 6] * 3
    finally:
        try:
            ray.get([m.close.remote() for m in members], timeout=30)
        finally:
            for m in members:
                ray.kill(m)
