"""Checkpoints on an object store, without Ray: locations, the commit protocol on a store without
rename, verified ranged reads, keep, faults of the store (transient, persistent, unreachable,
wrong credentials) and the offline tools, against the session's local S3 server (moto), which
everything reaches only through the standard AWS_* environment."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from checkpoint_builders import ADAM, flip_byte, save
from s3_server import SECRET_KEY, S3Server

from zero_ray.checkpoint import store
from zero_ray.checkpoint.format import MASTER
from zero_ray.checkpoint.location import StoreOptions, open_location
from zero_ray.checkpoint.objectstore import FileSystemStorage
from zero_ray.checkpoint.shardfile import Item, write_shard
from zero_ray.checkpoint.storage import LocalStorage
from zero_ray.checkpoint.store import CheckpointReader
from zero_ray.checkpoint.tools import consolidate, inspect_checkpoint
from zero_ray.cli import main
from zero_ray.config import CheckpointConfig
from zero_ray.errors import CheckpointError, ConfigError
from zero_ray.models import mlp


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.create_bucket(f"unit-{uuid.uuid4().hex[:10]}")


def small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return mlp(8, 3)


def save_to(url: str, **kw):  # type: ignore[no-untyped-def]
    storage, root = open_location(url)
    return save(small_mlp(), root, world_size=2, storage=storage, **kw)


# -- locations ---------------------------------------------------------------------------------------
def test_locations_open_as_their_storage(tmp_path: Path, s3: S3Server) -> None:
    storage, path = open_location("s3://b/run")
    assert isinstance(storage, FileSystemStorage) and path == "s3://b/run" and not storage.renames
    assert s3.endpoint in storage.where  # named in messages: the endpoint, never a credential
    assert open_location(f"file://{tmp_path}")[1] == str(tmp_path)
    assert isinstance(open_location(tmp_path)[0], LocalStorage)
    assert isinstance(open_location("relative/dir")[0], LocalStorage)
    for bad, words in [(Path("s3://b/run"), "lost its '//'"), ("s3:b/run", "lost its '//'"),
                       ("nosuch://b/run", "no filesystem is known"), ("s3://", "names no bucket")]:
        with pytest.raises(ConfigError, match=words):
            open_location(bad)
        with pytest.raises(ConfigError, match=words):
            CheckpointConfig(dir=bad)
    import fsspec

    with pytest.raises(ConfigError, match="not the URL"):
        open_location("s3://b/run", filesystem=fsspec.filesystem("memory"))
    with pytest.raises(ConfigError, match="pyarrow.fs.FileSystem"):
        CheckpointConfig(dir="b/run", filesystem=object())


def test_a_filesystem_object_is_named_by_a_key_that_reopens_it() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    storage, root = open_location(f"/zr-{uuid.uuid4().hex[:8]}", filesystem=fs)
    saved = save(small_mlp(), root, world_size=2, storage=storage)
    again, path = open_location(storage.locate(saved.path))  # what an owner is sent
    assert again.locate(path) == storage.locate(saved.path)
    reader = CheckpointReader(path, storage=again)
    for (kind, name), value in saved.values.items():
        if kind == MASTER:
            torch.testing.assert_close(reader.read(kind, name, 0, value.numel()), value, rtol=0, atol=0)
    assert CheckpointReader(root, filesystem=fs).path == saved.path


# -- the commit protocol on a store without rename -------------------------------------------------------
def test_a_checkpoint_round_trips_and_keep_prunes_in_the_bucket(s3: S3Server, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    paths = [save_to(url, step=step, keep=2).path for step in (1, 2, 3)]
    saved = save_to(url, step=4, keep=2)
    assert saved.path == f"{url}/step-00000004"
    storage, root = open_location(url)
    assert store.committed(root, storage=storage) == ["step-00000003", "step-00000004"]
    keys = s3.keys(bucket, "run/")
    assert not [k for k in keys if "step-00000001" in k or "step-00000002" in k], keys  # pruned in the bucket
    assert s3.get(bucket, "run/latest") == b"step-00000004"
    assert sorted(k for k in keys if k.startswith("run/step-00000004/")) == [
        "run/step-00000004/manifest.json", "run/step-00000004/rank-00000-of-00002.safetensors",
        "run/step-00000004/rank-00000-of-00002.safetensors".replace("00000-of", "00001-of")]
    reader = CheckpointReader(url)  # the root: its latest
    assert reader.path == saved.path and paths[-1] == f"{url}/step-00000003"
    for (kind, name), value in saved.values.items():
        if kind in (MASTER, *ADAM):
            torch.testing.assert_close(reader.read(kind, name, 0, value.numel()), value, rtol=0, atol=0)


def test_a_save_without_its_manifest_is_never_read(s3: S3Server, bucket: str) -> None:
    url = f"s3://{bucket}/run"
    saved = save_to(url, step=1)
    s3.put(bucket, "run/step-00000002/rank-00000-of-00002.safetensors", b"partial")  # a writer that died
    assert CheckpointReader(url).path == saved.path
    with pytest.raises(CheckpointError, match="still being written"):
        CheckpointReader(f"{url}/step-00000002")
    storage, root = open_location(url)
    assert store.begin(root, 2, storage=storage).name == "step-00000002-1"  # the leftover is not reused


def test_a_flipped_byte_in_a_stored_object_is_refused(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    saved = save_to(f"s3://{bucket}/run")
    key = "run/step-00000003/rank-00001-of-00002.safetensors"
    local = tmp_path / "shard"
    local.write_bytes(s3.get(bucket, key))
    entry = CheckpointReader(saved.path).manifest.files[1].entries[0]  # a master fragment
    flip_byte(str(local), entry.offset + 2)
    s3.put(bucket, key, local.read_bytes())
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        inspect_checkpoint(saved.path, verify=True)
    reader = CheckpointReader(saved.path)
    with pytest.raises(CheckpointError, match=f"s3://{bucket}/{key}: checksum mismatch"):
        for (kind, name), value in saved.values.items():
            if kind in (MASTER, *ADAM):
                reader.read(kind, name, 0, value.numel())


def test_reads_fetch_only_the_ranges_they_need(s3: S3Server, bucket: str) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    storage, root = open_location(f"s3://{bucket}/big")
    saved = save(module, root, world_size=2, storage=storage, bucket_numel=10_000, chunk_bytes=1024)
    reader = CheckpointReader(saved.path)
    before = len(s3.requests())
    got = reader.read(MASTER, "1.bias", 0, 64)
    torch.testing.assert_close(got, saved.values[(MASTER, "1.bias")], rtol=0, atol=0)
    gets = [r for r in s3.requests()[before:] if r.method == "GET" and r.path.endswith(".safetensors")]
    assert gets and all(r.range and r.range.startswith("bytes=") for r in gets)  # ranged GETs only
    size = sum(f.size for f in reader.manifest.files)
    assert reader.bytes_read <= 2 * 1024 < size / 10


def test_parts_of_one_upload_go_up_in_parallel(s3: S3Server, bucket: str) -> None:
    """Parts 1 and 2 of one file are both at the server, neither answered: the upload is
    multipart and its parts are in flight together."""
    storage, root = open_location(f"s3://{bucket}/parts")
    big = torch.zeros(3 * 2**22)  # 48 MiB: several 10 MiB parts
    item = Item(key="master/w/0", kind=MASTER, name="w", start=0, end=big.numel(), tensor=big)
    done: list[object] = []
    with s3.holding(r"rank-00000.*partNumber=1(&|$)", methods=("PUT",)) as first, \
            s3.holding(r"rank-00000.*partNumber=2(&|$)", methods=("PUT",)) as second:
        writer = threading.Thread(target=lambda: done.append(write_shard(
            storage, f"{root}/rank-00000-of-00001.safetensors", [item], rank=0, name="r", chunk_bytes=2**22)))
        writer.start()
        both = first.arrived.wait(timeout=60) and second.arrived.wait(timeout=60)
    writer.join(timeout=60)
    assert both, "part 2 waited for part 1 to be answered"
    assert done and s3.keys(bucket, "parts/") == ["parts/rank-00000-of-00001.safetensors"]


# -- faults of the store -----------------------------------------------------------------------------------
def test_transient_errors_are_retried(s3: S3Server, bucket: str) -> None:
    with s3.failing(r"/run/.*rank-00001", count=2) as rule:
        saved = save_to(f"s3://{bucket}/run")
    assert rule.hits == 2
    with s3.failing(r"/run/.*rank-00001", count=2, methods=("GET",)) as rule:
        assert inspect_checkpoint(saved.path, verify=True)["verified"]
    assert rule.hits == 2


def test_a_store_that_keeps_failing_is_reported_in_bounded_time(s3: S3Server, bucket: str) -> None:
    started = time.monotonic()
    with s3.failing(r"/run/", status=500, code="InternalError"), \
            pytest.raises(CheckpointError, match=f"s3://{bucket}/run.*InternalError|s3://{bucket}/run.*INTERNAL"):
        save_to(f"s3://{bucket}/run")
    assert time.monotonic() - started < 60


def test_an_unreachable_store_is_named_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: connections are refused
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"s3://b/run: cannot reach the object store \(endpoint "
                                              rf"http://127.0.0.1:{port}\)"):
        CheckpointReader("s3://b/run")
    assert time.monotonic() - started < 30
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        options = StoreOptions(connect_timeout_s=1, request_timeout_s=1, max_attempts=2)
        storage, path = open_location("s3://b/run", options=options)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="s3://b/run: cannot reach the object store"):
            CheckpointReader(path, storage=storage)
        assert time.monotonic() - started < 20


def test_wrong_credentials_are_named_as_such(s3: S3Server, bucket: str) -> None:
    saved = save_to(f"s3://{bucket}/run")
    with s3.authenticating(), pytest.raises(CheckpointError) as caught:
        CheckpointReader(saved.path)
    message = str(caught.value)
    assert "refused the credentials" in message and "AWS_ACCESS_KEY_ID" in message and saved.path in message
    assert SECRET_KEY not in message


# -- the offline tools --------------------------------------------------------------------------------------
def test_the_checkpoint_commands_work_on_urls(s3: S3Server, bucket: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    saved = save_to(f"s3://{bucket}/run")
    assert main(["checkpoint", "inspect", f"s3://{bucket}/run", "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["checkpoint", "reshard", saved.path, f"s3://{bucket}/resharded", "--world-size", "3"]) == 0
    capsys.readouterr()
    assert CheckpointReader(f"s3://{bucket}/resharded").manifest.world_size == 3
    assert main(["checkpoint", "consolidate", f"s3://{bucket}/resharded", f"s3://{bucket}/full.safetensors"]) == 0
    assert main(["checkpoint", "consolidate", saved.path, str(tmp_path / "full.safetensors")]) == 0
    assert s3.get(bucket, "full.safetensors") == (tmp_path / "full.safetensors").read_bytes()
    assert consolidate(saved.path, f"s3://{bucket}/again.safetensors") == f"s3://{bucket}/again.safetensors"
    assert main(["checkpoint", "inspect", f"s3://{bucket}/nothing"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_an_export_to_s3_opens_with_from_pretrained_after_download(s3: S3Server, bucket: str,
                                                                   tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import pyarrow.fs as pafs

    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                                 n_layer=2, n_head=2)).eval()
    storage, root = open_location(f"s3://{bucket}/hf")
    saved = save(model, root, world_size=2, storage=storage, bucket_numel=5000, chunk_bytes=4096)
    assert main(["checkpoint", "export", saved.path, f"s3://{bucket}/exported", "--max-shard-size", "100KB"]) == 0
    assert "model.safetensors.index.json" in [k.rsplit("/", 1)[-1] for k in s3.keys(bucket, "exported/")]
    fs = storage.fs  # type: ignore[attr-defined]
    local = tmp_path / "exported"
    local.mkdir()
    pafs.copy_files(f"{bucket}/exported", str(local), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())
    model.config.save_pretrained(local)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(local).eval()
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_the_main_job_resumes_from_an_s3_url(bucket: str) -> None:
    from zero_ray.demo import _has_checkpoint

    url = f"s3://{bucket}/train-gpt"  # what deploy/kuberay/rayjob-s3.yaml passes as --checkpoint-dir
    assert not _has_checkpoint(url)
    save_to(url)
    assert _has_checkpoint(url)
