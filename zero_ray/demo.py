"""The main job: a small GPT trained on the Python standard library's own source files.

Every machine with Python has that corpus, so the job needs no downloads. Bytes are tokens
(vocabulary 256). The job writes the corpus once as nanoGPT-style token files (``train.bin``,
and the last ``--eval-fraction`` of it as ``val.bin``, uint16) to ``--data`` (a directory or a
URL such as ``s3://bucket/corpus``; by default beside the checkpoints, else a local temporary
directory), never over an existing file: files an earlier run wrote are reused, any other file
there stops the job with a DataError naming it. It trains from them through
``zero_ray.data.TokenFiles``: every actor reads its own samples from there, the driver only the
files' sizes. Used by ``zero-ray train`` and ``examples/train_gpt.py``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import logging
import os
import secrets
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from zero_ray.checkpoint.storage import LocalStorage, Storage, fsync_dir
from zero_ray.errors import ConfigError, DataError

log = logging.getLogger(__name__)


def stdlib_corpus(max_bytes: int = 4 * 2**20) -> torch.Tensor:
    """Up to ``max_bytes`` of the standard library's ``*.py`` files, in sorted path order, as a
    uint8 tensor (deterministic for a given Python installation)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise ConfigError(f"no Python sources found under {root!r} to train on")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class CorpusWindows:
    """A map-style dataset of consecutive ``block_size + 1``-token windows of ``corpus`` (each
    starts where the previous one's inputs end), ``first`` up to ``last``."""

    def __init__(self, corpus: torch.Tensor, block_size: int, first: int = 0, last: int | None = None) -> None:
        total = (corpus.numel() - 1) // block_size
        self.corpus, self.block_size = corpus, block_size
        self.first, self.last = first, total if last is None else last
        if not 0 <= self.first < self.last <= total:
            raise ConfigError(f"windows [{first}, {last}) are outside the corpus's {total} windows of {block_size}")

    def __len__(self) -> int:
        return self.last - self.first

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = (self.first + i) * self.block_size
        return self.corpus[start:start + self.block_size + 1].long()

    def split(self, eval_fraction: float) -> tuple[CorpusWindows, CorpusWindows]:
        """The first windows for training, the last ``eval_fraction`` held out."""
        held = max(1, int(len(self) * eval_fraction))
        cut = self.last - held
        return (CorpusWindows(self.corpus, self.block_size, self.first, cut),
                CorpusWindows(self.corpus, self.block_size, cut, self.last))


def token_parts(corpus: torch.Tensor, *, eval_fraction: float, block_size: int) -> dict[str, bytes]:
    """The bytes of ``train.bin`` and ``val.bin`` (the last ``eval_fraction`` of ``corpus``),
    as uint16 tokens."""
    import numpy as np

    tokens = corpus.numpy().astype("<u2")
    held = max(block_size + 2, int(len(tokens) * eval_fraction))
    if held >= len(tokens) - block_size - 1:
        raise ConfigError(f"--eval-fraction={eval_fraction} leaves too little of the {len(tokens)}-token corpus to "
                          f"train on with --block-size={block_size}")
    return {"train.bin": np.ascontiguousarray(tokens[:-held]).tobytes(),
            "val.bin": np.ascontiguousarray(tokens[-held:]).tobytes()}


def write_token_files(data: str, corpus: torch.Tensor, *, eval_fraction: float, block_size: int,
                      say: Callable[[str], None] = log.info) -> tuple[str, str]:
    """``corpus`` (bytes) as uint16 token files ``train.bin`` and ``val.bin`` (its last
    ``eval_fraction``) under ``data`` (a directory or a URL). Returns their locations.

    A file there is never overwritten: one that already holds exactly these bytes (an earlier
    run's) is reused, and ``say`` is told so; any other (another size, or the same size with
    other contents) is a DataError naming it, raised before anything is written. A missing
    file is written whole or not at all (locally a temp file linked into place, which fails if
    the name was taken meanwhile; on an object store one upload), so a killed run leaves no
    half file for the next run to trust."""
    from zero_ray.checkpoint.location import open_location

    storage, root = open_location(data)
    parts = token_parts(corpus, eval_fraction=eval_fraction, block_size=block_size)
    paths = {name: storage.join(root, name) for name in parts}
    # Every existing file is checked before anything is written: a refusal leaves `data` as it was.
    missing = [name for name in parts if not _holds(storage, paths[name], parts[name])]
    if missing:
        storage.makedirs(root)
    for name in parts:
        where = storage.locate(paths[name])
        if name in missing and _write_new(storage, paths[name], parts[name]):
            say(f"wrote {where} ({len(parts[name]):,} bytes)")
        else:
            say(f"reusing {where}: it already holds this corpus ({len(parts[name]):,} bytes, compared byte for byte)")
    return storage.locate(paths["train.bin"]), storage.locate(paths["val.bin"])


