"""zero_ray.data without Ray: the block order against its documented reading, token files and
Parquet against numpy's and pyarrow's own reading, the owner's cache and prefetch, and every
bad input named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec.implementations.local
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fit_order import reference_block_indices, token_windows
from s3_server import S3Server
from tests_paths import REPO_ROOT
from zero_ray.core.data_order import BlockOrder
from zero_ray.data import Parquet, TokenFiles, opener
from zero_ray.errors import ConfigError, DataError


def write_tokens(directory: Path, lengths: list[int], dtype: str = "<u2", vocab: int = 50_000) -> np.ndarray:
    """Files part-000.bin.. holding one token stream, as nanoGPT's prepare.py writes them."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=sum(lengths)).astype(dtype)
    start = 0
    for i, n in enumerate(lengths):
        tokens[start:start + n].tofile(directory / f"part-{i:03d}.bin")
        start += n
    return tokens


# -- the order (pure) ------------------------------------------------------------------------------
@pytest.mark.parametrize(("sizes", "batch", "window"), [([5, 3, 0, 7, 7, 2], 4, 2), ([10] * 9, 7, 4), ([3], 2, 1)])
def test_block_order_is_the_documented_one(sizes: list[int], batch: int, window: int) -> None:
    order = BlockOrder(block_sizes=tuple(sizes), global_batch_size=batch, seed=3, window=window)
    steps = 3 * order.batches_per_epoch + 1  # across epoch boundaries
    assert [list(order.indices(k)) for k in range(steps)] == reference_block_indices(
        sizes, global_batch_size=batch, steps=steps, seed=3, window=window)


def test_an_epoch_reads_each_sample_at_most_once_and_a_batch_few_blocks() -> None:
    order = BlockOrder(block_sizes=(16,) * 32, global_batch_size=24, seed=0, window=4)
    epoch = [i for k in range(order.batches_per_epoch) for i in order.indices(k)]
    assert len(epoch) == len(set(epoch)) == 21 * 24  # 512 samples, 8 dropped as the partial last batch
    for k in range(order.batches_per_epoch):  # a batch spans at most two windows: 8 blocks of 32
        assert len({order.block_of(i) for i in order.indices(k)}) <= 8
    assert order.indices(21) != order.indices(0)  # epoch 1 is another permutation


def test_block_order_refuses_bad_values_by_name() -> None:
    with pytest.raises(ConfigError, match="global_batch_size=9 is larger than the data \\(8 samples\\)"):
        BlockOrder(block_sizes=(4, 4), global_batch_size=9)
    with pytest.raises(ConfigError, match="window=0"):
        BlockOrder(block_sizes=(4, 4), global_batch_size=2, window=0)
    with pytest.raises(ConfigError, match="block_sizes"):
        BlockOrder(block_sizes=(), global_batch_size=2)


# -- token files ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_samples_are_windows_of_the_concatenated_files(tmp_path: Path, dtype: str) -> None:
    tokens = write_tokens(tmp_path, [1000, 37, 2500], dtype="<u2" if dtype == "uint16" else "<u4", vocab=70_000
                          if dtype == "uint32" else 50_000)
    layout = TokenFiles(str(tmp_path / "part-*.bin"), seq_len=16, dtype=dtype, block_tokens=100).scan()
    assert [os.path.basename(f.url) for f in layout.files] == ["part-000.bin", "part-001.bin", "part-002.bin"]
    reader = opener(layout)()
    assert len(reader) == (len(tokens) - 1) // 16
    every = list(range(len(reader)))
    assert torch.equal(torch.stack(reader.read(every)), token_windows(tokens, 16, every))  # across file ends


