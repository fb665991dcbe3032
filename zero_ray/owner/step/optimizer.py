"""ShardOptimizer: the user's ``torch.optim`` optimizers, run by one owner over what it updates.

Each of the run's optimizers (``core/optimizer_plan.OptimizersPlan``) is built here as an instance of the
user's own class, with the user's groups and hyperparameters, over what this rank steps:

- element-wise optimizers: one 1-D view of the fp32 master per parameter fragment in this
  rank's update slice (its shard; the whole buffer where the optimizer is replicated). torch
  keeps the state per view; after every step its per-element tensors are made views of the
  group's flat buffers (``ParamGroup.moments``), so the state moves, saves and reshards by
  element range like the master weights, and nothing beyond the shard is ever held.
- whole-tensor optimizers: where the optimizer is replicated (stage 0) a view of each whole
  parameter; otherwise a holder per parameter assigned to this rank, stepped whole by the
  ``WholeTensorExchange``.

The user's scheduler factory wraps each instance and steps once per optimizer step. torch's
foreach or fused implementations run where the user asked for them. A parameter no rank had a
gradient for keeps ``grad=None``, so torch skips it exactly as in one process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.collective.stream import CommStream
from zero_ray.core.whole_tensor_assignees import plan_whole_tensors
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.optimizer_plan import OptimizersPlan, SchedulerFactory, UpdateKind, jsonable, qualified_name
from zero_ray.core.optim_state import StateEntry, StateTable
from zero_ray.errors import CheckpointError, ConfigError
from zero_ray.owner.tensors.accounting import StateCounter
from zero_ray.owner.step.param_group import ParamGroup
from zero_ray.owner.step.state_stream import StateStream
from zero_ray.owner.step.whole_tensor import WholeTensorExchange


@dataclass(eq=False)
class Piece:
    """One tensor an optimizer steps here: ``param``'s elements at ``[start, end)`` of
    ``group``'s update slice, as ``tensor`` (1-D, or the parameter's shape for whole-tensor
    optimizers)."""

    param: int
    group: ParamGroup
    start: int
    end: int
    tensor: torch.Tensor
    whole: bool = False  # a whole parameter (its optimizer needs it whole), not a fragment


def encode_scalar(value: Any, *, param: torch.Tensor) -> list[Any]:
    """A non-element state value as JSON data: a 0-d tensor (its dtype, and whether it sits on
    the parameter's device or the CPU, as torch puts ``step`` per implementation) or a plain value."""
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch."), value.item(), value.device == param.device]
    return ["value", jsonable(value)]


def decode_scalar(data: Sequence[Any], *, param: torch.Tensor) -> Any:
    if data[0] == "tensor":
        device = param.device if data[3] else torch.device("cpu")
        return torch.tensor(data[2], dtype=getattr(torch, data[1]), device=device)
    return data[1]


def _elementwise_state_names(plan: OptimizersPlan) -> dict[tuple[int, int], list[str]]:
    """(optimizer, param group) -> the per-element state torch keeps there, learnt by stepping
    a one-element stand-in built as the real instance is (same class, same hyperparameters)."""
    out: dict[tuple[int, int], list[str]] = {}
    for o in plan.optimizers:
        if o.kind is not UpdateKind.ELEMENTWISE:
            continue
        stand_ins = [torch.zeros(2) for _ in o.groups]
        probe = o.build([[t] for t in stand_ins])
        for t in stand_ins:
            t.grad = torch.ones(2)
        probe.step()
        for k, t in enumerate(stand_ins):
            out[(o.index, k)] = sorted(n for n, v in probe.state.get(t, {}).items()
                                       if isinstance(v, torch.Tensor) and v.shape == t.shape)
    return out


class ShardOptimizer:
    """This rank's instances of the run's optimizers and schedulers."""

    def __init__(self, plan: OptimizersPlan, groups: Sequence[ParamGroup], *, layout: FlatLayout, rank: int,
                 update_whole: bool, scheduler: SchedulerFactory | None, device: torch.device,
                 streamed: bool = False) -> None:
        self.plan = plan
        self.streamed = streamed  # the state is offloaded: step one group at a time (step())
        self.stream = StateStream(rank)  # its helper thread
        self.rank = rank
        self.layout = layout
        self.update_whole = update_whole
        self._groups = list(groups)
        place = {i: (o.index, k) for o in plan.optimizers for k, g in enumerate(o.groups) for i in g.params}
        tensors: list[list[list[torch.Tensor]]] = [[[] for _ in o.groups] for o in plan.optimizers]
        self.pieces: list[Piece] = []  # element-wise fragments, and whole parameters where replicated
        whole: dict[int, ParamGroup] = {}
        for g in groups:
            o = g.spec.optimizer
            if o is None or not g.policy.trainable:
                continue
            if plan.optimizers[o].kind is UpdateKind.ELEMENTWISE:
                self.pieces += [Piece(param=i, group=g, start=s, end=e, tensor=g.master[s:e]) for i, s, e in g.pieces]
            else:
                whole.update((i, g) for i in g.members)
                if update_whole:
                    self.pieces += [Piece(param=i, group=g, start=off, end=stop, tensor=g.master[off:stop].view(shape),
                                          whole=True) for i, (off, stop, shape) in zip(g.members, g.views)]
        # Who steps (and saves) each whole parameter; where the optimizer is replicated everyone
        # steps it, and the assignee is the one that saves it.
        self.whole_plan = plan_whole_tensors(layout, sorted(whole))
        self.exchange = (None if update_whole or not whole else
                         WholeTensorExchange(self.whole_plan, groups=whole, layout=layout, rank=rank, device=device))
        for piece in self.pieces:
            o, k = place[piece.param]
            tensors[o][k].append(piece.tensor)
        holders = self.exchange.holders if self.exchange is not None else {}
        for p, holder in holders.items():
            o, k = place[p]
            tensors[o][k].append(holder)
        try:
            self.optimizers = [o.build(tensors[o.index]) for o in plan.optimizers]
        except (TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(f"rebuilding the user's optimizers over this rank's partition failed: {err}") from err
        self.schedulers = [self._schedule(scheduler, opt) for opt in self.optimizers] if scheduler is not None else []
        self._pieces_of = {id(p.tensor): p for p in self.pieces}
        # Streamed: each group's pieces, and the groups in the order the update steps them.
        self._by_group: dict[int, list[Piece]] = {}
        for piece in self.pieces:
            self._by_group.setdefault(piece.group.index, []).append(piece)
        self.stream_order = [g for g in self._groups if g.index in self._by_group]
        self.version = 0  # changes whenever torch creates state (memory is counted again then)
        self._entries = 0
        if streamed:  # every state file now, so that a full disk fails the start, not half a step
            names = _elementwise_state_names(plan)
            for piece in self.pieces:
                for name in names[place[piece.param]]:
                    piece.group.moment(name)

    @staticmethod
    def _schedule(factory: SchedulerFactory, opt: torch.optim.Optimizer) -> Any:
        try:
            return factory(opt)
        except Exception as err:
            raise ConfigError(f"the lr_scheduler factory {factory!r} failed on {type(opt).__name__}: "
                              f"{type(err).__name__}: {err}. It is applied to each of the run's optimizers") from err

    # -- the step ---------------------------------------------------------------------------------
    def lr(self) -> float:
        """The learning rate of the first optimizer's first group (what a step reports)."""
        value = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else 0.0
        return float(value)

    def step(self, grads: Mapping[int, torch.Tensor], used: Sequence[bool], stream: CommStream) -> None:
        """One optimizer step: ``grads`` are the groups' reduced fp32 gradients over their update
        slices (by group index), ``used`` whether any rank had a gradient for each parameter."""
        if self.streamed:
            self._step_streamed(grads, used)
            return
        for piece in self.pieces:
            piece.tensor.grad = (grads[piece.group.index][piece.start:piece.end].view(piece.tensor.shape)
                                 if used[piece.param] else None)
        if self.exchange is not None:
            self.exchange.gather(grads, used, stream)
        for opt in self.optimizers:
            opt.step()
        if self.exchange is not None:
            self.exchange.give_back(used, stream)
        for piece in self.pieces:
            piece.tensor.grad = None
        self._adopt(self.pieces)
        for sched in self.schedulers:
            sched.step()

    def read_ahead(self) -> None:
        """Streamed: start bringing the update's first groups in now, while the step computes
        (a no-op when the state is in memory)."""
        if self.streamed:
            self.stream.read_ahead(self.stream_order)

    def _step_streamed(self, grads: Mapping[int, torch.Tensor], used: Sequence[bool]) -> None:
        """The same step, one group at a time: torch leaves a parameter whose ``grad`` is None
        untouched, so stepping each group's pieces alone is the step of all of them. The
        ``StateStream``'s helper thread brings each group's offloaded state in ahead of its step
        and puts it back after: at most about two groups' state is resident."""
        def step_group(group: ParamGroup) -> None:
            pieces = self._by_group[group.index]
            for piece in pieces:
                piece.tensor.grad = (grads[group.index][piece.start:piece.end].view(piece.tensor.shape)
                                     if used[piece.param] else None)
            for opt in self.optimizers:
                opt.step()
            for piece in pieces:
                piece.tensor.grad = None
            self._adopt(pieces)

        self.stream.run(self.stream_order, step_group)
        for sched in self.schedulers:
            sched.step()

    def _adopt(self, pieces: Sequence[Piece]) -> None:
        """Make every per-element state tensor torch created (or replaced) a view of its group's
        flat buffer, so that the state is held once, over the update slice."""
        for piece in pieces:
            if piece.whole:
                continue  # a whole parameter where replicated: its state stays whole
            state = self._state_of(piece.tensor)
            if not state:
                continue
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == piece.tensor.shape:
                    view = piece.group.moment(name)[piece.start:piece.end]
                    if value.data_ptr() != view.data_ptr():
                        view.copy_(value)
                        state[name] = view
                        self.version += 1
        entries = sum(len(opt.state) for opt in self.optimizers)
        if entries != self._entries:
            self._entries, self.version = entries, self.version + 1

    def _state_of(self, tensor: torch.Tensor) -> dict[str, Any]:
        for opt in self.optimizers:
            if tensor in opt.state:
                return opt.state[tensor]
        return {}

    # -- state as data: what moves, saves and restores --------------------------------------------
    def _stepped(self) -> list[tuple[int, torch.Tensor, bool]]:
        """(param, tensor, elementwise) for every tensor stepped here, pieces then holders."""
        out = [(p.param, p.tensor, not p.whole) for p in self.pieces]
        if self.exchange is not None:
            out += [(p, h, False) for p, h in self.exchange.holders.items()]
        return out

    def table(self) -> dict[int, StateEntry]:
        """This rank's entries (``core/optim_state.py``) for the parameters it has state for."""
        out: dict[int, StateEntry] = {}
        for param, tensor, elementwise in self._stepped():
            state = self._state_of(tensor)
            if not state or param in out:
                continue
            scalars, names, whole = {}, [], {}
            for name, value in state.items():
                if elementwise and isinstance(value, torch.Tensor) and value.dim() == 1 \
                        and value.shape == tensor.shape:
                    names.append(name)
                elif not elementwise and isinstance(value, torch.Tensor) and value.dim() > 0:
                    whole[name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
                else:
                    scalars[name] = encode_scalar(value, param=tensor)
            out[param] = {"scalars": scalars, "elementwise": sorted(names), "whole": whole}
        return out

    def whole_params_here(self) -> list[int]:
        """The whole-tensor parameters stepped on this rank (all of them where replicated)."""
        return sorted({p for p, _, elementwise in self._stepped() if not elementwise})

    def whole_state(self, *, saver_only: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """The whole-tensor state tensors held here, by parameter (only those this rank is the
        assignee of when ``saver_only``: where everyone holds them, one copy is enough)."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for param, tensor, elementwise in self._stepped():
            if elementwise or (saver_only and self.whole_plan.assignee.get(param) != self.rank):
                continue
            state = self._state_of(tensor)
            whole = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
            if whole:
                out[param] = whole
        return out

    def reset(self) -> None:
        """Forget all optimizer state (before a restore fills it anew)."""
        for opt in self.optimizers:
            opt.state.clear()
        self.stream.forget()  # a read-ahead of the state being replaced
        for g in self._groups:
            g.moments.clear()
            g.forget_sums()
        self.version += 1

    def load(self, table: StateTable, whole: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """Give torch the state of every parameter ``table`` has an entry for: element-wise
        state as views of the groups' flat buffers (already filled), scalars decoded, whole
        tensors from ``whole`` (for the parameters stepped here). Parameters without an entry
        keep none, as torch would before their first step."""
        for param, tensor, elementwise in self._stepped():
            entry = table.get(param)
            if entry is None:
                continue
            state: dict[str, Any] = {k: decode_scalar(v, param=tensor) for k, v in entry.get("scalars", {}).items()}
            if elementwise:
                piece = self._pieces_of[id(tensor)]
                for name in entry.get("elementwise", ()):
                    state[name] = piece.group.moment(name)[piece.start:piece.end]
            else:
                held = whole.get(param, {})
                missing = sorted(set(entry.get("whole", {})) - set(held))
                if missing:
                    raise CheckpointError(f"no saved whole-tensor state {missing} for parameter {param}")
                for name in entry.get("whole", {}):
                    state[name] = held[name].to(tensor.device, copy=True)
            for opt in self.optimizers:
                if any(tensor is t for group in opt.param_groups for t in group["params"]):
                    opt.state[tensor] = state
                    break

    def hyper_state(self) -> dict[str, Any]:
        """What every rank holds alike: each optimizer's group hyperparameters (which a scheduler
        changes) and each scheduler's state, as JSON data."""
        return {"optimizers": [[jsonable({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
                               for opt in self.optimizers],
                "schedulers": [{"type": qualified_name(type(s)), "state": jsonable(s.state_dict())}
                               for s in self.schedulers]}

    def load_hyper_state(self, data: Mapping[str, Any]) -> None:
        saved_opts = data.get("optimizers", [])
        if len(saved_opts) != len(self.optimizers):
            raise CheckpointError(f"the saved run had {len(saved_opts)} optimizers, this one {len(self.optimizers)}")
        for opt, groups in zip(self.optimizers, saved_opts):
            if len(groups) != len(opt.param_groups):
                raise CheckpointError(f"the saved {type(opt).__name__} had {len(groups)} param groups, this one "
                                      f"{len(opt.param_groups)}")
            for group, saved in zip(opt.param_groups, groups):
                for key, value in saved.items():
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        saved_scheds = data.get("schedulers", [])
        if saved_scheds and not self.schedulers:
            names = sorted({s["type"].rsplit(".", 1)[-1] for s in saved_scheds})
            raise ConfigError(f"the run being resumed stepped a learning-rate scheduler ({', '.join(names)}); pass "
                              "the same lr_scheduler factory to continue it")
        for sched, saved in zip(self.schedulers, saved_scheds):
            if saved["type"] != qualified_name(type(sched)):
                raise ConfigError(f"the run being resumed used scheduler {saved['type']}, this one "
                                  f"{qualified_name(type(sched))}; pass the same lr_scheduler factory")
            sched.load_state_dict(saved["state"])

    # -- reports ------------------------------------------------------------------------------------
    def count(self, counter: StateCounter) -> None:
        """Whole-tensor state (as moments) and every scalar state tensor; element-wise state is
        counted with its group's flat buffers."""
        for _, tensor, elementwise in self._stepped():
            for value in self._state_of(tensor).values():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    counter.add_whole("optimizer_scalars", value)
                elif not elementwise:
                    counter.add("optimizer_moments", value, value.numel())

    def tensors(self) -> list[torch.Tensor]:
        """The state tensors not already held by the groups (storages are counted once)."""
        return [v for _, t, _ in self._stepped() for v in self._state_of(t).values() if isinstance(v, torch.Tensor)]
