"""What planning a cross-TP-size checkpoint read costs one owner (issue 45 item 6).

    python -m benchmarks.tp_checkpoint_plan [--rows 8192] [--cols 8192] [--saved 8x16]

A rowwise weight (``rows`` x ``cols``, sharded by columns) saved at (T, D) = ``--saved``: each TP
rank's slice cut into D flat ranges, as ZeRO partitions it. For one owner of each loading layout
(the same (T, D), half the TP size, T = 1), ``Manifest.pieces`` plans the read of its first range:
pieces and wall time (median of 5). Nothing is read; the manifest is built in memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

from zero_ray.checkpoint.format import MASTER, Entry, Manifest, ParamRecord, ShardFile
from zero_ray.core.reshard_plan import Block


def slices(rows: int, cols: int, size: int, data: int) -> list[tuple[Block, int, int]]:
    """Every owner's (TP slice, flat range) of the weight at (size, data), by world rank."""
    out = []
    for t in range(size):
        part = cols // size
        block = Block(full=(rows, cols), offsets=(0, t * part), extent=(rows, part))
        shard = -(-block.numel // data)
        out += [(block, d * shard, min(block.numel, (d + 1) * shard)) for d in range(data)]
    return out


def manifest(rows: int, cols: int, size: int, data: int) -> Manifest:
    files = tuple(ShardFile(rank=r, name=f"rank-{r}", size=0, sha256="", chunk_bytes=1, chunk_sha256=(),
                            entries=(Entry(key="w", kind=MASTER, name="w", start=lo, end=hi, offset=0, dtype="F32",
                                           shape=(hi - lo,), offsets=b.offsets, extent=b.extent),))
                  for r, (b, lo, hi) in enumerate(slices(rows, cols, size, data)))
    return Manifest(format_version=5, step=0, samples_seen=0, world_size=size * data, stage=2,
                    compute_dtype="float32", seed=0, optimizers=(), hyper={}, param_state={}, loss_scaler={},
                    params=(ParamRecord(name="w", aliases=("w",), shape=(rows, cols), dtype="float32", bucket=0,
                                        offset=0),), buckets=(), files=files, tensor_parallel=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--saved", default="8x16", help="the saving (T, D) as TxD")
    args = parser.parse_args()
    size, data = map(int, args.saved.split("x"))
    m = manifest(args.rows, args.cols, size, data)
    world = size * data
    for t in (size, max(1, size // 2), 1):
        d = world // t
        block, lo, hi = slices(args.rows, args.cols, t, d)[0]
        times = []
        for _ in range(5):
            start = time.perf_counter()
            pieces = m.pieces(MASTER, "w", lo, hi, block if t > 1 else None)
            times.append(time.perf_counter() - start)
        print(f"{args.rows}x{args.cols} rowwise saved at (T, D)=({size}, {data}), read by an owner of ({t}, {d}): "
              f"{len(pieces)} pieces planned in {statistics.median(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
