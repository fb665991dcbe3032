"""The main job's token files (`examples/train_gpt.py --data DIR`, zero_ray/demo.py), without
Ray: it writes them only where none exist, reuses the ones an earlier run wrote (byte for byte
the same), refuses any other file there with a DataError naming it, leaving it untouched (bytes
and modification time), locally and on the session's local S3 server; and a write that fails
midway leaves no file under the final name."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
from s3_server import S3Server

from zero_ray import demo
from zero_ray.errors import DataError

BLOCK, EVAL = 16, 0.1


def corpus() -> torch.Tensor:
    return (torch.arange(4096) * 7 % 251).to(torch.uint8)


def expected() -> dict[str, bytes]:
    return demo.token_parts(corpus(), eval_fraction=EVAL, block_size=BLOCK)


def write(data: str, said: list[str] | None = None) -> tuple[str, str]:
    return demo.write_token_files(data, corpus(), eval_fraction=EVAL, block_size=BLOCK,
                                  say=(said if said is not None else []).append)


def state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def test_writes_the_files_once_then_reuses_them(tmp_path: Path) -> None:
    said: list[str] = []
    train, val = write(str(tmp_path / "corpus"), said)
    parts = expected()
    assert Path(train).read_bytes() == parts["train.bin"] and Path(val).read_bytes() == parts["val.bin"]
    assert len(parts["val.bin"]) == 2 * int(4096 * EVAL)  # uint16: two bytes a token
    assert sorted(os.listdir(tmp_path / "corpus")) == ["train.bin", "val.bin"]  # no temp file left
    assert [s.split(" ")[0] for s in said] == ["wrote", "wrote"]
    before = state(Path(train)), state(Path(val))
    said.clear()
    assert write(str(tmp_path / "corpus"), said) == (train, val)
    assert (state(Path(train)), state(Path(val))) == before
    assert [s.split(" ")[0] for s in said] == ["reusing", "reusing"] and "byte for byte" in said[0]


def test_an_existing_file_of_another_size_is_refused_and_left_byte_for_byte(tmp_path: Path) -> None:
    mine = tmp_path / "train.bin"
    mine.write_bytes(b"the user's own tokens" * 100)
    os.utime(mine, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    before = state(mine)
    with pytest.raises(DataError) as err:
        write(str(tmp_path))
    message = str(err.value)
    assert str(mine) in message and "2,100 bytes" in message
    assert f"{len(expected()['train.bin']):,} bytes" in message
    assert "another --data directory" in message and "remove it" in message
    assert state(mine) == before
    assert os.listdir(tmp_path) == ["train.bin"]  # val.bin not written either: refused before any write


def test_the_job_refuses_before_starting_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`examples/train_gpt.py --data DIR` over a user's train.bin: the job stops with the
    DataError before Ray starts (or anything is written), the file as it was."""
    import ray

    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("the job started Ray before checking --data")

    monkeypatch.setattr(ray, "init", no_ray)
    mine = tmp_path / "train.bin"
    mine.write_bytes(b"\x01\x02" * 999)
    before = state(mine)
    with pytest.raises(DataError, match="1,998 bytes"):
        demo.main(["--data", str(tmp_path), "--corpus-bytes", "65536", "--no-progress"])
    assert state(mine) == before and os.listdir(tmp_path) == ["train.bin"]


def test_a_file_of_the_same_size_with_other_contents_is_refused(tmp_path: Path) -> None:
    parts = expected()
    (tmp_path / "train.bin").write_bytes(parts["train.bin"])  # an earlier run's: fine
    theirs = tmp_path / "val.bin"
    theirs.write_bytes(bytes(len(parts["val.bin"])))  # same size, not the corpus
    before = state(theirs)
    with pytest.raises(DataError, match="has the size of the main job's token file") as err:
        write(str(tmp_path))
    assert str(theirs) in str(err.value) and "another --data directory" in str(err.value)
    assert state(theirs) == before


def test_a_name_taken_during_the_write_is_not_replaced(tmp_path: Path) -> None:
    """Another process creating the file between the check and the write: the link into place
    fails, the file stays, the temp file goes."""
    theirs = tmp_path / "train.bin"
    theirs.write_bytes(b"written meanwhile")
    before = state(theirs)
    with pytest.raises(DataError, match="17 bytes"):
        demo._write_new(demo.LocalStorage(), str(theirs), expected()["train.bin"])
    assert state(theirs) == before and os.listdir(tmp_path) == ["train.bin"]


def test_a_write_that_fails_midway_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired = []

    def full_disk(fd: int) -> None:
        fired.append(fd)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write(str(tmp_path))
    assert fired and os.listdir(tmp_path) == []  # neither a half train.bin nor a temp file
    monkeypatch.undo()
    train, _ = write(str(tmp_path))  # the next run writes it whole
    assert Path(train).read_bytes() == expected()["train.bin"]


def test_on_s3_an_existing_object_is_refused_and_never_written(s3: S3Server) -> None:
    bucket = s3.create_bucket(f"main-job-{uuid.uuid4().hex[:10]}")
    s3.put(bucket, "corpus/train.bin", b"the user's own tokens" * 100)
    head = s3.client().head_object(Bucket=bucket, Key="corpus/train.bin")
    seen = len(s3.requests())
    with pytest.raises(DataError) as err:
        write(f"s3://{bucket}/corpus")
    assert f"s3://{bucket}/corpus/train.bin" in str(err.value) and "2,100 bytes" in str(err.value)
    writes = [r for r in s3.requests()[seen:] if r.method in ("PUT", "POST", "DELETE")]
    assert writes == []
    assert s3.get(bucket, "corpus/train.bin") == b"the user's own tokens" * 100
    after = s3.client().head_object(Bucket=bucket, Key="corpus/train.bin")
    assert (after["ETag"], after["LastModified"]) == (head["ETag"], head["LastModified"])
    assert s3.keys(bucket) == ["corpus/train.bin"]


def test_on_s3_the_files_are_written_once_then_reused(s3: S3Server) -> None:
    bucket = s3.create_bucket(f"main-job-{uuid.uuid4().hex[:10]}")
    said: list[str] = []
    train, val = write(f"s3://{bucket}/corpus", said)
    assert (train, val) == (f"s3://{bucket}/corpus/train.bin", f"s3://{bucket}/corpus/val.bin")
    assert s3.get(bucket, "corpus/train.bin") == expected()["train.bin"]
    seen = len(s3.requests())
    said.clear()
    write(f"s3://{bucket}/corpus", said)
    assert [s.split(" ")[0] for s in said] == ["reusing", "reusing"]
    assert [r for r in s3.requests()[seen:] if r.method in ("PUT", "POST", "DELETE")] == []


def test_the_default_location_is_named_by_the_files_it_holds() -> None:
    """Without --data or --checkpoint-dir: other settings (or another Python's corpus) go to
    another directory instead of meeting an earlier run's files and being refused."""
    args = demo.argparse.Namespace(checkpoint_dir=None, corpus_bytes=4096)
    one = demo.default_data(args, expected())
    other = demo.default_data(args, demo.token_parts(corpus(), eval_fraction=0.2, block_size=BLOCK))
    assert one != other and one == demo.default_data(args, expected())
    assert demo.default_data(demo.argparse.Namespace(checkpoint_dir="s3://b/run/", corpus_bytes=4096),
                             expected()) == "s3://b/run/corpus"
