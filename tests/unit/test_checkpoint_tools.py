"""The offline checkpoint tools without Ray: inspect (and verify), reshard N -> M, consolidate into a
standard safetensors state dict, and the `zero-ray checkpoint` commands."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_builders import Saved, flip_byte, save
from safetensors.torch import load_file

from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import BUFFER, RNG
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import consolidate, inspect_checkpoint, layout_of, reshard
from zero_ray.cli import main
from zero_ray.errors import CheckpointError
from zero_ray.models import GPT, GPTConfig, mlp

GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def gpt() -> GPT:
    torch.manual_seed(1)
    return GPT(GPT_CFG)


def batch_norm_net() -> torch.nn.Module:
    """A module with buffers (running statistics, an int64 counter) that a forward pass moves."""
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    net(torch.randn(16, 6))
    return net.eval()


def assert_same_values(path: str, saved: Saved) -> None:
    """Every element of every master, moment and buffer at ``path`` equals the saved one."""
    reader = CheckpointReader(path)
    for (kind, name), value in saved.values.items():
        if kind == BUFFER:
            ((i, e),) = [(i, e) for i, e in reader.manifest.entries_of_kind(BUFFER) if e.name == name]
            got = reader.file(i).read_entry(e).reshape(-1)
        else:
            got = reader.read(kind, name, 0, value.numel())
        torch.testing.assert_close(got, value, rtol=0, atol=0)


def rank_ranges(path: str, rank: int) -> list[tuple[str, int, int]]:
    record = CheckpointReader(path).manifest.files[rank]
    return [(e.name, e.start, e.end) for e in record.entries if e.kind == "master"]


def small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp(8, 3)


@pytest.mark.parametrize(("model_fn", "n", "m"), [(small_mlp, 3, 2), (small_mlp, 1, 4), (gpt, 2, 3), (gpt, 4, 1),
                                                  (batch_norm_net, 2, 3)])
def test_reshard_rewrites_each_rank_and_reads_back_equal(tmp_path: Path, model_fn: Callable[[], torch.nn.Module],
                                                         n: int, m: int) -> None:
    saved = save(model_fn(), tmp_path / "src", world_size=n, bucket_numel=120)
    out = reshard(saved.path, str(tmp_path / "out"), world_size=m, chunk_bytes=64)
    assert store.resolve(str(tmp_path / "out")) == out
    assert_same_values(out, saved)

    src, new = CheckpointReader(saved.path).manifest, CheckpointReader(out).manifest
    layout = layout_of(src, m)
    assert new.world_size == m and len(new.files) == m
    assert [(b.params, b.numel, b.padded_numel, b.shard_numel) for b in new.buckets] == \
           [(b.params, b.numel, b.padded_numel, b.shard_numel) for b in layout.buckets]
    assert (new.step, new.samples_seen, new.training, new.stage, new.optimizers, new.param_state) == \
           (src.step, src.samples_seen, src.training, src.stage, src.optimizers, src.param_state)
    for rank in range(m):  # each file holds exactly its new shard range
        expected = [(layout.params[f.param].name, f.param_start, f.param_end)
                    for b in layout.buckets for f in layout.shard_fragments(b.index, rank)]
        assert rank_ranges(out, rank) == expected
        rng = [e.name for e in new.files[rank].entries if e.kind == RNG]
        vanished = [f"torch/{r}" for r in range(m, n)] if rank == 0 else []  # kept on rank 0
        assert rng == ([f"torch/{rank}"] if rank < n else []) + vanished
    assert [e.kind for e in new.files[0].entries if e.kind == BUFFER] == \
           [e.kind for f in src.files for e in f.entries if e.kind == BUFFER]

    # Back to N ranks gives the very files the N-rank run wrote.
    back = reshard(out, str(tmp_path / "back"), world_size=n, chunk_bytes=64)
    assert [f.sha256 for f in CheckpointReader(back).manifest.files] == [f.sha256 for f in src.files]


def test_reshard_of_a_damaged_checkpoint_writes_nothing(tmp_path: Path) -> None:
    saved = save(small_mlp(), tmp_path / "src", world_size=2)
    manifest = CheckpointReader(saved.path).manifest
    os.remove(os.path.join(saved.path, manifest.files[1].name))
    with pytest.raises(CheckpointError, match="is missing"):
        reshard(saved.path, str(tmp_path / "out"), world_size=3)
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(CheckpointError, match="is the checkpoint being read"):
        reshard(saved.path, saved.path, world_size=3)


@pytest.mark.parametrize("chunk_numel", [7, 2**20])
def test_consolidated_gpt_loads_into_the_plain_module(tmp_path: Path, chunk_numel: int) -> None:
    trained = gpt()
    saved = save(trained, tmp_path / "root", world_size=3, bucket_numel=200)
    out = consolidate(str(tmp_path / "root"), str(tmp_path / "full.safetensors"), chunk_numel=chunk_numel)
    assert out == str(tmp_path / "full.safetensors") and not os.path.exists(f"{out}.tmp")

    state = load_file(out)
    assert set(state) == set(trained.state_dict())  # the tied head under its own name too
    assert {"wte.weight", "head.weight"} <= set(state)
    plain = GPT(GPT_CFG)
    plain.load_state_dict(state)
    assert plain.head.weight is plain.wte.weight
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach().reshape(-1), saved.values[("master", name)], rtol=0, atol=0)
    idx = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.block_size))
    torch.testing.assert_close(plain(idx), trained(idx), rtol=0, atol=0)


def test_consolidate_carries_the_buffers(tmp_path: Path) -> None:
    trained = batch_norm_net()
    save(trained, tmp_path / "root", world_size=2, bucket_numel=16)
    out = consolidate(str(tmp_path / "root"), str(tmp_path / "bn.safetensors"), chunk_numel=3)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)).eval()
    plain.load_state_dict(load_file(out))
    assert int(plain[1].num_batches_tracked) == 1
    x = torch.randn(4, 6)
    torch.testing.assert_close(plain(x), trained(x), rtol=0, atol=0)


def test_consolidate_of_a_corrupt_checkpoint_leaves_no_file(tmp_path: Path) -> None:
    saved = save(small_mlp(), tmp_path / "root", world_size=2)
    record = CheckpointReader(saved.path).manifest.files[1]
    path = os.path.join(saved.path, record.name)
    flip_byte(path, record.entries[0].offset)
    out = tmp_path / "full.safetensors"
    with pytest.raises(CheckpointError, match=rf"{path}: checksum mismatch"):
        consolidate(saved.path, str(out))
    assert sorted(os.listdir(tmp_path)) == ["root"]


def test_inspect_describes_the_checkpoint(tmp_path: Path) -> None:
    model = small_mlp()
    saved = save(model, tmp_path / "root", world_size=3, step=5)
    info = inspect_checkpoint(str(tmp_path / "root"), verify=True)
    assert info["path"] == saved.path and info["verified"]
    assert (info["format_version"], info["step"], info["samples_seen"], info["world_size"], info["stage"],
            info["tensor_parallel"]) == (5, 5, 60, 3, 2, 1)
    assert info["training"]["grad_accum_steps"] == 1 and info["training"]["on_nonfinite"] == "raise"
    assert info["config"]["world_size"] == 3 and info["config"]["checkpoint"]["keep"] == 3  # the whole ZeroConfig
    assert info["optimizers"] == [{"type": "torch.optim.adamw.AdamW", "kind": "elementwise", "groups": 2}]
    assert info["state"] == ["exp_avg", "exp_avg_sq"]
    assert info["params"] == len(list(model.parameters()))
    assert info["elements"] == sum(p.numel() for p in model.parameters())
    assert [f["size"] for f in info["files"]] == [os.path.getsize(os.path.join(saved.path, f["name"]))
                                                  for f in info["files"]]
    assert len({f["sha256"] for f in info["files"]}) == 3


def test_cli_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = save(gpt(), tmp_path / "root", world_size=2, bucket_numel=200)
    root = str(tmp_path / "root")

    assert main(["checkpoint", "inspect", root]) == 0
    text = capsys.readouterr().out
    assert "step            3 (36 samples" in text and "world size      2" in text and "AdamW" in text
    assert "training        dtype=float32 grad_accum_steps=1 " in text
    assert "rank-00001-of-00002.safetensors" in text

    assert main(["checkpoint", "inspect", root, "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["verified"] and info["world_size"] == 2

    assert main(["checkpoint", "reshard", root, str(tmp_path / "four"), "--world-size", "4"]) == 0
    assert "resharded for 4 ranks" in capsys.readouterr().out
    assert inspect_checkpoint(str(tmp_path / "four"), verify=True)["world_size"] == 4

    out = str(tmp_path / "full.safetensors")
    assert main(["checkpoint", "consolidate", str(tmp_path / "four"), out]) == 0
    assert out in capsys.readouterr().out
    GPT(GPT_CFG).load_state_dict(load_file(out))

    with pytest.raises(SystemExit) as exc:
        main(["checkpoint", "reshard", root, str(tmp_path / "zero"), "--world-size", "0"])
    assert exc.value.code == 2

    assert main(["checkpoint", "inspect", str(tmp_path / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err

    # A flipped byte passes a plain inspect (the manifest is intact) and fails --verify.
    record = CheckpointReader(saved.path).manifest.files[1]
    path = os.path.join(saved.path, record.name)
    flip_byte(path, record.entries[0].offset)
    assert main(["checkpoint", "inspect", root]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "inspect", root, "--verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zero-ray checkpoint inspect: error: ") and f"{path}: checksum mismatch" in err
    assert main(["checkpoint", "consolidate", root, str(tmp_path / "bad.safetensors")]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
