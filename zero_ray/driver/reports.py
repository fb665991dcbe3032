"""What ``ZeroTrainer`` hands back: a step's metrics (``StepMetrics``) and a resize's report
(``ResizeReport``), typed records.

Both are read-only mappings over their fields as well, because users have always read them as
dicts (``metrics["loss"]``, ``dict(metrics)``, ``json.dumps(dict(report))``, ``fit``'s
callback): a field left at None is absent from the mapping, as the key was from the dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from zero_ray.control.handlers import OwnerStats
from zero_ray.core.reply_combine import CombinedStep
from zero_ray.errors import RelayError


class FieldMapping(Mapping[str, Any]):
    """A frozen dataclass read as a mapping of its fields (under ``metadata["key"]`` where the
    field's name is not the key: ``items`` would hide ``Mapping.items``). Fields that are None
    are absent."""

    def _present(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                out[f.metadata.get("key", f.name)] = value
        return out

    def __getitem__(self, key: str) -> Any:
        return self._present()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._present()!r})"


# eq and repr: Mapping's and the dict's, so a record equals (and prints as) the dict it reads as
@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class StepMetrics(FieldMapping):
    """One completed step, as ``ZeroTrainer.step`` returns it (its docstring says what each
    field means); the mapping's ``items`` key is ``item_count``."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    loss_scale: float
    samples: int
    item_count: float = field(metadata={"key": "items"})
    items_per_second: float
    step_seconds: float
    owner_compute_seconds: float
    data_wait_seconds: float  # the slowest owner's wait for its piece
    bytes_sent: int
    sent_ahead: bool
    count: float | None = None  # loss_fn returned (loss_sum, count)
    nonfinite_loss_ranks: list[int] | None = None  # a non-finite step skipped (on_nonfinite="skip")
    nonfinite_grad_ranks: list[int] | None = None
    eval_loss: float | None = None  # fit evaluated after this step

    @classmethod
    def of(cls, reply: CombinedStep, *, step: int, samples: int, seconds: float, sent_ahead: bool) -> StepMetrics:
        """The metrics of a step from every owner's reply, combined (``core/reply_combine.py``:
        directly or up the relay tree, the same record): sums exact, rounded once."""
        if reply.agreed is None or reply.failure is not None:
            raise RelayError(f"step {step}'s combined reply holds no result, or a failure ({reply.failure}): "
                             "metrics are a completed step's; raise the failure's error instead")
        agreed, totals = reply.agreed.value, reply.totals
        items = totals.items.value
        return cls(step=step, loss=totals.loss, grad_norm=agreed.grad_norm, lr=agreed.lr, skipped=agreed.skipped,
                   loss_scale=agreed.loss_scale, samples=samples, item_count=items,
                   items_per_second=items / seconds if seconds > 0 else 0.0, step_seconds=seconds,
                   owner_compute_seconds=reply.compute_seconds, data_wait_seconds=reply.data_seconds,
                   bytes_sent=reply.bytes_sent_total, sent_ahead=sent_ahead,
                   count=totals.count.value if totals.is_counted else None,
                   nonfinite_loss_ranks=list(reply.nonfinite_loss_ranks) if reply.nonfinite else None,
                   nonfinite_grad_ranks=list(reply.nonfinite_grad_ranks) if reply.nonfinite else None)

    def with_eval_loss(self, loss: float) -> StepMetrics:
        """These metrics with the evaluation ``fit`` ran after the step."""
        return dataclasses.replace(self, eval_loss=loss)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class ResizeReport(FieldMapping):
    """A resize, as ``ZeroTrainer.resize`` returns it: the sizes, the bytes the transfer sent
    and the seconds it took."""

    previous_world_size: int
    world_size: int
    bytes_sent: int
    seconds: float

    @classmethod
    def unchanged(cls, world_size: int) -> ResizeReport:
        """A resize to the size the run has: nothing moves."""
        return cls(previous_world_size=world_size, world_size=world_size, bytes_sent=0, seconds=0.0)


def comm_row(stats: OwnerStats) -> dict[str, int]:
    """One rank's ``comm_report()`` row: bytes sent in the last step by collective, their total,
    the tensor-parallel layers' part (every ``tp_*`` count) and ZeRO's (the rest), and inside /
    across nodes."""
    total = sum(stats.bytes_sent.values())
    tp = sum(n for name, n in stats.bytes_sent.items() if name.startswith("tp_"))
    return {"rank": stats.rank, **stats.bytes_sent, "total": total, "tensor_parallel": tp, "data_parallel": total - tp,
            "inside_node": stats.inside_node_bytes, "cross_node": stats.cross_node_bytes}
