"""A relay's process signalled at each point of a run's life on Ray (issue 44): the owners host
the relay tree in their own processes (``RelayConfig(fan_out=2, min_owners=1)``: rank 0 hosts
the driver's only top relay and the sub-relay over ranks 0-1, rank 2 the sub-relay over the
ranks from 2 on), and a relay host is SIGKILLed as it writes its checkpoint file, SIGSTOPped in a
shrinking resize's transfer (both in one run), and SIGKILLed twice over a restore (a relay host in its backward, then
its replacement, which hosts the same relay in the re-planned tree, in the restore's transfer).
The signals are real (the process signals itself at the point: ``faults.Fault``), each asserted
to have fired, and each run ends equal to single-process torch (SGD, 1e-6). A rank under a relay
that blocks in user code is named by the flight recorder's diagnosis, and only it is replaced
(blocked, not SIGSTOPped: a frozen process cannot answer its Flight call, and is lost by its
stalled stream, as the resize case's is, before any diagnosis).
(A step through the tree with a relay SIGKILLed in backward, or the top relay SIGSTOPped, is in
test_relay_steps.py.)"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import zero_ray as zr
from faults import Fault, assert_fired, faulty
from zero_ray.checkpoint.format import MANIFEST_NAME
from zero_ray.core.relay_tree import plan_relays
from zero_ray.errors import ResizeInterrupted
from zero_ray.models import mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

STEPS, AT = 5, 2  # the fault comes with two steps done (their peer snapshots committed)
TREE = zr.RelayConfig(fan_out=2, min_owners=1)
HEALTH_TIMEOUT_S = 5.0
MARK = -77.0


def _model() -> torch.nn.Module:
    return mlp(8, 2)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)) for _ in range(STEPS)]


def _config(world: int, **kw: Any) -> zr.ZeroConfig:
    return zr.ZeroConfig(stage=2, world_size=world, relays=TREE, health_interval_s=0.2,
                         health_timeout_s=HEALTH_TIMEOUT_S, collective_timeout_s=600, **kw)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def _relay_hosts(trainer: zr.ZeroTrainer) -> set[int]:
    tree = trainer._pool.relays.tree
    assert tree is not None, "the pool does not step down the relay tree"
    return {r.host for r in tree.relays}


@pytest.mark.timeout(300)
def test_the_top_relay_sigkilled_in_a_save_then_a_relay_sigstopped_in_a_resize(tmp_path: Path) -> None:
    """One pool for both (each start of four owners costs seconds). Without ``grow_back`` each
    restore waits for its replacement: four owners again after the save, shrunk to three."""
    opt = zr.SGD(lr=0.1)
    batches = _batches()
    ref, _ = single_process(_model, mse_loss, opt, batches)
    # rank 0 hosts the driver's only top relay (the driver's way to every owner, and its health),
    # killed as it writes its checkpoint file
    save = Fault(point="checkpoint_save", rank=0, dir=str(tmp_path))
    # rank 2 hosts the sub-relay over ranks 2-3: frozen as it sends its ranges in a 4 -> 3
    # shrink, it is seen only by the top relay reading its Watch stream (the driver reads rank 0's)
    resize = Fault(point="resize_transfer", rank=2, dir=str(tmp_path), sig="SIGSTOP")
    config = _config(4, elastic=zr.ElasticConfig(redundancy="peer", grow_back=False),
                     checkpoint=zr.CheckpointConfig(dir=str(tmp_path / "ckpt")))
    notes: list[str] = []
    with zr.ZeroTrainer(faulty(_model, save, resize), mse_loss, optimizer=opt, config=config) as trainer:
        assert trainer._pool.relays.tree.driver_children[0].host == 0
        saved = None
        for k, b in enumerate(batches):
            if k == AT:  # the save finds rank 0 lost (in its snapshot or its commit), recovers and saves
                saved = trainer.save_checkpoint(wait=True)
                assert trainer.world_size == 4 and _relay_hosts(trainer) == {0, 2}
            if k == AT + 1:
                try:
                    trainer.resize(3)
                except ResizeInterrupted as err:
                    notes.append(str(err).splitlines()[0])
            trainer.step(b)
            if k == AT + 1:
                done = time.time()
        params, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
        tree, world = trainer._pool.relays.tree, trainer.world_size
    assert_fired(save)
    stopped = assert_fired(resize)
    assert _max_diff(params, ref) <= 1e-6
    assert [r.call for r in recoveries] == ["save_checkpoint", "resizing to 3 owners"], [r.summary() for r in recoveries]
    assert all(r.outcome.value == "restored" for r in recoveries)
    assert 0 in recoveries[0].lost and 2 in recoveries[1].lost
    assert json.loads((Path(saved or "") / MANIFEST_NAME).read_text())["step"] == AT  # committed where asked
    assert notes and "resizing to 3 owners failed" in notes[0], notes
    # lost by its stalled Watch stream, read by the top relay, not after collective_timeout_s (600 s);
    # the bound leaves room for the replacement's start on a loaded machine
    assert "Relay.Watch" in recoveries[1].lost[2] and "sent nothing for" in recoveries[1].lost[2], recoveries[1].lost
    assert done - stopped <= HEALTH_TIMEOUT_S + 55, f"the step after the SIGSTOP ended {done - stopped:.1f}s later"
    assert tree is not None and tree.live_ranks == tuple(range(world))  # re-planned over the members of now


@pytest.mark.timeout(300)
def test_a_relay_and_its_replacement_sigkilled_in_the_restore_are_survived(tmp_path: Path) -> None:
    opt = zr.SGD(lr=0.1)
    batches = _batches()
    ref, _ = single_process(_model, mse_loss, opt, batches)
    # three owners: rank 2 hosts the sub-relay over rank 2. It dies in its backward; the restore
    # waits for its replacement, which takes rank 2 and hosts that relay in the re-planned tree,
    # and is killed in the restore's transfer. (A survivor killed there would take the only
    # other copy of a partition with it: the replacement holds nothing yet.)
    first = Fault(point="backward", rank=2, after=AT, dir=str(tmp_path))
    second = Fault(point="restore_transfer", rank=2, dir=str(tmp_path))
    config = _config(3, elastic=zr.ElasticConfig(redundancy="peer", continue_on_survivors=False))
    with zr.ZeroTrainer(faulty(_model, first, second), mse_loss, optimizer=opt, config=config) as trainer:
        assert 2 in _relay_hosts(trainer)
        for b in batches:
            trainer.step(b)
        params, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
        hosts, world = _relay_hosts(trainer), trainer.world_size
    assert_fired(first) < assert_fired(second)
    assert _max_diff(params, ref) <= 1e-6
    assert recoveries and all(r.outcome.value == "restored" for r in recoveries), [r.summary() for r in recoveries]
    assert 2 in recoveries[0].lost
    assert any("restoring from peer failed" in n for n in recoveries[0].notes), recoveries[0].notes
    # the replacement was rank 2 of three as it died: the host of rank 2's relay (the pure plan)
    assert {r.host for r in plan_relays(["node"] * 3, TREE).relays} == {0, 2}
    assert hosts == {0, 2} if world == 3 else hosts == {0}  # re-planned over the members of now


def blocks_once(module: torch.nn.Module, batch: Any, *, marks: str) -> torch.Tensor:
    """The MSE loss; the owner whose piece starts with the marker blocks first (once: a file
    records it), in user code that releases the GIL, for longer than the step timeout."""
    x = batch[0]
    if x.shape[0] and float(x[0, 0]) == MARK:
        try:
            os.close(os.open(os.path.join(marks, "blocked"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            threading.Event().wait(600)  # the stall; the recovery SIGKILLs this process
    return F.mse_loss(module(x), batch[1])


@pytest.mark.timeout(300)
def test_a_stalled_rank_under_a_relay_is_named_by_the_flight_recorder(tmp_path: Path) -> None:
    step_timeout_s = 10.0
    batches = _batches()
    batches[AT][0][9, 0] = MARK  # the first sample of rank 3's piece (12 samples over 4 owners)
    opt = zr.SGD(lr=0.1)
    ref, _ = single_process(_model, mse_loss, opt, batches)
    config = _config(4, step_timeout_s=step_timeout_s, elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(_model, lambda m, b: blocks_once(m, b, marks=str(tmp_path)), optimizer=opt,
                        config=config) as trainer:
        tree = trainer._pool.relays.tree
        # rank 3's step and its heartbeats go through the sub-relay on rank 2, not the driver
        assert tree is not None and tree.path(3)[-1].host == 2
        seconds = []
        for b in batches:
            t0 = time.monotonic()
            trainer.step(b)
            seconds.append(time.monotonic() - t0)
        params, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
    assert (tmp_path / "blocked").exists()  # the fault fired
    assert _max_diff(params, ref) <= 1e-6
    assert [(sorted(r.lost), r.outcome.value) for r in recoveries] == [([3], "restored")]
    stall = recoveries[0].stall
    assert re.match(r"rank\(s\) \[3\] diverged: not in \w+ #\d+ on \S+, which ranks \[0, 1, 2\] wait in", stall), stall
    assert re.search(r"rank 3: in forward \(step 3, micro-batch 0\)", stall), stall
    assert seconds[AT] <= step_timeout_s + 25, seconds  # the timeout, the diagnosis and a restore on survivors
