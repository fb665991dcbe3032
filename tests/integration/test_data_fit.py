"""fit() over zero_ray.data sources on real owners: token files (local and on a local S3 server)
and Parquet, at world sizes 1-3, through a SIGKILLed owner, live resizes and a resume at
another size, each against one process trained on the documented block order read by numpy
and pyarrow."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
import torch

import zero_ray as zr
from fit_order import reference_block_indices, token_windows
from s3_server import S3Server
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
GPT_FN = functools.partial(GPT, CFG)
SEQ, BATCH, SEED, WINDOW = 8, 6, 5, 2
OPT = zr.SGD(lr=0.1, momentum=0.9)


def write_corpus(directory: Path, lengths: tuple[int, ...] = (900, 500, 1100)) -> np.ndarray:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, size=sum(lengths)).astype("<u2")
    start = 0
    for i, n in enumerate(lengths):
        tokens[start:start + n].tofile(directory / f"train-{i}.bin")
        start += n
    return tokens


def token_reference(tokens: np.ndarray, steps: int, block_tokens: int) -> dict[str, torch.Tensor]:
    samples = (len(tokens) - 1) // SEQ
    per = block_tokens // SEQ
    sizes = [per] * (samples // per) + ([samples % per] if samples % per else [])
    order = reference_block_indices(sizes, global_batch_size=BATCH, steps=steps, seed=SEED, window=WINDOW)
    ref, _ = single_process(GPT_FN, lm_loss, OPT, [token_windows(tokens, SEQ, idx) for idx in order])
    return ref


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def config(stage: int, world_size: int, **kw) -> zr.ZeroConfig:  # type: ignore[no-untyped-def]
    return zr.ZeroConfig(stage=stage, world_size=world_size, bucket_bytes=4096, **kw)


@pytest.mark.parametrize(("stage", "world_size"), [(1, 1), (2, 2), (3, 3)])
def test_token_files_train_as_one_process_at_any_world_size(tmp_path: Path, stage: int, world_size: int) -> None:
    tokens = write_corpus(tmp_path)
    source = zr.data.TokenFiles(str(tmp_path / "train-*.bin"), seq_len=SEQ, block_tokens=64, window=WINDOW)
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=OPT, config=config(stage, world_size)) as trainer:
        result = trainer.fit(source, global_batch_size=BATCH, steps=8, seed=SEED, progress=False)
        got = trainer.full_state_dict()
    assert result["step"] == 8
    assert max_dev(got, token_reference(tokens, 8, 64)) <= 1e-6


def parquet_corpus(directory: Path) -> tuple[list[np.ndarray], list[int]]:
    """Rows of SEQ + 1 tokens in two files of several row groups; the rows and row-group sizes."""
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, CFG.vocab_size, size=SEQ + 1) for _ in range(70)]
    table = pa.table({"tokens": [r.tolist() for r in rows], "doc": list(range(70))})
    pq.write_table(table.slice(0, 40), directory / "a.parquet", row_group_size=16)
    pq.write_table(table.slice(40), directory / "b.parquet", row_group_size=7)
    return rows, [16, 16, 8, 7, 7, 7, 7, 2]


def parquet_loss(module: torch.nn.Module, batch: dict) -> torch.Tensor:  # type: ignore[type-arg]
    return lm_loss(module, batch["tokens"])


@pytest.mark.parametrize(("stage", "world_size"), [(3, 1), (1, 2), (2, 3)])
def test_parquet_trains_as_one_process_at_any_world_size(tmp_path: Path, stage: int, world_size: int) -> None:
    rows, groups = parquet_corpus(tmp_path)
    order = reference_block_indices(groups, global_batch_size=BATCH, steps=14, seed=SEED, window=WINDOW)
    ref, _ = single_process(GPT_FN, lm_loss, OPT, [torch.tensor(np.stack([rows[i] for i in idx])) for idx in order])
    source = zr.data.Parquet(str(tmp_path / "*.parquet"), columns=["tokens"], window=WINDOW)
    with zr.ZeroTrainer(GPT_FN, parquet_loss, optimizer=OPT, config=config(stage, world_size)) as trainer:
        trainer.fit(source, global_batch_size=BATCH, steps=14, seed=SEED, progress=False)  # over an epoch's end
        got = trainer.full_state_dict()
    assert max_dev(got, ref) <= 1e-6


def s3_source(kind: str, tmp_path: Path, s3: S3Server) -> tuple[object, object, list[torch.Tensor]]:
    """A source on the local S3 server (token files, or Parquet files of several row groups),
    its loss function, and its first 20 global batches in the documented order."""
    bucket = s3.create_bucket(f"data-fit-{kind}")
    if kind == "tokens":
        tokens = write_corpus(tmp_path, (300, 200, 350))  # 106 samples: 17 batches an epoch
        for f in sorted(tmp_path.glob("train-*.bin")):
            s3.put(bucket, f"corpus/{f.name}", f.read_bytes())
        source = zr.data.TokenFiles(f"s3://{bucket}/corpus/train-*.bin", seq_len=SEQ, block_tokens=64, window=WINDOW)
        samples = (len(tokens) - 1) // SEQ
        order = reference_block_indices([8] * (samples // 8) + [samples % 8], global_batch_size=BATCH, steps=20,
                                        seed=SEED, window=WINDOW)
        return source, lm_loss, [token_windows(tokens, SEQ, idx) for idx in order]
    rows, groups = parquet_corpus(tmp_path)  # 70 rows: 11 batches an epoch
    for f in sorted(tmp_path.glob("*.parquet")):
        s3.put(bucket, f"rows/{f.name}", f.read_bytes())
    source = zr.data.Parquet(f"s3://{bucket}/rows/*.parquet", columns=["tokens"], window=WINDOW)
    order = reference_block_indices(groups, global_batch_size=BATCH, steps=20, seed=SEED, window=WINDOW)
    return source, parquet_loss, [torch.tensor(np.stack([rows[i] for i in idx])) for idx in order]


@pytest.mark.parametrize("kind", ["tokens", "parquet"])
def test_the_order_survives_a_sigkill_resizes_and_a_resume_at_another_size_on_s3(tmp_path: Path, s3: S3Server,
                                                                                  kind: str) -> None:
    source, loss_fn, batches = s3_source(kind, tmp_path, s3)
    ref, _ = single_process(GPT_FN, lm_loss, OPT, batches)
    cfg = config(2, 2, health_interval_s=0.2, health_timeout_s=3.0,
                 elastic=zr.ElasticConfig(redundancy="peer", max_world_size=3))
    fit = functools.partial(dict, global_batch_size=BATCH, seed=SEED, progress=False)
    with zr.ZeroTrainer(GPT_FN, loss_fn, optimizer=OPT, config=cfg) as trainer:
        pid = ray.get(trainer.actors[1].node.remote(), timeout=30)["pid"]

        def kill_after_step_3(metrics: dict) -> None:  # type: ignore[type-arg]
            if metrics["step"] == 3:
                os.kill(pid, signal.SIGKILL)  # mid-epoch, a real process

        trainer.fit(source, steps=6, callback=kill_after_step_3, **fit())
        assert [sorted(r.lost) for r in trainer.recoveries] == [[1]]
        trainer.resize(3)
        trainer.fit(source, steps=9, **fit())
        trainer.resize(2)
        trainer.fit(source, steps=11, **fit())
        checkpoint = trainer.save_checkpoint(tmp_path / "ckpt", wait=True)
    with zr.ZeroTrainer.from_checkpoint(checkpoint, GPT_FN, loss_fn, optimizer=OPT, config=config(2, 3)) as resumed:
        result = resumed.fit(source, steps=20, **fit())  # on, across the end of epoch 0
        got = resumed.full_state_dict()
    assert result["epoch"] == 1
    assert max_dev(got, ref) <= 1e-6


def test_resuming_over_other_data_names_what_changed(tmp_path: Path) -> None:
    write_corpus(tmp_path)
    source = zr.data.TokenFiles(str(tmp_path / "train-*.bin"), seq_len=SEQ, block_tokens=64, window=WINDOW)
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=OPT, config=config(1, 1)) as trainer:
        trainer.fit(source, global_batch_size=BATCH, steps=2, seed=SEED, progress=False)
        checkpoint = trainer.save_checkpoint(tmp_path / "ckpt", wait=True)
    (tmp_path / "train-1.bin").write_bytes((tmp_path / "train-1.bin").read_bytes()[:600])  # the data changed
    with zr.ZeroTrainer.from_checkpoint(checkpoint, GPT_FN, lm_loss, optimizer=OPT, config=config(1, 1)) as resumed:
        with pytest.raises(zr.ConfigError, match=r"source.files: .*train-1.bin \(1000 bytes\).*train-1.bin \(600 "):
            resumed.fit(source, global_batch_size=BATCH, steps=4, seed=SEED, progress=False)
        with pytest.raises(zr.ConfigError, match=r"source.seq_len: 8 -> 4"):
            resumed.fit(zr.data.TokenFiles(str(tmp_path / "train-*.bin"), seq_len=4, block_tokens=64, window=WINDOW),
                        global_batch_size=BATCH, steps=4, seed=SEED, progress=False)


def test_a_read_error_fails_the_step_and_loses_no_owner(tmp_path: Path) -> None:
    tokens = write_corpus(tmp_path)
    source = zr.data.TokenFiles(str(tmp_path / "train-*.bin"), seq_len=SEQ, block_tokens=64, window=WINDOW)
    gone = tmp_path / "train-2.bin"
    saved = gone.read_bytes()

    def delete_after_step_2(metrics: dict) -> None:  # type: ignore[type-arg]
        if metrics["step"] == 2:
            gone.unlink()  # after the scan: the owners cannot read its blocks any more

    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=OPT, config=config(2, 2)) as trainer:
        # An epoch (52 batches) reads every block; by step 2 (and the two prefetched) at most 6
        # of train-2.bin's 17 blocks can have been read.
        with pytest.raises(zr.DataError, match="train-2.bin"):
            trainer.fit(source, global_batch_size=BATCH, steps=52, seed=SEED, progress=False,
                        callback=delete_after_step_2)
        assert not gone.exists()  # the fault fired
        assert all(not r.lost for r in trainer.recoveries) and trainer.world_size == 2
        failed_at = trainer.step_count
        gone.write_bytes(saved)
        result = trainer.fit(source, global_batch_size=BATCH, steps=failed_at + 2, seed=SEED, progress=False)
        got = trainer.full_state_dict()
    assert 2 <= failed_at < 52 and result["step"] == failed_at + 2
    assert max_dev(got, token_reference(tokens, failed_at + 2, 64)) <= 1e-6


def test_a_ray_dataset_trains_as_one_process_at_two_world_sizes() -> None:
    rows = np.random.default_rng(3).integers(0, CFG.vocab_size, size=(60, SEQ + 1))
    ds = ray.data.from_items([{"tokens": r.tolist(), "n": i} for i, r in enumerate(rows)], override_num_blocks=5)
    ds = ds.filter(lambda row: row["n"] % 7 != 3)  # Ray Data's own operations run before fit reads it
    # The reference reads the blocks as Ray executed them (this test may hold them whole; fit never does).
    tables = ray.get(ds.to_arrow_refs())
    kept = [np.array(t.column("tokens").to_pylist()) for t in tables if t.num_rows]
    flat = np.concatenate(kept)
    assert zr.data.RayDataset(ds).scan().refs == zr.data.RayDataset(ds).scan().refs  # executed once per Dataset
    # As a RayDataset with its options, and as the Dataset itself (fit wraps it: window 4).
    for stage, world_size, source, window in ((2, 2, zr.data.RayDataset(ds, columns=("tokens",), window=WINDOW), WINDOW),
                                              (3, 3, ds, 4)):
        order = reference_block_indices([len(k) for k in kept], global_batch_size=BATCH, steps=10, seed=SEED,
                                        window=window)
        ref, _ = single_process(GPT_FN, lm_loss, OPT, [torch.tensor(flat[idx]) for idx in order])
        with zr.ZeroTrainer(GPT_FN, parquet_loss, optimizer=OPT, config=config(stage, world_size)) as trainer:
            trainer.fit(source, global_batch_size=BATCH, steps=5, seed=SEED, progress=False)
            trainer.resize(world_size - 1)  # the next fit reads the same executed blocks on fewer owners
            trainer.fit(source, global_batch_size=BATCH, steps=10, seed=SEED, progress=False)
            got = trainer.full_state_dict()
        assert max_dev(got, ref) <= 1e-6, (stage, world_size)
