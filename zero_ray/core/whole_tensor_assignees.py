"""Which owner updates each whole-tensor parameter, and where its pieces are.

A whole-tensor optimizer (Muon's Newton-Schulz, Adafactor's factored moments) needs a
parameter's whole gradient and values. Under a partition each owner holds a contiguous range of
every bucket, so such a parameter is spread over the owners of its bucket's ranges. Each one is
updated on exactly one owner, its *assignee*: the pieces' gradients and values go there, the
optimizer runs there with its state kept there alone, and the new values go back to the pieces'
owners. Assignments balance the elements each owner updates (largest parameter first, to the
least loaded owner; ties to the owner already holding most of it, then the lowest rank), so an
owner's whole-tensor state is at most its share plus the largest parameter's.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zero_ray.core.flat_layout import FlatLayout


@dataclass(frozen=True, kw_only=True)
class WholePiece:
    """Elements ``[param_start, param_end)`` of a flattened parameter, held by ``rank`` at
    ``[local_start, local_end)`` of its update slice of the parameter's bucket."""

    rank: int
    param_start: int
    param_end: int
    local_start: int
    local_end: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True, kw_only=True)
class WholeTensorPlan:
    """Every whole-tensor parameter's assignee and pieces (by layout parameter index)."""

    assignee: dict[int, int]
    pieces: dict[int, tuple[WholePiece, ...]]

    def assigned_to(self, rank: int) -> list[int]:
        return sorted(p for p, r in self.assignee.items() if r == rank)


def whole_pieces(layout: FlatLayout, param: int) -> tuple[WholePiece, ...]:
    """Where ``param`` lies across the ranks' shards of its bucket, in rank order."""
    spec = layout.params[param]
    bucket = layout.buckets[spec.bucket]
    out = []
    for r in range(layout.world_size):
        start, end = bucket.shard_range(r)
        lo, hi = max(start, spec.offset), min(end, spec.end)
        if lo < hi:
            out.append(WholePiece(rank=r, param_start=lo - spec.offset, param_end=hi - spec.offset,
                                  local_start=lo - start, local_end=hi - start))
    return tuple(out)


def plan_whole_tensors(layout: FlatLayout, params: Sequence[int]) -> WholeTensorPlan:
    """Assign each of ``params`` (layout indices) to one of ``layout.world_size`` ranks."""
    pieces = {p: whole_pieces(layout, p) for p in params}
    load = [0] * layout.world_size
    assignee: dict[int, int] = {}
    for p in sorted(params, key=lambda i: (-layout.params[i].numel, i)):
        held = {piece.rank: piece.numel for piece in pieces[p]}
        r = min(range(layout.world_size), key=lambda k: (load[k], -held.get(k, 0), k))
        assignee[p] = r
        load[r] += layout.params[p].numel
    return WholeTensorPlan(assignee=assignee, pieces=pieces)
