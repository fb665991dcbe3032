"""Steps down the relay tree on Ray (issue 44): owners that host relays in their own processes
(``RelayConfig(fan_out=2, min_owners=1)`` puts a 4-owner pool on a two-level tree: rank 0's
node relay over sub-relays on ranks 0 and 2), against single-process torch and the same pool
stepping its owners directly (an evaluation too), through resizes that re-plan the tree, and ``fit`` on token files
(each rank's indices packed in one request, steps sent ahead); and a relay's process SIGKILLed
inside a step and SIGSTOPped before one, each run ending equal to the uninterrupted one."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

import zero_ray as zr
from faults import Fault, assert_fired, faulty
from fit_order import reference_block_indices, token_windows
from zero_ray.models import GPT, GPTConfig, lm_loss, mlp, mse_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

WORLD, STEPS, AT = 4, 6, 2
TREE = zr.RelayConfig(fan_out=2, min_owners=1)
HEALTH_TIMEOUT_S = 5.0


def _model() -> torch.nn.Module:
    return mlp(8, 2)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)) for _ in range(STEPS)]


def _config(relays: zr.RelayConfig, **kw: object) -> zr.ZeroConfig:
    return zr.ZeroConfig(stage=2, world_size=WORLD, relays=relays, health_interval_s=0.2,
                         health_timeout_s=HEALTH_TIMEOUT_S, collective_timeout_s=600, **kw)  # type: ignore[arg-type]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def _torch_loss(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    model = _model().eval()
    model.load_state_dict(params)
    with torch.no_grad():
        return float(mse_loss(model, batch))


@pytest.mark.timeout(300)
def test_steps_through_the_tree_equal_torch_and_the_direct_pool() -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9)
    batches = _batches()
    ref, ref_losses = single_process(_model, mse_loss, opt, batches)
    torch.manual_seed(0)
    initial = _model().state_dict()  # single_process's (and every owner's) initial parameters: seed 0
    held_out = (torch.randn(12, 8, generator=torch.Generator().manual_seed(9)),
                torch.randn(12, 8, generator=torch.Generator().manual_seed(10)))
    runs, evals, reports = {}, {}, {}
    for name, relays in (("tree", TREE), ("direct", zr.RelayConfig())):
        with zr.ZeroTrainer(_model, mse_loss, optimizer=opt, config=_config(relays)) as trainer:
            tree = trainer._pool.relays.tree
            assert (tree is not None) == (name == "tree")
            if tree is not None:  # two levels over the one node: rank 0's relay over sub-relays on 0 and 2
                assert tree.depth == 2 and sorted(r.host for r in tree.relays) == [0, 0, 2]
            first = trainer.evaluate(held_out)  # down the tree when it has one (RelayEvaluate)
            metrics = []
            for k, b in enumerate(batches):
                if name == "tree" and k in (2, 4):  # 4 -> 3 -> 4: the tree re-planned each time
                    trainer.resize(3 if k == 2 else 4)
                    assert trainer._pool.relays.tree.live_ranks == tuple(range(trainer.world_size))
                metrics.append(trainer.step(b))
            runs[name] = (trainer.full_state_dict(), metrics)
            evals[name] = (first, trainer.evaluate(held_out))
            reports[name] = (trainer.memory_report(), trainer.comm_report())  # Stats: forwarded (RelayCall) on the tree
    params, metrics = runs["tree"]
    assert _max_diff(params, ref) <= 1e-6
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, rel=1e-5)
    direct_params, direct_metrics = runs["direct"]
    assert _max_diff(params, direct_params) <= 1e-6
    # an evaluation through the tree: the direct pool's figures exactly (same parameters, same
    # pieces; only the replies' path differs), and torch's loss at the same parameters
    (tree_first, tree_last), (direct_first, direct_last) = evals["tree"], evals["direct"]
    assert tree_first == direct_first and tree_first["samples"] == 12
    assert tree_first["loss"] == pytest.approx(_torch_loss(initial, held_out), abs=1e-6)
    assert tree_last["loss"] == pytest.approx(_torch_loss(ref, held_out), abs=1e-5)
    assert tree_last["loss"] == pytest.approx(direct_last["loss"], abs=1e-6)
    # per-rank reports through the tree: every rank's, in rank order, as the direct pool's
    assert [r["rank"] for r in reports["tree"][0]] == list(range(WORLD))
    assert reports["tree"] == reports["direct"]
    # before the first resize the same computation, exactly: only the path of the replies differs
    for relayed, direct in zip(metrics[:2], direct_metrics[:2]):
        assert {k: v for k, v in relayed.items() if "seconds" not in k and k != "items_per_second"} == \
            {k: v for k, v in direct.items() if "seconds" not in k and k != "items_per_second"}


@pytest.mark.timeout(300)
def test_a_relay_sigkilled_inside_a_step_is_survived(tmp_path: Path) -> None:
    opt = zr.SGD(lr=0.1)
    batches = _batches()
    ref, _ = single_process(_model, mse_loss, opt, batches)
    # rank 2 hosts the sub-relay over ranks 2-3: killed in its own backward, while that relay waits on both
    fault = Fault(point="backward", rank=2, after=AT, dir=str(tmp_path))
    config = _config(TREE, elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(faulty(_model, fault), mse_loss, optimizer=opt, config=config) as trainer:
        assert 2 in {r.host for r in trainer._pool.relays.tree.relays}
        for b in batches:
            trainer.step(b)
        params, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
        tree, world = trainer._pool.relays.tree, trainer.world_size
    assert_fired(fault)
    assert _max_diff(params, ref) <= 1e-6
    assert [r.outcome.value for r in recoveries] == ["restored"] and 2 in recoveries[0].lost
    assert tree is not None and tree.live_ranks == tuple(range(world))  # re-planned over the members of now


@pytest.mark.timeout(300)
def test_the_top_relay_sigstopped_is_lost_after_the_health_timeout_and_survived() -> None:
    opt = zr.SGD(lr=0.1)
    batches = _batches()
    ref, _ = single_process(_model, mse_loss, opt, batches)
    config = _config(TREE, elastic=zr.ElasticConfig(redundancy="peer"))
    with zr.ZeroTrainer(_model, mse_loss, optimizer=opt, config=config) as trainer:
        for k, b in enumerate(batches):
            if k == AT:  # rank 0 hosts the driver's only top relay: every step's way down
                pid = ray.get(trainer.actors[0].node.remote(), timeout=60)["pid"]
                os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
            trainer.step(b)
            if k == AT:
                took = time.monotonic() - stopped
        params, recoveries = trainer.full_state_dict(), list(trainer.recoveries)
    assert _max_diff(params, ref) <= 1e-6
    assert [r.outcome.value for r in recoveries] == ["restored"] and 0 in recoveries[0].lost
    assert took <= HEALTH_TIMEOUT_S + 10, f"the step after the SIGSTOP took {took:.1f}s"


@pytest.mark.timeout(300)
def test_fit_on_token_files_through_the_tree_equals_one_process(tmp_path: Path) -> None:
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    model_fn = functools.partial(GPT, cfg)
    seq, batch, seed, window, block, steps = 8, 8, 5, 2, 64, 6
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, size=2400).astype("<u2")
    tokens.tofile(tmp_path / "train-0.bin")
    samples, per = (len(tokens) - 1) // seq, block // seq
    sizes = [per] * (samples // per) + ([samples % per] if samples % per else [])
    order = reference_block_indices(sizes, global_batch_size=batch, steps=steps, seed=seed, window=window)
    opt = zr.SGD(lr=0.1, momentum=0.9)
    ref, ref_losses = single_process(model_fn, lm_loss, opt, [token_windows(tokens, seq, idx) for idx in order])
    source = zr.data.TokenFiles(str(tmp_path / "train-*.bin"), seq_len=seq, block_tokens=block, window=window)
    seen: list[tuple[float, bool]] = []
    config = zr.ZeroConfig(stage=2, world_size=WORLD, bucket_bytes=4096, relays=TREE)
    with zr.ZeroTrainer(model_fn, lm_loss, optimizer=opt, config=config) as trainer:
        assert trainer._pool.relays.active
        trainer.fit(source, global_batch_size=batch, steps=steps, seed=seed, progress=False,
                    callback=lambda m: seen.append((m["loss"], m["sent_ahead"])))
        params = trainer.full_state_dict()
    assert _max_diff(params, ref) <= 1e-6
    assert [loss for loss, _ in seen] == pytest.approx(ref_losses, rel=1e-5)
    assert sum(ahead for _, ahead in seen) == steps - 1  # every step after the first was sent while one ran
