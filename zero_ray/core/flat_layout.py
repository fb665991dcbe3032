"""FlatLayout: where every parameter lives in the flat buffers and which slice each rank owns.

Parameters are grouped into buckets (stages 0-2: by size, in reverse registration order so a
bucket's gradients are ready together during backward; stage 3: one bucket per unit). Each
bucket is one contiguous flat buffer padded to a multiple of the world size, and rank ``r`` owns
the contiguous slice ``[r * S, (r + 1) * S)`` of every bucket, ``S = padded_numel / world_size``.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from zero_ray.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One parameter: its name as in ``named_parameters()``, shape, dtype and position."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int  # first element within its bucket's flat buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One flat buffer: the parameters it holds (layout indices) and its padded size."""

    index: int
    params: tuple[int, ...]
    numel: int
    padded_numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of this bucket that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"{rank=} is outside 0..{self.world_size - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def real_in_range(self, start: int, end: int) -> int:
        """How many non-padding elements lie in ``[start, end)``."""
        return max(0, min(end, self.numel) - start)


@dataclass(frozen=True, kw_only=True)
class Fragment:
    """The part of one parameter that falls into a slice of its bucket.

    ``param_start/param_end`` index the flattened parameter; ``local_start/local_end`` index the
    slice (for instance a rank's shard of the bucket).
    """

    param: int
    param_start: int
    param_end: int
    local_start: int
    local_end: int


@dataclass(frozen=True, kw_only=True)
class FlatLayout:
    """Parameters, buckets and shard boundaries for one world size."""

    params: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    _by_name: dict[str, ParamSpec] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in self.params})
        if len(self._by_name) != len(self.params):
            raise ConfigError("parameter names in a FlatLayout must be unique")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        specs: Sequence[tuple[str, tuple[int, ...], str]],
        *,
        world_size: int,
        groups: Sequence[Sequence[int]],
    ) -> FlatLayout:
        """Lay out ``specs`` (name, shape, dtype in registration order) into ``groups`` of
        parameter indices, one bucket per group, each padded to a multiple of ``world_size``."""
        if world_size < 1:
            raise ConfigError(f"{world_size=} must be at least 1")
        seen = sorted(i for g in groups for i in g)
        if seen != list(range(len(specs))):
            raise ConfigError("bucket groups must cover every parameter exactly once")
        placed: dict[int, ParamSpec] = {}
        buckets: list[Bucket] = []
        for b, group in enumerate(groups):
            offset = 0
            for i in group:
                name, shape, dtype = specs[i]
                placed[i] = ParamSpec(index=i, name=name, shape=tuple(shape), dtype=dtype, bucket=b, offset=offset)
                offset += placed[i].numel
            padded = max(world_size, -(-offset // world_size) * world_size)
            buckets.append(Bucket(index=b, params=tuple(group), numel=offset, padded_numel=padded, world_size=world_size))
        return cls(params=tuple(placed[i] for i in range(len(specs))), buckets=tuple(buckets), world_size=world_size)

    @classmethod
    def by_size(
        cls,
        specs: Sequence[tuple[str, tuple[int, ...], str]],
        *,
        world_size: int,
        bucket_numel: int,
    ) -> FlatLayout:
        """Buckets of about ``bucket_numel`` elements in reverse registration order (the order
        backward usually produces gradients in); a parameter is never split across buckets."""
        if bucket_numel < 1:
            raise ConfigError(f"{bucket_numel=} must be at least 1")
        groups: list[list[int]] = []
        current: list[int] = []
        size = 0
        for i in reversed(range(len(specs))):
            numel = math.prod(specs[i][1])
            if current and size + numel > bucket_numel:
                groups.append(current)
                current, size = [], 0
            current.append(i)
            size += numel
        if current:
            groups.append(current)
        return cls.build(specs, world_size=world_size, groups=groups)

    def describe(self) -> dict[str, list]:
        """The parameters and bucket groups as plain data (``from_description`` rebuilds it at
        any world size: buckets do not depend on it, only their padding does)."""
        return {"specs": [[p.name, list(p.shape), p.dtype] for p in self.params],
                "groups": [list(b.params) for b in self.buckets]}

    @classmethod
    def from_description(cls, data: dict[str, list], *, world_size: int) -> FlatLayout:
        return cls.build([(name, tuple(shape), dtype) for name, shape, dtype in data["specs"]],
                         world_size=world_size, groups=data["groups"])

    # -- queries ------------------------------------------------------------------------------
    def param(self, name: str) -> ParamSpec:
        try:
            return self._by_name[name]
        except KeyError as err:
            raise ConfigError(f"no parameter named {name!r} in the layout") from err

    @property
    def numel(self) -> int:
        """Real (unpadded) elements over all parameters: Ψ."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns over all buckets (padding included)."""
        return self.padded_numel // self.world_size

    def fragments(self, bucket: int, start: int, end: int) -> Iterator[Fragment]:
        """The parameter pieces inside ``[start, end)`` of ``bucket``, in bucket order."""
        for i in self.buckets[bucket].params:
            p = self.params[i]
            lo, hi = max(p.offset, start), min(p.end, end)
            if lo < hi:
                yield Fragment(param=i, param_start=lo - p.offset, param_end=hi - p.offset,
                               local_start=lo - start, local_end=hi - start)

    def shard_fragments(self, bucket: int, rank: int) -> list[Fragment]:
        """The pieces of parameters that ``rank`` owns in ``bucket``."""
        start, end = self.buckets[bucket].shard_range(rank)
        return list(self.fragments(bucket, start, end))

    def real_shard_numel(self, rank: int) -> int:
        """Non-padding elements ``rank`` owns over all buckets."""
        return sum(b.real_in_range(*b.shard_range(rank)) for b in self.buckets)
