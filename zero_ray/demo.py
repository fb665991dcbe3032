"""The main job: a small GPT trained on the Python standard library's own source files.

Every machine with Python has that corpus, so the job needs no downloads. Bytes are tokens
(vocabulary 256). The job writes the corpus once as nanoGPT-style token files (``train.bin``,
and the last ``--eval-fraction`` of it as ``val.bin``, uint16) to ``--data`` (a directory or a
URL such as ``s3://bucket/corpus``; by default beside the checkpoints, else a local temporary
directory) and trains from them through ``zero_ray.data.TokenFiles``: every actor reads its own
samples from there, the driver only the files' sizes. Used by ``zero-ray train`` and
``examples/train_gpt.py``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import logging
import os
import sysconfig
import tempfile
import time
from collections.abc import Sequence

import torch

from zero_ray.errors import ConfigError

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


def write_token_files(data: str, corpus: torch.Tensor, *, eval_fraction: float, block_size: int) -> tuple[str, str]:
    """``corpus`` (bytes) as uint16 token files ``train.bin`` and ``val.bin`` (its last
    ``eval_fraction``) under ``data``, written once: files already there with the right sizes
    are kept. Returns their locations."""
    import numpy as np

    from zero_ray.checkpoint.location import open_location

    storage, root = open_location(data)
    tokens = corpus.numpy().astype("<u2")
    held = max(block_size + 2, int(len(tokens) * eval_fraction))
    if held >= len(tokens) - block_size - 1:
        raise ConfigError(f"--eval-fraction={eval_fraction} leaves too little of the {len(tokens)}-token corpus to "
                          f"train on with --block-size={block_size}")
    storage.makedirs(root)
    out = []
    for name, part in (("train.bin", tokens[:-held]), ("val.bin", tokens[-held:])):
        path = storage.join(root, name)
        if not storage.exists(path) or storage.size(path) != part.nbytes:
            storage.write_atomic(path, np.ascontiguousarray(part).tobytes())
        out.append(storage.locate(path))
    return out[0], out[1]


def default_data(args: argparse.Namespace) -> str:
    """Where the corpus goes without ``--data``: beside the checkpoints (every actor reaches
    them), else a local temporary directory (a single-machine cluster)."""
    if args.checkpoint_dir:
        return args.checkpoint_dir.rstrip("/") + "/corpus"
    return os.path.join(tempfile.gettempdir(), f"zero_ray-stdlib-{args.corpus_bytes}")


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
    from zero_ray.core.memory import model_state_bytes, optimizer_bytes_per_param

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

    if not ray.is_initialized():
        ray.init(address=args.address, log_to_driver=False) if args.address else ray.init(log_to_driver=False)
    if not 0 < args.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction={args.eval_fraction} must be between 0 and 1")
    gpt = GPTConfig(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    data = args.data or default_data(args)
    train_url, val_url = write_token_files(data, stdlib_corpus(args.corpus_bytes), eval_fraction=args.eval_fraction,
                                           block_size=args.block_size)
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
            print(f"checkpoint: {trainer.save_checkpoint(args.checkpoint_dir, wait=True)}")
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
