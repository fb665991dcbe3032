"""WholeTensorExchange: whole-tensor parameters updated on one owner each (stages 1-3).

Each such parameter has an assignee (``core/whole_tensor_assignees.py``). Around the optimizer's step, in two
point-to-point rounds on the comm stream: the owners of its pieces send the reduced gradient
(and, unless the assignee already holds the fp32 values whole, the master values) to the
assignee, which steps the whole parameter with the user's optimizer; then the assignee sends
the new values back to the pieces' owners, who write them into their master slices. The
optimizer's state for the parameter exists on the assignee alone. Traffic is counted as
``whole_tensor_gather`` and ``whole_tensor_return``.

Parameters nobody produced a gradient for this step are left out, as torch skips them.
"""

from __future__ import annotations

import math

import torch

from zero_ray.collective.stream import CommStream
from zero_ray.core.whole_tensor_assignees import WholeTensorPlan
from zero_ray.core.group_policy import ParamResidency
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.owner.step.param_group import ParamGroup

Messages = list[tuple[torch.Tensor, int]]


class WholeTensorExchange:
    """This rank's part in updating whole-tensor parameters on their assignees."""

    def __init__(self, plan: WholeTensorPlan, *, groups: dict[int, ParamGroup], layout: FlatLayout, rank: int,
                 device: torch.device) -> None:
        self.plan = plan
        self.rank = rank
        self._groups = groups  # layout parameter index -> the group holding it
        self._layout = layout
        self._device = device
        # What the optimizer steps: one tensor per parameter assigned here, of its shape. Its
        # storage is the gathered values during a step and nothing between steps (the state,
        # keyed by this tensor, stays).
        self.holders: dict[int, torch.Tensor] = {
            p: torch.zeros((), dtype=torch.float32, device=device).expand(layout.params[p].shape)
            for p in plan.assigned_to(rank)}
        self._empty = torch.empty(0, dtype=torch.float32, device=device)
        self._stepping: list[int] = []

    def _local_values(self, p: int) -> bool:
        """Whether every rank holds ``p``'s fp32 values whole (stages 1-2 in fp32: the master is a
        view of the whole buffer), so that the assignee reads them instead of receiving them."""
        g = self._groups[p]
        return g.policy.params is ParamResidency.WHOLE and g.dtype == torch.float32

    def gather(self, grads: dict[int, torch.Tensor], used: list[bool], stream: CommStream) -> None:
        """Bring each used parameter's gradient (``grads``: each group's reduced fp32 gradient
        over its update slice, by group index) and values to its assignee, and point the
        holders at them."""
        sends: Messages = []
        recvs: Messages = []
        self._stepping = []
        for p in sorted(self.plan.assignee):
            if not used[p]:
                continue
            owner, g = self.plan.assignee[p], self._groups[p]
            local = self._local_values(p)
            numel = math.prod(self._layout.params[p].shape)
            full_grad = full_value = None
            if owner == self.rank:
                full_grad = torch.empty(numel, dtype=torch.float32, device=self._device)
                spec = self._layout.params[p]
                full_value = (g.full[spec.offset:spec.end].float().clone() if local and g.full is not None
                              else torch.empty(numel, dtype=torch.float32, device=self._device))
                self._stepping.append(p)
            for piece in self.plan.pieces[p]:
                grad = grads[g.index][piece.local_start:piece.local_end] if piece.rank == self.rank else None
                value = g.master[piece.local_start:piece.local_end] if piece.rank == self.rank else None
                if owner == self.rank:
                    assert full_grad is not None and full_value is not None
                    into_grad = full_grad[piece.param_start:piece.param_end]
                    into_value = full_value[piece.param_start:piece.param_end]
                    if piece.rank == self.rank:
                        into_grad.copy_(grad)
                        if not local:
                            into_value.copy_(value)
                    else:
                        recvs.append((into_grad, piece.rank))
                        if not local:
                            recvs.append((into_value, piece.rank))
                elif piece.rank == self.rank:
                    assert grad is not None and value is not None
                    sends.append((grad.contiguous(), owner))
                    if not local:
                        sends.append((value.float().contiguous(), owner))
            if owner == self.rank:
                holder = self.holders[p]
                shape = self._layout.params[p].shape
                holder.data = full_value.view(shape)
                holder.grad = full_grad.view(shape)
        stream.send_recv(sends, recvs, op="whole_tensor_gather")

    def give_back(self, used: list[bool], stream: CommStream) -> None:
        """Send each stepped parameter's new values to its pieces' owners, who write them into
        their master slices; then free the gathered tensors."""
        sends: Messages = []
        recvs: Messages = []
        for p in sorted(self.plan.assignee):
            if not used[p]:
                continue
            owner, g = self.plan.assignee[p], self._groups[p]
            for piece in self.plan.pieces[p]:
                if owner == self.rank:
                    value = self.holders[p].data.reshape(-1)[piece.param_start:piece.param_end]
                    if piece.rank == self.rank:
                        g.master[piece.local_start:piece.local_end].copy_(value)
                    else:
                        sends.append((value, piece.rank))
                elif piece.rank == self.rank:
                    recvs.append((g.master[piece.local_start:piece.local_end], owner))
        stream.send_recv(sends, recvs, op="whole_tensor_return")
        for p in self._stepping:
            self.holders[p].data = self._empty
            self.holders[p].grad = None
        self._stepping = []
