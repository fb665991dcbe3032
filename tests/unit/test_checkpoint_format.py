"""The checkpoint format without Ray: ranged verified reads, read plans, model checks, damaged and
unfinished checkpoints, atomic commits, and a writer killed in the middle of a save."""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_builders import ADAM, Saved, flip_byte, save
from safetensors.torch import load_file

import zero_ray
from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import MANIFEST_NAME, MASTER, Manifest, model_mismatch
from zero_ray.checkpoint.store import CheckpointReader, resolve
from zero_ray.errors import CheckpointError
from zero_ray.models import mlp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(zero_ray.__file__)))


@pytest.fixture
def saved(tmp_path: Path) -> Saved:
    torch.manual_seed(0)
    return save(mlp(8, 3), tmp_path / "root", world_size=3)


def shard_path(saved: Saved, rank: int) -> str:
    return os.path.join(saved.path, CheckpointReader(saved.path).manifest.files[rank].name)


def test_every_range_reads_back_across_entries_and_files(saved: Saved) -> None:
    reader = CheckpointReader(saved.path)
    spanning = 0
    for (kind, name), value in saved.values.items():
        if kind == "buffer":
            continue
        n = value.numel()
        spanning += len({p.file for p in reader.manifest.pieces(kind, name, 0, n)}) > 1
        for start, end in [(0, n), (1, n - 1), (n // 3, n // 3 + 1), (n // 2, n), (5, 5)]:
            torch.testing.assert_close(reader.read(kind, name, start, end), value[start:end], rtol=0, atol=0)
    assert spanning > 0, "the layout should split some parameter across rank files"


def test_rank_files_are_standard_safetensors(saved: Saved) -> None:
    reader = CheckpointReader(saved.path)
    for i, record in enumerate(reader.manifest.files):
        tensors = load_file(shard_path(saved, i))
        assert set(tensors) == {e.key for e in record.entries}
        for e in record.entries:
            torch.testing.assert_close(tensors[e.key], reader.file(i).read_entry(e), rtol=0, atol=0)


def test_manifest_json_round_trip(saved: Saved) -> None:
    m = CheckpointReader(saved.path).manifest
    assert Manifest.from_json(m.to_json(), where="x") == m


def test_pieces_cover_a_range_in_order_and_a_gap_is_an_error(saved: Saved) -> None:
    m = CheckpointReader(saved.path).manifest
    name = max(m.params, key=lambda p: p.numel).name
    numel = m.param(name).numel
    plan = m.pieces(MASTER, name, 0, numel)
    assert len(plan) > 1
    assert [p.dest for p in plan] == [sum(q.end - q.start for q in plan[:i]) for i in range(len(plan))]
    assert sum(p.end - p.start for p in plan) == numel
    assert m.pieces(MASTER, name, 3, 3) == []

    # Drop one fragment in the middle: any range over it fails, naming the parameter and the hole.
    (i, hole), *_ = [(i, e) for i, e in m.entries(MASTER, name) if e.start > 0]
    files = list(m.files)
    files[i] = dataclasses.replace(files[i], entries=tuple(e for e in files[i].entries if e != hole))
    broken = dataclasses.replace(m, files=tuple(files))
    with pytest.raises(CheckpointError, match=rf"lacks master of '{name}' elements \[{hole.start}, "):
        broken.pieces(MASTER, name, 0, numel)
    assert broken.pieces(MASTER, name, 0, hole.start)  # the part before the hole still plans
    with pytest.raises(CheckpointError, match="lacks momentum_buffer of"):
        broken.pieces("momentum_buffer", name, 0, 1)  # a moment never saved


def test_model_mismatch_lists_names_and_shapes(saved: Saved) -> None:
    m = CheckpointReader(saved.path).manifest
    specs = [(p.name, p.shape) for p in m.params]
    assert model_mismatch(m, specs) is None
    changed = [("0.weight", (8, 9)), *specs[1:-1], ("extra.bias", (8,))]
    diff = model_mismatch(m, changed)
    assert diff is not None
    assert f"only in the checkpoint: ['{specs[-1][0]}']" in diff
    assert "only in the model: ['extra.bias']" in diff
    assert "('0.weight', (8, 8), (8, 9))" in diff


def test_a_flipped_byte_is_a_checksum_error_naming_the_file(saved: Saved) -> None:
    path = shard_path(saved, 1)
    reader = CheckpointReader(saved.path)
    entry = reader.manifest.files[1].entries[0]
    flip_byte(path, entry.offset)
    with pytest.raises(CheckpointError, match=rf"{path}: checksum mismatch"):
        CheckpointReader(saved.path).read(entry.kind, entry.name, entry.start, entry.end)
    with pytest.raises(CheckpointError, match=rf"{path}: checksum mismatch"):
        CheckpointReader(saved.path).file(1).verify()
    CheckpointReader(saved.path).file(0).verify()  # the other files are fine


def test_truncated_and_missing_files_are_errors_naming_the_file(saved: Saved) -> None:
    path = shard_path(saved, 2)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(CheckpointError, match=rf"{path} has \d+ bytes but the manifest records \d+.*truncated"):
        CheckpointReader(saved.path).check_files()
    os.remove(path)
    with pytest.raises(CheckpointError, match=rf"{path} is missing \(rank 2\)"):
        CheckpointReader(saved.path).check_files()


def test_unknown_format_version_is_an_error(saved: Saved) -> None:
    where = os.path.join(saved.path, MANIFEST_NAME)
    with open(where) as fh:
        data = json.load(fh)
    data["format_version"] = 99
    with open(where, "w") as fh:
        json.dump(data, fh)
    with pytest.raises(CheckpointError, match=rf"{where}: format_version=99 is not supported.*upgrade zero_ray"):
        CheckpointReader(saved.path)


def test_a_format_4_manifest_reads_as_tensor_parallel_1(saved: Saved) -> None:
    # before tensor parallelism: no entry offsets, no tensor_parallel; every range reads as it did
    where = os.path.join(saved.path, MANIFEST_NAME)
    with open(where) as fh:
        data = json.load(fh)
    del data["tensor_parallel"]
    for f in data["files"]:
        for e in f["entries"]:
            del e["offsets"], e["extent"]
    data["format_version"] = 4
    with open(where, "w") as fh:
        json.dump(data, fh)
    reader = CheckpointReader(saved.path)
    assert reader.manifest.tensor_parallel == 1
    for (kind, name), value in saved.values.items():
        if kind == MASTER:
            assert torch.equal(reader.read(kind, name, 1, value.numel()), value[1:])


def test_a_directory_without_manifest_is_still_being_written(saved: Saved, tmp_path: Path) -> None:
    pending = store.begin(str(tmp_path / "root"), 9)
    with pytest.raises(CheckpointError, match="still being written"):
        resolve(pending.tmp)
    only_files = tmp_path / "copied"
    only_files.mkdir()
    shutil.copy(shard_path(saved, 0), only_files)
    with pytest.raises(CheckpointError, match="still being written"):
        CheckpointReader(str(only_files))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(str(tmp_path / "nowhere"))


def test_latest_moves_only_on_commit_and_keep_prunes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = save(mlp(8, 2), root, world_size=2, step=1, keep=2)
    assert resolve(str(root)) == first.path
    pending = store.begin(str(root), 2)
    assert resolve(str(root)) == first.path  # a save in progress is not the latest
    store.abandon(pending)
    second = save(mlp(8, 2), root, world_size=2, step=2, keep=2)
    assert resolve(str(root)) == second.path
    again = save(mlp(8, 2), root, world_size=2, step=2, keep=2)  # the same step twice gets a new name
    assert again.path == os.path.join(root, "step-00000002-1")
    assert store.committed(str(root)) == ["step-00000002", "step-00000002-1"]
    assert not os.path.exists(first.path)


# The writer saves step 8 into the root through a storage that reports its temp directory once
# the first block is on disk, then blocks until the test kills it.
_KILLED_WRITER = """
import sys
from contextlib import contextmanager
import torch
from zero_ray.checkpoint import store
from zero_ray.checkpoint.shardfile import Item, write_shard
from zero_ray.checkpoint.storage import LocalStorage

CHUNK = 2**20

class Reporting:
    def __init__(self, fh):
        self.fh, self.written = fh, 0
    def write(self, data):
        self.fh.write(data)
        self.written += memoryview(data).nbytes
        if self.written >= CHUNK:
            self.fh.flush()
            print(pending.tmp, flush=True)
            sys.stdin.read()  # until killed

class ReportingStorage(LocalStorage):
    @contextmanager
    def open_write(self, path):
        with super().open_write(path) as fh:
            yield Reporting(fh)

storage = ReportingStorage()
pending = store.begin(sys.argv[1], 8, storage=storage)
big = torch.zeros(4 * CHUNK // 4)
write_shard(storage, storage.join(pending.tmp, "rank-00000-of-00001.safetensors"),
            [Item(key="master/w/0", kind="master", name="w", start=0, end=big.numel(), tensor=big)],
            rank=0, name="rank-00000-of-00001.safetensors", chunk_bytes=CHUNK)
print("not killed", flush=True)
"""


def test_a_writer_killed_mid_save_leaves_latest_on_the_previous_checkpoint(saved: Saved) -> None:
    root = os.path.dirname(saved.path)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            assert sel.select(timeout=120), "the writer did not report its first block in time"
        tmp = proc.stdout.readline().decode().strip()  # type: ignore[union-attr]
        assert tmp, proc.stderr.read().decode()  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert os.path.isdir(tmp) and os.listdir(tmp) == ["rank-00000-of-00001.safetensors"]
    assert resolve(root) == saved.path
    assert store.committed(root) == [os.path.basename(saved.path)]
    with pytest.raises(CheckpointError, match="still being written"):
        resolve(tmp)
    reader = CheckpointReader(root)
    for (kind, name), value in saved.values.items():
        if kind in (MASTER, *ADAM):
            torch.testing.assert_close(reader.read(kind, name, 0, value.numel()), value, rtol=0, atol=0)
