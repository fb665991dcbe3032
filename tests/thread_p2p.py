"""torch.distributed's point-to-point calls between thread ranks, for the owner code that moves
state by ``batch_isend_irecv`` (peer snapshots, resizes, restores: owner/resilience) and gathers
small objects by ``all_gather_object``: ``thread_p2p(monkeypatch)`` routes them through the
thread ranks' in-memory world (tests/thread_ranks.py) for the test's duration. A rank hands
that code ``P2P(group)`` as its group: the object torch's calls name as their process group."""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from thread_ranks import ThreadGroup


class P2P:
    """A thread rank's ThreadGroup as the process group the owner's transfers name."""

    def __init__(self, group: ThreadGroup) -> None:
        self.group = group
        self.rank, self.world_size = group.rank, group.world_size
        self.counters = group.counters

    @property
    def process_group(self) -> P2P:
        return self


class _Mail:
    """Tagged tensors in flight, by (sender, receiver); a receive takes its tag's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.boxes: dict[tuple[int, int], queue.Queue[tuple[int, torch.Tensor]]] = {}
        self.early: dict[tuple[int, int, int], torch.Tensor] = {}  # taken while looking for another tag

    def box(self, src: int, dst: int) -> queue.Queue[tuple[int, torch.Tensor]]:
        with self.lock:
            return self.boxes.setdefault((src, dst), queue.Queue())


_MAIL: dict[int, _Mail] = {}  # by id of the ThreadWorld
_MAIL_LOCK = threading.Lock()


def _mail(p2p: P2P) -> _Mail:
    with _MAIL_LOCK:
        return _MAIL.setdefault(id(p2p.group.world), _Mail())


class _Op:
    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: P2P, tag: int = 0) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class _Recv:
    def __init__(self, op: _Op) -> None:
        self.op = op

    def wait(self, timeout: Any = None) -> bool:
        op = self.op
        mail, me = _mail(op.group), op.group.rank
        key = (op.peer, me, op.tag)
        while key not in mail.early:
            tag, value = mail.box(op.peer, me).get(timeout=60)
            mail.early[(op.peer, me, tag)] = value
        op.tensor.copy_(mail.early.pop(key))
        return True


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


def _batch_isend_irecv(ops: list[_Op]) -> list[Any]:
    works: list[Any] = []
    for op in ops:
        if op.op is dist.isend:
            _mail(op.group).box(op.group.rank, op.peer).put((op.tag, op.tensor.detach().clone()))
            works.append(_Done())
        else:
            works.append(_Recv(op))
    return works


def _all_gather_object(out: list[Any], obj: Any, group: P2P) -> None:
    out[:] = group.group._exchange(obj)


def thread_p2p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route torch.distributed's P2POp / batch_isend_irecv / all_gather_object between thread
    ranks (their group given as ``P2P``) until the test ends."""
    _MAIL.clear()  # nothing left in flight from an earlier test
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", _batch_isend_irecv)
    monkeypatch.setattr(dist, "all_gather_object", _all_gather_object)
