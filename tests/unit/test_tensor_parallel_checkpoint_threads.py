"""Checkpoints across tensor-parallel sizes on thread ranks (issue 45 item 6): a Hugging Face Llama
with grouped-query attention trained 3 steps (AdamW; SGD with momentum in two cells) at one (T, D), saved by every owner as a run
saves (owner/resilience/checkpointing), resumed at another (T', D') and trained 2 more steps ends
within 1e-5 of single-process torch's 5 steps: the TP slices are read back by their offsets, the
AdamW moments and step counts with them. A T = 2 checkpoint consolidates and exports to exactly
the plain model's state dict."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import safetensors.torch
import torch

import zero_ray as zr
from test_tensor_parallel_engine_threads import Mlp, mse
from tp_llama import BATCH, SEQ, VOCAB, llama, lm_loss
from thread_ranks import run_tp_ranks
from zero_ray.checkpoint.format import MASTER
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import consolidate, export_pretrained, inspect_checkpoint, reshard
from zero_ray.testing import single_process

TOLERANCE = 1e-5
SAVED_AFTER, STEPS = 3, 5
ADAMW = zr.AdamW(lr=1e-3, weight_decay=0.01)
OPTIMIZERS = {"adamw": ADAMW, "sgd": zr.SGD(lr=0.1, momentum=0.9)}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


@functools.cache
def reference(optimizer: str = "adamw") -> tuple[dict[str, torch.Tensor], tuple[float, ...]]:
    params, losses = single_process(llama, lm_loss, OPTIMIZERS[optimizer], batches())
    return params, tuple(losses)


CASES = [((2, 2), (1, 3), stage, "adamw") for stage in (0, 1, 2, 3)]
CASES += [(a, b, stage, "adamw") for a, b in [((2, 2), (4, 1)), ((1, 3), (2, 2)), ((4, 1), (2, 2))] for stage in (1, 3)]
CASES += [((2, 2), (1, 3), 2, "sgd"), ((1, 3), (4, 1), 3, "sgd")]  # the momentum buffer moves as exp_avg does


@pytest.mark.parametrize(("saved_as", "resumed_as", "stage", "optimizer"), CASES, ids=str)
def test_a_run_saved_at_one_tp_size_resumes_at_another(saved_as: tuple[int, int], resumed_as: tuple[int, int],
                                                       stage: int, optimizer: str, tmp_path: Path) -> None:
    factory = OPTIMIZERS[optimizer]
    run_tp_ranks(*saved_as, llama, lm_loss, factory, batches()[:SAVED_AFTER], stage=stage, save=str(tmp_path))
    assert inspect_checkpoint(str(tmp_path))["tensor_parallel"] == saved_as[0]
    got, losses, engines, _ = run_tp_ranks(*resumed_as, llama, lm_loss, factory, batches()[SAVED_AFTER:],
                                           stage=stage, load=str(tmp_path))
    ref, ref_losses = reference(optimizer)
    assert got.keys() == ref.keys()
    worst = max(float((got[k] - ref[k]).abs().max()) for k in ref)
    assert worst <= TOLERANCE, worst
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[SAVED_AFTER:])) <= TOLERANCE
    assert all(e.position.step == STEPS for e in engines)
    # not trivially equal: the parameters moved in the 2 steps after the resume
    before = reference_after(SAVED_AFTER, optimizer)
    assert max(float((ref[k] - before[k]).abs().max()) for k in ref) > 100 * TOLERANCE


@functools.cache
def reference_after(steps: int, optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    return single_process(llama, lm_loss, OPTIMIZERS[optimizer], batches()[:steps])[0]


@functools.cache
def saved_at_t2(root: str) -> dict[str, torch.Tensor]:
    got, _, _, _ = run_tp_ranks(2, 2, llama, lm_loss, ADAMW, batches()[:SAVED_AFTER], stage=2, save=root)
    return got


def plain_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return llama().state_dict()


def test_a_t2_checkpoint_consolidates_and_exports_to_the_plain_model(tmp_path: Path) -> None:
    got = saved_at_t2(str(tmp_path / "ckpt"))
    out = consolidate(str(tmp_path / "ckpt"), str(tmp_path / "model.safetensors"))
    whole = safetensors.torch.load_file(out)
    plain = plain_state_dict()
    assert whole.keys() == plain.keys()
    for name, value in whole.items():
        assert value.shape == plain[name].shape, name
        assert torch.equal(value, got[name]), name  # exactly the run's masters, joined along their slices
    model = llama()
    model.load_state_dict(whole, strict=True)
    ref = reference_after(SAVED_AFTER)
    assert max(float((whole[k] - ref[k]).abs().max()) for k in ref) <= TOLERANCE
    files = export_pretrained(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    exported = safetensors.torch.load_file(files[0])
    assert exported.keys() == whole.keys() and all(torch.equal(exported[k], whole[k]) for k in whole)


def test_a_t2_checkpoint_holds_each_element_once_and_reshards_offline_to_t1(tmp_path: Path) -> None:
    got = saved_at_t2(str(tmp_path / "ckpt"))
    reader = CheckpointReader(str(tmp_path / "ckpt"))
    m = reader.manifest
    assert (m.world_size, m.tensor_parallel, len(m.files)) == (4, 2, 4)
    for p in m.params:  # every saved element once: the replicated ones written by TP rank 0 only
        assert sum(e.numel for _, e in m.entries(MASTER, p.name)) == p.numel, p.name
    q = m.param("model.layers.0.self_attn.q_proj.weight")
    o = m.param("model.layers.0.self_attn.o_proj.weight")
    assert {e.offsets for _, e in m.entries(MASTER, q.name)} == {(0, 0), (q.shape[0] // 2, 0)}  # colwise: rows
    assert {e.offsets for _, e in m.entries(MASTER, o.name)} == {(0, 0), (0, o.shape[1] // 2)}  # rowwise: columns
    flat = reshard(str(tmp_path / "ckpt"), str(tmp_path / "flat"), world_size=3)
    again = CheckpointReader(flat)
    assert again.manifest.tensor_parallel == 1
    for p in again.manifest.params:
        assert not any(e.offsets for _, e in again.manifest.entries(MASTER, p.name))
        assert torch.equal(again.read(MASTER, p.name, 0, p.numel).view(p.shape), got[p.name]), p.name


class CountingMlp(Mlp):
    """The fully sharded Mlp with a persistent buffer: TP rank 0 of data rank 0 alone saves it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.arange(4, dtype=torch.float32))


def test_a_user_plan_with_a_buffer_consolidates_at_t2_and_resumes_at_t1(tmp_path: Path) -> None:
    plan = {"up": "colwise", "down": "rowwise"}
    xs = [torch.randn(6, 16, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    got, _, _, _ = run_tp_ranks(2, 2, CountingMlp, mse, ADAMW, xs[:2], stage=3, plan=plan, save=str(tmp_path / "c"))
    whole = safetensors.torch.load_file(consolidate(str(tmp_path / "c"), str(tmp_path / "m.safetensors")))
    torch.manual_seed(0)
    assert whole.keys() == CountingMlp().state_dict().keys()
    assert torch.equal(whole["seen"], torch.arange(4, dtype=torch.float32))
    assert all(torch.equal(whole[k], got[k]) for k in got)
    resumed, _, _, _ = run_tp_ranks(1, 3, CountingMlp, mse, ADAMW, xs[2:], stage=2, plan=plan,
                                    load=str(tmp_path / "c"))
    ref, _ = single_process(CountingMlp, mse, ADAMW, xs)
    assert max(float((resumed[k] - ref[k]).abs().max()) for k in ref) <= TOLERANCE
