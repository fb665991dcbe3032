"""Per-parameter optimizer state, described as data: what moves with a partition.

``torch.optim`` keeps state per parameter tensor. Under a partition, an owner's element-wise
optimizer holds one state dict per fragment it owns, whose tensors are views of flat per-name
buffers (``ParamGroup.moments``: these move by element range like the master weights), plus a
few *scalars* per parameter (Adam's ``step``, NAdam's ``mu_product``, ASGD's ``eta``...), equal on
every fragment of a parameter. A whole-tensor optimizer's state (Muon's momentum, Adafactor's
row and column variances) lives whole on one owner.

A ``StateTable`` says, for every parameter that has optimizer state, its scalars and the names
(and, whole, the shapes) of its state tensors. Parameters without an entry have no state yet
(never stepped): torch creates theirs at their first step, and a restore must leave them so.
A rank knows the entries of what it updates; merged over ranks (``merge_tables``) a table is
what a restore at another layout needs beside the tensors. Entries are JSON data, so a table
goes into a checkpoint's manifest by parameter name.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zero_ray.core.flat_layout import FlatLayout

#: entry keys: "scalars" {name: encoded value}, "elementwise" [names], "whole" {name: {"shape", "dtype"}}
StateEntry = Mapping[str, Any]
StateTable = Mapping[int, StateEntry]


def merge_tables(tables: Iterable[Mapping[Any, StateEntry]]) -> dict[int, StateEntry]:
    """One table from several ranks' (a parameter's entry is the same wherever it is held);
    keys may arrive as strings (JSON) and come back as layout indices."""
    out: dict[int, StateEntry] = {}
    for table in tables:
        for param, entry in table.items():
            out.setdefault(int(param), entry)
    return out


def bucket_kinds(layout: FlatLayout, table: StateTable) -> list[list[str]]:
    """Per bucket: ``"master"`` and the element-wise state names any of its parameters has, the
    tensors a transfer of that bucket's ranges carries (the same list on every rank)."""
    out = []
    for b in layout.buckets:
        names = sorted({name for p in b.params for name in table.get(p, {}).get("elementwise", ())})
        out.append(["master", *names])
    return out


def table_by_name(table: StateTable, names: Sequence[str]) -> dict[str, StateEntry]:
    """For a manifest: entries keyed by parameter name."""
    return {names[p]: dict(entry) for p, entry in sorted(table.items())}


def table_from_names(data: Mapping[str, StateEntry], index: Mapping[str, int]) -> dict[int, StateEntry]:
    """A manifest's entries keyed by this layout's parameter indices (names it lacks dropped)."""
    return {index[name]: entry for name, entry in data.items() if name in index}
