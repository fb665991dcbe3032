"""Fault injection for the tests and the recovery benchmark: an owner's process SIGKILLed at a
named point of its work, or an owner that ends itself mid-step.

The library knows nothing of this. A test wraps its ``model_fn`` with ``faulty(model_fn,
faults)``: every owner calls ``model_fn`` in its own process (replacements and rebuilt engines
too), and the wrapper first installs hooks there, once per process, around the library functions
that mark each point (forming a group, a transfer, a peer snapshot, writing a checkpoint file, a
backward pass). A fault fires when its rank reaches its point for the ``after``-th time: it
creates a marker file in ``dir`` (holding the time), so it happens once per run whatever is
replayed or restarted, and SIGKILLs its own process, as a crash or the OOM killer would (or
SIGSTOPs it, as a hung node or a debugger would freeze it).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
import torch.nn.functional as F

SIGNALS = ("SIGKILL", "SIGSTOP")
POINTS = ("backward", "group_formation", "resize_transfer", "restore_transfer", "peer_snapshot", "checkpoint_save",
          "checkpoint_commit", "set_peers", "dataset_registration")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """Signal the owner of rank ``rank`` the ``after``-th time (0-based) it reaches ``point``:
    ``SIGKILL`` (a crash) by default, or ``SIGSTOP`` (a frozen process: its threads stop, its
    sockets stay open, so only a stalled heartbeat stream tells)."""

    point: str
    rank: int
    after: int = 0
    dir: str
    sig: str = "SIGKILL"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"point={self.point!r} is not one of {POINTS}")
        if self.sig not in SIGNALS:
            raise ValueError(f"sig={self.sig!r} is not one of {SIGNALS}")

    @property
    def marker(self) -> str:
        return marker(self.dir, self.point)


def marker(directory: str, point: str) -> str:
    """The file a fault at ``point`` creates when it fires (holding the time)."""
    return os.path.join(directory, f"fault-{point}")


def killed_at(directory: str, point: str) -> float | None:
    """When the fault at ``point`` fired (Unix time), or None if it has not."""
    try:
        with open(marker(directory, point), encoding="ascii") as fh:
            return float(fh.read())
    except (OSError, ValueError):
        return None


def assert_fired(fault: Fault) -> float:
    """When ``fault`` fired; raises AssertionError if it never did (its hook point renamed, its
    rank never reaching it), so a fault that silently stopped firing fails its test."""
    when = killed_at(fault.dir, fault.point)
    if when is None:
        raise AssertionError(f"the planned fault {fault} never fired (no {fault.marker})")
    return when


# -- in the owner's process ------------------------------------------------------------------------
class _Hooks:
    """This process's planned faults and how often each point was reached."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self.reached: Counter[tuple[str, int]] = Counter()
        self.rank = -1  # of the model state built last in this process
        self.lock = threading.Lock()
        self.installed = False

    def reach(self, point: str, rank: int) -> None:
        with self.lock:
            count = self.reached[(point, rank)]
            self.reached[(point, rank)] += 1
        for f in self.faults:
            if f.point != point or f.rank != rank or count < f.after:
                continue
            try:
                fd = os.open(f.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                continue
            os.write(fd, repr(time.time()).encode())
            os.close(fd)
            # To this thread, not the process: a process-directed signal goes to the main thread,
            # and until the scheduler runs it this thread (a Ray call's) carries on past the point
            # (CI saw a frozen registration reply, then the owner stop in the next step).
            signal.pthread_kill(threading.get_ident(), getattr(signal, f.sig))


# exchange's callers: a peer restore's (redundancy, for LiveRank.rebuild) and a resize's
# (live_rank._reshard)
_RESTORE_CALLERS = ("restore_from_peers",)
_TRANSFER_CALLERS = (*_RESTORE_CALLERS, "_reshard")
_STATE = "zero_ray_test_faults"  # a module of this name holds each process's hooks


def hooks() -> _Hooks:
    """This process's hooks. They live in ``sys.modules``, not in a global of this module: the
    owners get this module's functions pickled by value, each call with globals of its own."""
    state = sys.modules.get(_STATE)
    if state is None:
        state = types.ModuleType(_STATE)
        state.hooks = _Hooks()  # type: ignore[attr-defined]
        sys.modules[_STATE] = state
    return state.hooks  # type: ignore[attr-defined, no-any-return]


def _wrap(owner: Any, name: str, before: Callable[..., None]) -> None:
    """Replace ``owner.name`` with a function calling ``before(*args, **kwargs)`` first. A hook
    point renamed or removed in the library raises here, as the hooks install, rather than
    leaving its faults silently off."""
    original = getattr(owner, name, None)
    if not callable(original):
        where = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        raise AttributeError(f"fault hook point {getattr(owner, '__module__', '')}.{where}.{name} is missing "
                             f"or not callable (found {original!r}): the library renamed it")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _install() -> None:
    """Hook the points in this process (once)."""
    from zero_ray.owner.resilience import checkpointing, redundancy
    from zero_ray.owner.service import batch_source, live_rank

    state = hooks()
    if state.installed:
        return
    state.installed = True

    def forming(**kwargs: Any) -> None:
        state.reach("group_formation", kwargs["rank"])

    def transfer(*args: Any, me: int, **kwargs: Any) -> None:
        caller = sys._getframe(2).f_code.co_name  # _reshard (a resize) or a restore's
        if caller not in _TRANSFER_CALLERS:  # a renamed caller would file its kills under the wrong point
            raise AssertionError(f"exchange called from {caller!r}, not one of {_TRANSFER_CALLERS}")
        state.reach("restore_transfer" if caller in _RESTORE_CALLERS else "resize_transfer", me)

    def snapshot(self: Any, engine_: Any, *args: Any, **kwargs: Any) -> None:
        state.reach("peer_snapshot", engine_.rank)

    def writing(*args: Any, rank: int, **kwargs: Any) -> None:
        state.reach("checkpoint_save", rank)

    def reporting(*args: Any, **kwargs: Any) -> None:  # the file is written; the driver's commit asks for it
        state.reach("checkpoint_commit", state.rank)

    def confirming(*args: Any, **kwargs: Any) -> None:  # every SetPeers confirms (or finds nothing to)
        state.reach("set_peers", state.rank)

    def registering(*args: Any, **kwargs: Any) -> None:  # fit's dataset registration, before it builds
        state.reach("dataset_registration", state.rank)

    _wrap(live_rank, "form_group", forming)
    _wrap(live_rank, "exchange", transfer)
    _wrap(redundancy, "exchange", transfer)
    _wrap(redundancy.PeerSnapshots, "take", snapshot)
    _wrap(checkpointing, "write_shard", writing)
    _wrap(checkpointing.ShardSaver, "wait", reporting)
    _wrap(redundancy.PeerSnapshots, "confirm_layout", confirming)
    _wrap(batch_source.PieceSource, "register", registering)


@dataclass(frozen=True)
class _Faulty:
    """``model_fn`` that installs the fault hooks in the owner's process first."""

    model_fn: Callable[[], torch.nn.Module]
    faults: tuple[Fault, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        # Arm the hooks as the owner receives its spec, before it builds anything: a replacement
        # owner restores (restore_transfer) before it ever calls model_fn.
        return (_arrive, (self.model_fn, self.faults))

    def __call__(self) -> torch.nn.Module:
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is None:
            # The driver builds the model too (on the meta device: tensor parallelism's plan and
            # counts, driver/tp_consolidation.py); faults fire in owners only.
            return self.model_fn()
        _install()
        state = hooks()
        state.faults = list(self.faults)
        state.rank = _building_rank()
        module = self.model_fn()
        if any(f.point == "backward" for f in self.faults):
            # each backward pass reaches the point once, as its gradient leaves the output
            module.register_forward_hook(_hook_backward)
        return module


def _arrive(model_fn: Callable[[], torch.nn.Module], faults: tuple[Fault, ...]) -> _Faulty:
    """Unpickling a ``_Faulty`` (in an owner's process) installs the hooks with its faults."""
    _install()
    state = hooks()
    if not state.faults:
        state.faults = list(faults)
    return _Faulty(model_fn, faults)


def _building_rank() -> int:
    """The rank of the model state that is calling ``model_fn`` (read from its frame: the
    library has no other way to say it). A renamed ModelState fails here, loudly: a rank of -1
    would match no fault, and the test would pass without its kill."""
    frame = sys._getframe(1)
    while frame is not None:
        me = frame.f_locals.get("self")
        if type(me).__name__ == "ModelState":
            return int(me.rank)
        frame = frame.f_back
    raise AssertionError("model_fn was not called by a zero_ray.owner.step.model_state.ModelState: the faults keyed "
                         "by rank (backward, set_peers, checkpoint_commit) cannot know this owner's rank; "
                         "update _building_rank")


def _hook_backward(module: torch.nn.Module, args: Any, out: Any) -> None:
    # a tensor, or a Hugging Face ModelOutput (a dict): its first tensor that backward passes through
    values = out.values() if isinstance(out, dict) else (out,)
    tensor = next((v for v in values if isinstance(v, torch.Tensor) and v.requires_grad), None)
    if tensor is not None:
        state = hooks()
        tensor.register_hook(lambda grad: state.reach("backward", state.rank))


def faulty(model_fn: Callable[[], torch.nn.Module], *faults: Fault) -> Callable[[], torch.nn.Module]:
    """``model_fn`` with ``faults`` planned in every owner that builds it."""
    return _Faulty(model_fn, tuple(faults))


# -- an owner that ends itself mid-step (ray.kill) ---------------------------------------------------
MARKER_BELOW = -100  # a first sample below this asks its owner to end itself; -101 - n is kill n


def planned_kills(batches: list[Any]) -> set[int]:
    """The kills ``batches`` plan for ``kill_on_marker`` (each marker value, as n of -101 - n)."""
    return {int(-101 - float(v)) for x, _ in batches for v in x[:, 0] if float(v) < MARKER_BELOW}


def fired_kills(marks: str) -> set[int]:
    """The kills ``kill_on_marker`` carried out, from the files it leaves in ``marks``."""
    return {int(name.removeprefix("killed")) - 101 for name in os.listdir(marks) if name.startswith("killed")}


def kill_on_marker(module: torch.nn.Module, batch: Any, *, marks: str) -> torch.Tensor:
    """MSE loss; an owner whose piece's first sample starts with a marker value (-101, -102, ...)
    kills itself with ``ray.kill`` once (a file in ``marks`` records that it did, so the replayed
    step goes through)."""
    x, y = batch
    value = float(x[0, 0]) if x.shape[0] else 0.0
    if value < MARKER_BELOW:
        try:
            os.close(os.open(os.path.join(marks, f"killed{int(-value)}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            threading.Event().wait(60)  # ray.kill is asynchronous: stay in this step until it lands
    return F.mse_loss(module(x), y)


# -- runs with a kill at a chosen point ----------------------------------------------------------------
KILL_POINTS = ("backward", "resize_transfer", "resize_formation", "resize_confirm", "grow_formation", "grow_transfer",
               "after_resize", "restore_after_loss", "peer_snapshot", "checkpoint_save", "checkpoint_commit", "freeze")
# The kills inside a save: as the owner writes its file (in the background, racing the snapshot's
# reply), and once the snapshot has returned and the driver's commit asks for the written file.
SAVES = ("checkpoint_save", "checkpoint_commit")
# The kills inside a resize: a shrink by one owner, or a grow by one.
SHRINKS = ("resize_transfer", "resize_formation", "resize_confirm", "after_resize")
GROWS = ("grow_formation", "grow_transfer")
# These points' restores wait for a replacement (``continue_on_survivors=False``): a resize case
# tries its resize again from the full size, and restore_after_loss kills the replacement in its
# restore (a second survivor lost there would take the only other copy of a partition with it).
# Every other point continues on the survivors at once, the default.
WAITS = (*SHRINKS, *GROWS, "restore_after_loss")


@dataclass(kw_only=True)
class KillRun:
    """What a run with a planned kill saw."""

    point: str
    params: dict[str, torch.Tensor]
    recoveries: list[Any]
    killed_at: float  # Unix time of the (first) kill
    kill_to_next_step_s: float  # to the first step completed after it (the longest, when repeated)
    world_sizes: list[int]
    notes: list[str] = field(default_factory=list)
    each_kill_to_next_step_s: list[float] = field(default_factory=list)  # per repetition
    # to the first step completed at the run's size again, the replacements joined (None: not
    # within the run, or a resize point)
    kill_to_full_size_s: float | None = None
    saved: str | None = None  # SAVES: the directory save_checkpoint returned


def _faults(point: str, marks: str, at: int, world_size: int) -> list[Fault]:
    if point == "restore_after_loss":  # a first loss in backward, then the replacement dies in the restore
        return [Fault(point="backward", rank=1, after=at, dir=marks), Fault(point="restore_transfer", rank=2, dir=marks)]
    if point in ("freeze", "after_resize"):  # the test stops or kills the process itself
        return []
    if point == "resize_formation":  # rank 1's third group: the survivors' own, after the transfer freed its state
        return [Fault(point="group_formation", rank=1, after=2, dir=marks)]
    if point == "resize_confirm":  # rank 1 as the driver confirms the new layout's copies (SetPeers)
        return [Fault(point="set_peers", rank=1, after=1, dir=marks)]
    if point == "grow_formation":  # the new owner (rank N of N + 1) as it joins the transfer group
        return [Fault(point="group_formation", rank=world_size, after=0, dir=marks)]
    if point == "grow_transfer":  # an old owner while it sends its ranges to the new one
        return [Fault(point="resize_transfer", rank=2, dir=marks)]
    return [Fault(point=point, rank=1, after=at if point in ("backward", "peer_snapshot") else 0, dir=marks)]


def _point_marker(point: str) -> str:
    """The marker a kill at ``point`` leaves (the first kill's, for restore_after_loss)."""
    return {"restore_after_loss": "backward", "resize_formation": "group_formation",
            "grow_formation": "group_formation", "grow_transfer": "resize_transfer",
            "resize_confirm": "set_peers"}.get(point, point)


def run_with_kill(point: str, *, model_fn: Any, loss_fn: Any, optimizer: Any, batches: list[Any],
                  config: Any, at: int, marks: str, repeat: int = 1) -> KillRun:
    """Train on ``batches`` with ``config`` (3 owners or more, peer redundancy) while an owner's
    process is SIGKILLed at ``point`` once ``at`` steps are done (``freeze``: rank 1 SIGSTOPped
    before step ``at``); before step ``at`` the run resizes to one owner fewer (``SHRINKS``; for
    ``after_resize`` rank 0 is SIGKILLed as soon as the resize returned, before any step) or one
    more (``GROWS``), or saves a checkpoint (``SAVES``), as those kills need. A resize
    whose kill makes it fail is tried again before each of the next ``repeat - 1`` steps, the
    fault re-armed each time (its marker taken away): the owner holding the faulted rank then is
    another process, so the kills land on other processes and, for a formation, other moments."""
    import zero_ray as zr
    from zero_ray.errors import ResizeInterrupted, ZeroRayError

    if point not in KILL_POINTS:
        raise ValueError(f"point={point!r} is not one of {KILL_POINTS}")
    trainer = zr.ZeroTrainer(faulty(model_fn, *_faults(point, marks, at, config.world_size)), loss_fn,
                             optimizer=optimizer, config=config)
    done_at: list[float] = []
    sizes: list[int] = []
    notes: list[str] = []
    frozen_at = None
    kills: list[float] = []
    saved = None
    repeats = repeat if point in SHRINKS + GROWS and point != "after_resize" else 1
    try:
        for k, batch in enumerate(batches):
            if at < k < at + repeats:  # the last kill fired: re-arm it
                kills.append(_take_marker(marks, _point_marker(point)))
            if at <= k < at + repeats and point in SHRINKS + GROWS:
                try:
                    trainer.resize(trainer.world_size + (1 if point in GROWS else -1))
                except ResizeInterrupted as err:
                    notes.append(str(err).splitlines()[0])
                if point == "after_resize":
                    pid = ray.get(trainer.actors[0].node.remote(), timeout=60)["pid"]
                    frozen_at = time.time()
                    os.kill(pid, signal.SIGKILL)
            if k == at and point in SAVES:
                try:  # a save that finds its owner lost recovers the pool and saves
                    saved = trainer.save_checkpoint(wait=True)
                except ZeroRayError as err:
                    notes.append(str(err).splitlines()[0])
            if k == at and point == "freeze":
                pid = ray.get(trainer.actors[1].node.remote(), timeout=60)["pid"]
                os.kill(pid, signal.SIGSTOP)
                frozen_at = time.time()
            trainer.step(batch)
            done_at.append(time.time())
            sizes.append(trainer.world_size)
        params = trainer.full_state_dict()
        recoveries = list(trainer.recoveries)
    finally:
        trainer.shutdown()
    first = _point_marker(point)
    killed = frozen_at if point in ("freeze", "after_resize") else killed_at(marks, first)
    if killed is None:
        raise AssertionError(f"the planned kill at {first} never happened")
    if point == "restore_after_loss" and killed_at(marks, "restore_transfer") is None:
        raise AssertionError("the second kill (in the restore) never happened")
    kills.append(killed)
    each = [min(t for t in done_at if t > kill) - kill for kill in kills]
    full = ([] if point in SHRINKS + GROWS  # a resize changes the size on purpose
            else [t - kills[-1] for t, n in zip(done_at, sizes) if t > kills[-1] and n == config.world_size])
    return KillRun(point=point, params=params, recoveries=recoveries, killed_at=kills[0],
                   kill_to_next_step_s=max(each), world_sizes=sizes, notes=notes, each_kill_to_next_step_s=each,
                   kill_to_full_size_s=full[0] if full else None, saved=saved)


def _take_marker(directory: str, point: str) -> float:
    """When the fault at ``point`` fired; removing its marker arms it again."""
    when = killed_at(directory, point)
    if when is None:
        raise AssertionError(f"the planned kill at {point} never happened")
    os.unlink(marker(directory, point))
    return when