_FIX = "pass another --data directory, or remove it if it is one an earlier run of this job wrote with other settings"


def _holds(storage: Storage, path: str, expected: bytes) -> bool:
    """False when ``path`` does not exist; True when it holds exactly ``expected``; otherwise a
    DataError naming it (the job would overwrite, or train on, a file that is not its own)."""
    if not storage.exists(path):
        return False
    where = storage.locate(path)
    if storage.is_dir(path):
        raise DataError(f"{where} is a directory where the main job would write its token file; {_FIX}")
    size = storage.size(path)
    if size != len(expected):
        raise DataError(f"{where} already exists with {size:,} bytes; the main job's token file there would have "
                        f"{len(expected):,} bytes, and the job never overwrites a file: {_FIX}")
    chunk, offset = 1 << 20, 0
    with storage.open_input(path) as fh:
        while offset < size:
            got = fh.read(min(chunk, size - offset))
            if not got:
                raise DataError(f"{where} ended at byte {offset:,} of the {size:,} its size says; {_FIX}")
            if got != expected[offset:offset + len(got)]:
                raise DataError(f"{where} has the size of the main job's token file ({size:,} bytes) but other "
                                f"contents (they differ within bytes {offset:,}-{offset + len(got):,}); the job "
                                f"trains only on the corpus it writes and never overwrites a file: {_FIX}")
            offset += len(got)
    return True


def _write_new(storage: Storage, path: str, data: bytes) -> bool:
    """``path`` created whole, never replacing a file: locally a temp file hard-linked into place
    (the link fails if the name exists), on an object store one upload (visible only once
    complete). A name taken meanwhile is checked as an existing file (False: it is reused)."""
    if not isinstance(storage, LocalStorage):
        storage.write_atomic(path, data)
        return True
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return not _holds(storage, path, data)  # another run wrote it first: reused if it is this corpus
        except OSError:  # a filesystem without hard links: rename, only if the name is still free
            if _holds(storage, path, data):
                return False
            os.rename(tmp, path)
            tmp = ""
    finally:
        if tmp:
            os.unlink(tmp)
    fsync_dir(directory)
    return True


def default_data(args: argparse.Namespace, parts: dict[str, bytes]) -> str:
    """Where the corpus goes without ``--data``: beside the checkpoints (every actor reaches
    them), else a local temporary directory (a single-machine cluster) named by a digest of
    ``parts`` (the files to write), so another Python's corpus or other settings never meet an
    earlier run's files there."""
    if args.checkpoint_dir:
        return args.checkpoint_dir.rstrip("/") + "/corpus"
    digest = hashlib.sha256()
    for name, payload in sorted(parts.items()):
        digest.update(f"{name}:{len(payload)}:".encode())
        digest.update(payload)
    return os.path.join(tempfile.gettempdir(), f"zero_ray-stdlib-{args.corpus_bytes}-{digest.hexdigest()[:12]}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The main job's options (defaults: stage 2, 2 actors, CPU unless the cluster has GPUs)."""
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reduce-dtype", default=None,
                        help="dtype gradients are reduced in (default: --dtype), e.g. float32 under bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--data", default=None,
                        help="where the corpus is written as token files and read from: a directory every actor "
                             "can read, or a URL such as s3://bucket/corpus (default: <checkpoint-dir>/corpus, else "
                             "a local temporary directory)")
    parser.add_argument("--address", default=None, help="Ray address; default: a running cluster, else a local one")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint root: a directory (a mounted volume) or a URL such as s3://bucket/run "
                             "(credentials and endpoint from the standard AWS_* environment); the job resumes from "
                             "its latest checkpoint when there is one and saves every --checkpoint-every steps and "
                             "at the end")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--eval-fraction", type=float, default=0.05, help="share of the corpus held out for validation")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="steps between validation losses (default: a quarter of --steps; always at the end)")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even if --checkpoint-dir has one")


