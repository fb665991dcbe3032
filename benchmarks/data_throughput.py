"""How fast an owner is served its samples from token files, beside what the main job's step eats.

    python -m benchmarks.data_throughput [--corpus-mb 256] [--s3-mb 64] [--steps 200] [--no-fit] [--json OUT]

Writes a corpus of random uint16 tokens under /var/tmp (and a copy to a local S3 server, moto,
when it is installed) and reads it as ``zero_ray.data.TokenFiles`` with the main job's shape
(seq_len 128, global batch 32, two owners; this is rank 0's half of each batch):

- cold: a new reader (the page cache dropped first where this process may: root on Linux),
  serving ``--steps`` consecutive steps back to back, its prefetch on;
- warm: the same steps again, every block already in the reader's cache.

Beside them, the tokens/s one owner's step consumes: the main job's GPT (vocab 256, 4 x 128)
forward, backward and AdamW on 16 x 128 tokens in this process on one thread (an owner's CPU),
without communication, so an upper bound on what a step eats. Unless ``--no-fit``, the main job
then runs ``fit`` for ``--fit-steps`` steps on two owners of a local Ray over the local files and
reports each step's ``data_wait_seconds``. Writes ``benchmarks/results/data_throughput.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SEQ, BATCH, OWNERS = 128, 32, 2


def drop_page_cache() -> bool:
    """Ask Linux to drop clean page-cache pages (root only); whether it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def serve(url: str, steps: int, **source: Any) -> dict[str, Any]:
    """Rank 0's pieces of ``steps`` global batches, cold then warm: tokens/s and read counts."""
    import zero_ray as zr
    from zero_ray.core.batching import split_sizes
    from zero_ray.core.data_order import BlockOrder
    from zero_ray.data import opener

    layout = zr.data.TokenFiles(url, seq_len=SEQ, **source).scan()
    order = BlockOrder(block_sizes=layout.block_sizes, global_batch_size=BATCH, seed=0, window=layout.window)
    mine = split_sizes(BATCH, OWNERS)[0]
    pieces = [order.indices(k)[:mine] for k in range(steps)]
    touched = {order.block_of(i) for k in range(steps) for i in order.indices(k)}
    big = max(layout.block_bytes(b) for b in touched) * (len(touched) + 1)  # warm: every block stays cached
    out: dict[str, Any] = {"blocks": len(touched), "block_bytes": layout.block_bytes(0),
                           "cache_bytes_cold": layout.cache_bytes}
    for phase in ("cold", "warm"):
        if phase == "cold":
            out["page_cache_dropped"] = drop_page_cache()
            reader = opener(layout, order)()
        else:
            reader = opener(type(layout)(**{**layout.__dict__, "cache_bytes": big}), order)()
            for k, piece in enumerate(pieces):  # fill the cache
                reader.read(piece, step=k)
            reader.drain(timeout_s=600)
        reads = reader.blocks_read
        start = time.perf_counter()
        for k, piece in enumerate(pieces):
            reader.read(piece, step=k)
        seconds = time.perf_counter() - start
        out[phase] = {"tokens_per_second": steps * mine * SEQ / seconds, "seconds": seconds,
                      "block_reads": reader.blocks_read - reads}
        reader.close()
    return out


def step_consumption(repeats: int = 5) -> float:
    """Tokens/s one owner's step of the main job's GPT eats (16 x 128 tokens, one thread)."""
    import torch

    from zero_ray.models import GPT, GPTConfig, lm_loss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=128))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 256, (BATCH // OWNERS, SEQ + 1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        lm_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return BATCH // OWNERS * SEQ / statistics.median(times[1:])


def fit_waits(url: str, steps: int) -> list[float]:
    """``data_wait_seconds`` of each step of the main job's fit over ``url`` on two owners."""
    import ray

    import zero_ray as zr
    from zero_ray.models import GPT, GPTConfig, lm_loss_sum

    gpt = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=4, n_head=4, n_embd=128)
    waits: list[float] = []
    ray.init(address="local", num_cpus=OWNERS + 1, include_dashboard=False, log_to_driver=False)
    try:
        with zr.ZeroTrainer(lambda: GPT(gpt), lm_loss_sum, optimizer=zr.AdamW(lr=3e-3),
                            config=zr.ZeroConfig(stage=2, world_size=OWNERS, device="cpu")) as trainer:
            trainer.fit(zr.data.TokenFiles(url, seq_len=SEQ), global_batch_size=BATCH, steps=steps, progress=False,
                        callback=lambda m: waits.append(m["data_wait_seconds"]))
    finally:
        ray.shutdown()
    return waits


def s3_copy(path: Path, megabytes: int) -> tuple[Any, str] | None:
    """A local S3 server (moto) holding the first ``megabytes`` of ``path``; None without moto."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1"}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket="corpus")
    with open(path, "rb") as fh:
        client.put_object(Bucket="corpus", Key="train.bin", Body=fh.read(megabytes << 20))
    return server, "s3://corpus/train.bin"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.data_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--corpus-mb", type=int, default=256)
    p.add_argument("--s3-mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fit-steps", type=int, default=20)
    p.add_argument("--no-fit", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import numpy as np

    workdir = Path(tempfile.mkdtemp(prefix="zero_ray-data-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    corpus = workdir / "train.bin"
    rng = np.random.default_rng(0)
    with open(corpus, "wb") as fh:
        for _ in range(args.corpus_mb):
            rng.integers(0, 256, size=1 << 19, dtype=np.uint16).astype("<u2").tofile(fh)
    load = os.getloadavg()[0]
    consumed = step_consumption()
    rows = [{"store": f"local disk ({args.corpus_mb} MiB)", **serve(str(corpus), args.steps)}]
    s3 = s3_copy(corpus, args.s3_mb)
    if s3 is not None:
        server, url = s3
        try:
            rows.append({"store": f"local S3 server, moto ({args.s3_mb} MiB)", **serve(url, args.steps)})
        finally:
            server.stop()
    waits = [] if args.no_fit else fit_waits(str(corpus), args.fit_steps)
    corpus.unlink()
    workdir.rmdir()
    lines = [f"TokenFiles, seq_len {SEQ}, global batch {BATCH} over {OWNERS} owners (rank 0's half), {args.steps} "
             f"steps, default blocks (256 Ki tokens) and window (16); load average {load:.2f} at start on "
             f"{os.cpu_count()} cores", "",
             "| store | cache | tokens/s served to one owner | block reads | x the step's consumption |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        for phase in ("cold", "warm"):
            tps = r[phase]["tokens_per_second"]
            label = phase + (" (page cache dropped)" if phase == "cold" and r["page_cache_dropped"] else "")
            lines.append(f"| {r['store']} | {label} | {tps:,.0f} | {r[phase]['block_reads']} | {tps / consumed:,.0f}x |")
    lines.append(f"| the main job's step (one owner, one thread, no communication) | | {consumed:,.0f} | | 1x |")
    if waits:
        lines += ["", f"fit, {len(waits)} steps of the main job on {OWNERS} owners over the local files: "
                      f"data_wait_seconds {waits[0] * 1e3:.1f} ms at the first step, at most "
                      f"{max(waits[1:]) * 1e3:.2f} ms (median {statistics.median(waits[1:]) * 1e3:.2f} ms) after it"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.json) if args.json else RESULTS / "data_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "step_tokens_per_second": consumed, "fit_data_wait_seconds": waits,
                               "args": vars(args), "load_start": load}, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