def test_a_step_reads_whole_blocks_once_and_prefetches_the_next(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path, [20_000])
    layout = TokenFiles(str(tmp_path / "part-000.bin"), seq_len=10, block_tokens=100, window=4).scan()
    order = BlockOrder(block_sizes=layout.block_sizes, global_batch_size=16, seed=1, window=4)
    reader = opener(layout, order)()
    for step in range(3 * order.batches_per_epoch // 4):
        idx = list(order.indices(step))
        got = torch.stack(reader.read(idx, step=step))
        assert torch.equal(got, token_windows(tokens, 10, idx))
        assert reader.drain(timeout_s=30.0)
        assert reader.cached_bytes <= layout.cache_bytes
        if step:  # after the first step every block was in memory before the step asked
            assert reader.missed_blocks == 0, step
    reader.close()


def test_resident_memory_stays_within_the_cache_on_a_corpus_40x_larger(tmp_path: Path) -> None:
    # In a process of its own: its peak resident memory after reading 80 MB through a 2 MB cache.
    write_tokens(tmp_path, [40_000_000])
    script = f"""
from zero_ray.core.data_order import BlockOrder
from zero_ray.data import TokenFiles, opener

def rss_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))

layout = TokenFiles({str(tmp_path / 'part-000.bin')!r}, seq_len=1024, block_tokens=1 << 17, window=4,
                    cache_bytes=2 << 20).scan()
order = BlockOrder(block_sizes=layout.block_sizes, global_batch_size=16, seed=0, window=4)
reader = opener(layout, order)()
reader.read(order.indices(0), step=0)
base, peak = rss_kib(), 0
for step in range(order.batches_per_epoch):
    reader.read(order.indices(step), step=step)
    peak = max(peak, rss_kib())
print(peak - base, reader.blocks_read, len(layout.block_sizes))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    grown_kib, read, blocks = map(int, out.stdout.split())
    print(f"resident memory grew at most {grown_kib / 1024:.1f} MiB over an 80 MB corpus, 2 MiB cache; {read} block reads of {blocks}")
    assert read >= blocks  # the whole corpus went through
    assert grown_kib < 24 * 1024  # the cache (2 MiB) plus a step's samples, never the corpus


def test_bad_token_files_are_named(tmp_path: Path) -> None:
    write_tokens(tmp_path, [100])
    with pytest.raises(DataError, match="does not exist"):
        TokenFiles(str(tmp_path / "missing.bin"), seq_len=4).scan()
    with pytest.raises(DataError, match="matches no file"):
        TokenFiles(str(tmp_path / "*.tokens"), seq_len=4).scan()
    with pytest.raises(DataError, match="seq_len=200 needs at least 201 tokens but the files hold 100"):
        TokenFiles(str(tmp_path / "part-000.bin"), seq_len=200).scan()
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="odd.bin: 3 bytes is not a whole number of uint16 tokens"):
        TokenFiles([str(tmp_path / "part-000.bin"), str(tmp_path / "odd.bin")], seq_len=4).scan()
    with pytest.raises(ConfigError, match="dtype='int8'"):
        TokenFiles(str(tmp_path / "part-000.bin"), seq_len=4, dtype="int8")
    layout = TokenFiles(str(tmp_path / "part-000.bin"), seq_len=4).scan()
    (tmp_path / "part-000.bin").write_bytes(b"")  # truncated after the scan: a read cannot get its range
    with pytest.raises(DataError, match="part-000.bin: reading bytes"):
        opener(layout)()[0]


class FlakyFileSystem(fsspec.implementations.local.LocalFileSystem):
    """A local filesystem whose first ``failures`` opens fail as a dropped connection would."""

    def __init__(self, failures: int) -> None:
        super().__init__(skip_instance_cache=True)
        self.failures, self.fired = failures, 0

    def _open(self, path, mode="rb", **kw):  # type: ignore[no-untyped-def]
        if "r" in mode and self.fired < self.failures:
            self.fired += 1
            raise ConnectionResetError(f"Connection reset by peer (injected #{self.fired})")
        return super()._open(path, mode=mode, **kw)


def test_a_transient_read_error_is_retried_and_a_persistent_one_named(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path, [500])
    path = str(tmp_path / "part-000.bin")
    flaky = FlakyFileSystem(failures=2)
    reader = opener(TokenFiles(path, seq_len=8, filesystem=flaky).scan())()
    assert torch.equal(reader[3], token_windows(tokens, 8, [3])[0])
    assert flaky.fired == 2  # both faults fired, and the read went through on the third try
    broken = FlakyFileSystem(failures=100)
    reader = opener(TokenFiles(path, seq_len=8, filesystem=broken).scan())()
    with pytest.raises(DataError, match=r"part-000.bin: .*failed 4 times .*Connection reset by peer"):
        reader[3]
    assert broken.fired == 4


# -- Parquet ---------------------------------------------------------------------------------------------
def test_parquet_rows_are_samples(tmp_path: Path) -> None:
    table = pa.table({"x": np.arange(10, dtype=np.float32), "ids": [[i, i + 1, i + 2] for i in range(10)],
                      "text": [f"row {i}" for i in range(10)]})
    pq.write_table(table.slice(0, 7), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(table.slice(7), tmp_path / "b.parquet", row_group_size=2)
    layout = Parquet(str(tmp_path / "*.parquet"), columns=["ids", "x", "text"]).scan()
    assert layout.block_sizes == (3, 3, 1, 2, 1)  # row groups, file after file
    reader = opener(layout)()
    for i in range(10):
        row = reader[i]
        assert torch.equal(row["ids"], torch.tensor([i, i + 1, i + 2])) and float(row["x"]) == i
        assert row["text"] == f"row {i}"


def test_bad_parquet_is_named(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2], "b": [1.0, 2.0]}), tmp_path / "one.parquet")
    pq.write_table(pa.table({"a": ["x", "y"], "b": [1.0, 2.0]}), tmp_path / "two.parquet")
    with pytest.raises(DataError, match="two.parquet: column 'a' is string but .*one.parquet has it as int64"):
        Parquet(str(tmp_path / "*.parquet")).scan()
    with pytest.raises(DataError, match="one.parquet: has no column 'c'"):
        Parquet(str(tmp_path / "one.parquet"), columns=["a", "c"]).scan()
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable Parquet file"):
        Parquet(str(tmp_path / "junk.parquet")).scan()
    with pytest.raises(ConfigError, match="columns='a'"):
        Parquet(str(tmp_path / "one.parquet"), columns="a")


# -- an object store ----------------------------------------------------------------------------------------
def test_token_files_on_s3_read_through_a_flaky_store_and_name_refused_credentials(s3: S3Server,
                                                                                   tmp_path: Path) -> None:
    from s3_server import SECRET_KEY

    tokens = write_tokens(tmp_path, [3000, 1000])
    bucket = s3.create_bucket("data-sources")
    for name in ("part-000.bin", "part-001.bin"):
        s3.put(bucket, f"corpus/{name}", (tmp_path / name).read_bytes())
    source = TokenFiles(f"s3://{bucket}/corpus/part-*.bin", seq_len=16, block_tokens=256)
    layout = source.scan()
    assert [f.url for f in layout.files] == [f"s3://{bucket}/corpus/part-000.bin", f"s3://{bucket}/corpus/part-001.bin"]
    with s3.failing(r"/corpus/part-001\.bin", count=2, methods=("GET",)) as rule:  # two 503s, then served
        got = torch.stack(opener(layout)().read(list(range(len(tokens) // 16 - 1))))
    assert rule.remaining == 0  # both faults fired
    assert torch.equal(got, token_windows(tokens, 16, list(range(len(tokens) // 16 - 1))))
    with s3.authenticating(), pytest.raises(DataError) as caught:
        source.scan()
    message = str(caught.value)
    assert "part-" in message and "refused the credentials" in message and SECRET_KEY not in message