def memory_table(reports: Sequence[dict[str, int]], *, stage: int, dtype: str) -> str:
    """Per-actor model-state bytes (measured) beside the paper's formula for the stage."""
    from zero_ray.core.memory_formulas import model_state_bytes, optimizer_bytes_per_param

    mixed = dtype not in ("float32", "fp32")
    element = 2 if mixed else 4
    k = optimizer_bytes_per_param("adamw", mixed_precision=mixed)
    n = len(reports)
    formula = model_state_bytes(stage=stage, num_params=reports[0]["padded_numel"], world_size=n, param_bytes=element,
                                grad_bytes=element, optimizer_bytes=k).total

    def mib(v: int) -> str:
        return f"{v / 2**20:9.3f}"

    lines = [f"Model-state memory per actor (MiB; measured from the tensors held; {dtype}, AdamW K={k})",
             "rank     params      grads  optimizer    padding      total    formula",
             "----  ---------  ---------  ---------  ---------  ---------  ---------"]
    for r in reports:
        lines.append(f"{r['rank']:>4}  {mib(r['params'])}  {mib(r['grads'])}  {mib(r['optimizer'])}  "
                     f"{mib(r['padding'])}  {mib(r['total'])}  {mib(formula)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Train the GPT with ``fit`` and print progress, the losses and the memory table."""
    import ray

    import zero_ray as zr
    from zero_ray.models import GPT, GPTConfig, lm_loss_sum

    if not 0 < args.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction={args.eval_fraction} must be between 0 and 1")
    gpt = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    corpus = stdlib_corpus(args.corpus_bytes)
    data = args.data or default_data(args, token_parts(corpus, eval_fraction=args.eval_fraction,
                                                       block_size=args.block_size))
    # Before Ray starts: a file under --data that is not the job's own stops it at once.
    train_url, val_url = write_token_files(data, corpus, eval_fraction=args.eval_fraction, block_size=args.block_size,
                                           say=print)
    if not ray.is_initialized():
        ray.init(address=args.address, log_to_driver=False) if args.address else ray.init(log_to_driver=False)
    train = zr.data.TokenFiles(train_url, seq_len=args.block_size)
    held_out = zr.data.TokenFiles(val_url, seq_len=args.block_size)
    windows = {"train": sum(train.scan().block_sizes), "val": sum(held_out.scan().block_sizes)}  # file sizes only
    config = zr.ZeroConfig(stage=args.stage, world_size=args.world_size, dtype=args.dtype, device=args.device,
                           grad_accum_steps=args.grad_accum_steps, max_grad_norm=args.max_grad_norm, seed=args.seed,
                           reduce_dtype=args.reduce_dtype, checkpoint=zr.CheckpointConfig(dir=args.checkpoint_dir))
    model_fn, optimizer = functools.partial(GPT, gpt), zr.AdamW(lr=args.lr, weight_decay=0.1)
    schedule = zr.WarmupCosine(warmup_steps=max(1, args.steps // 20), total_steps=args.steps, min_ratio=0.1)
    if args.checkpoint_dir and not args.no_resume and _has_checkpoint(args.checkpoint_dir):
        trainer = zr.ZeroTrainer.from_checkpoint(args.checkpoint_dir, model_fn, lm_loss_sum, optimizer=optimizer,
                                                 lr_scheduler=schedule, config=config)
        print(f"resumed from {args.checkpoint_dir} at step {trainer.step_count}")
    else:
        trainer = zr.ZeroTrainer(model_fn, lm_loss_sum, optimizer=optimizer, lr_scheduler=schedule, config=config)
    print(f"zero_ray: stage {args.stage}, {trainer.world_size} actors on {trainer.device}, "
          f"{trainer.num_params / 1e6:.2f}M parameters, global batch {args.batch_size} x {args.block_size} tokens; "
          f"{windows['train']} training windows, {windows['val']} held out, as token files in {data}")
    try:
        done = trainer.step_count
        start = time.perf_counter()
        result = trainer.fit(train, global_batch_size=args.batch_size, steps=args.steps, seed=args.seed,
                             eval_dataset=held_out, eval_every=args.eval_every or max(1, args.steps // 4),
                             checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None,
                             progress=not args.no_progress)
        elapsed = time.perf_counter() - start
        ran = result["steps_run"]
        if ran:
            print(f"trained {ran} steps (to step {result['step']}, epoch {result['epoch']}) in {elapsed:.1f}s: "
                  f"loss {result['loss']:.4f}, {result['items_per_second']:,.0f} tokens/s")
        if "eval_loss" in result:
            print(f"validation loss {result['eval_loss']:.4f} over {windows['val']} held-out windows")
        if args.checkpoint_dir and ran:
            # fit saved the last step already when it fell on --checkpoint-every: wait for that
            # one to commit rather than write the same step again beside it (step-N-1).
            saved_last = args.checkpoint_every and result["step"] % args.checkpoint_every == 0
            path = (trainer.wait_for_checkpoint() if saved_last else None) or \
                trainer.save_checkpoint(args.checkpoint_dir, wait=True)
            print(f"checkpoint: {path}")
        elif done == trainer.step_count and args.checkpoint_dir:
            print("nothing to train: the checkpoint is already at --steps")
        print(memory_table(trainer.memory_report(), stage=args.stage, dtype=args.dtype))
    finally:
        trainer.shutdown()
    return 0


def _has_checkpoint(root: str) -> bool:
    """Whether ``root`` (a directory or a URL such as s3://bucket/run) has a committed checkpoint."""
    from zero_ray.checkpoint.format import LATEST_NAME
    from zero_ray.checkpoint.location import open_location

    storage, path = open_location(root)
    return storage.exists(storage.join(path, LATEST_NAME))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
