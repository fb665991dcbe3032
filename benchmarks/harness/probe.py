"""Measurements taken inside a rank's process: peak resident memory and model-state bytes.

Everything here runs in the actor (through a method of the benchmark's own workers or through
``actor.__ray_call__`` on actors the benchmark does not define, such as zero_ray's partition
owners and DDPRun's workers), so it must stay importable everywhere and cheap.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zero_ray.core.memory_formulas import StateBytes

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


@dataclass(frozen=True, kw_only=True)
class MemoryProbe:
    """Peak RSS of a process: since the last reset (``peak_rss_bytes``, from VmHWM) and over
    its whole life (``lifetime_peak_rss_bytes``, from getrusage)."""

    peak_rss_bytes: int
    lifetime_peak_rss_bytes: int
    source: str  # "VmHWM since reset", "VmHWM (no reset)" or "ru_maxrss"
    pid: int


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])  # "VmHWM:   123456 kB"
    except (OSError, ValueError, IndexError):
        return None
    return None


def cap_address_space(extra_bytes: int) -> None:
    """Cap this process's address space at what it maps now plus ``extra_bytes`` (once: a cap
    already set is kept), so that building a model too large for the cap fails with a
    MemoryError instead of using the machine's memory. glibc is told to keep few arenas and to
    return freed blocks, so the cap measures tensors rather than allocator slack."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-8, 1)  # M_ARENA_MAX: threads started later reserve no 64 MB arenas of their own
        libc.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD: freed tensors give their address space back
    except OSError:
        pass
    vm_kib = _status_kib("VmSize")
    if vm_kib is None:
        raise RuntimeError("no VmSize in /proc/self/status")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024 + extra_bytes, hard))


def _ru_maxrss_bytes() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return value if sys.platform == "darwin" else value * 1024


_reset_done = False


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: write 5 to clear_refs), so a later
    reading covers only what ran after it. Returns whether the reset took effect."""
    global _reset_done
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    _reset_done = True
    return True


def memory_probe() -> MemoryProbe:
    """This process's peak RSS; see MemoryProbe."""
    import os

    lifetime = _ru_maxrss_bytes()
    hwm = _status_kib("VmHWM")
    if hwm is None:
        return MemoryProbe(peak_rss_bytes=lifetime, lifetime_peak_rss_bytes=lifetime, source="ru_maxrss",
                           pid=os.getpid())
    source = "VmHWM since reset" if _reset_done else "VmHWM (no reset)"
    return MemoryProbe(peak_rss_bytes=hwm * 1024, lifetime_peak_rss_bytes=lifetime, source=source, pid=os.getpid())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard, otherwise ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class HeldBytes:
    """Bytes of memory covered by tensors, each byte counted once however many tensors view it.

    Systems lay model state out differently: per-parameter tensors (DDP), views into flat
    buffers (zero_ray, DeepSpeed), DTensor shards (FSDP2), a parameter used twice (tied
    embeddings). Counting the byte ranges of each storage, merged, gives the memory actually
    held whatever the layout; ``add`` returns only the bytes not already covered, so the first
    category a byte is reported under keeps it.
    """

    def __init__(self) -> None:
        self._covered: dict[int, list[tuple[int, int]]] = {}  # storage address -> sorted disjoint [lo, hi)

    def add(self, t: torch.Tensor) -> int:
        t = local_tensor(t)
        if t.numel() == 0:
            return 0
        storage = t.untyped_storage()
        base = storage.data_ptr()
        # Contiguous tensors are the rule for model state; a strided view is counted over the
        # span it touches, which is what keeps its storage alive anyway.
        lo = t.storage_offset() * t.element_size()
        hi = lo + self._span(t) * t.element_size()
        ranges = self._covered.setdefault(base, [])
        # Existing ranges are disjoint, so their overlaps with [lo, hi) are too.
        new = (hi - lo) - sum(max(0, min(b, hi) - max(a, lo)) for a, b in ranges)
        keep = [(a, b) for a, b in ranges if b < lo or a > hi]
        touching = [(a, b) for a, b in ranges if not (b < lo or a > hi)]
        merged = (min([lo] + [a for a, _ in touching]), max([hi] + [b for _, b in touching]))
        self._covered[base] = sorted(keep + [merged])
        return new

    @staticmethod
    def _span(t: torch.Tensor) -> int:
        if t.is_contiguous():
            return t.numel()
        return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)


def flatten_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``: a tensor, None, or nested lists/tuples/dicts of them."""
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flatten_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in flatten_tensors(v)]
    return []


def count_bytes(tensors: Iterable[Any], held: HeldBytes) -> int:
    """Bytes of ``tensors`` (nested containers allowed) not already counted in ``held``."""
    return sum(held.add(t) for t in flatten_tensors(list(tensors)))


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's per-parameter state (moments and step counters)."""
    out: list[torch.Tensor] = []
    for state in optimizer.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def module_state_bytes(module: torch.nn.Module, optimizer_tensors: Iterable[torch.Tensor]) -> StateBytes:
    """Parameters and gradients of ``module`` (local shards of DTensors) plus the given
    optimizer tensors."""
    held = HeldBytes()
    params = list(module.parameters())
    p = count_bytes(params, held)
    g = count_bytes((q.grad for q in params), held)
    o = count_bytes(optimizer_tensors, held)
    return StateBytes(params=p, grads=g, optimizer=o)


class InStepProbe:
    """Model state in the middle of a step, where a step holds the most of it: when an
    optimizer's ``step()`` begins (gradients all present, none released). A global optimizer
    step pre-hook counts ``state_fn()`` there during the second step after ``arm`` (the first
    creates AdamW's moments, some of them only partway through the step), keeping the largest
    count over that step's calls; ``step_done`` marks each step's end and removes the hook once
    it has counted, so timed steps carry no counting. With ``once`` every hook call is a step of
    its own (one torch optimizer, no ``step_done``). DeepSpeed and ZeroRedundancyOptimizer step
    a wrapped torch optimizer, which fires the hook (the wrapper's own call, without state, is
    skipped); DeepSpeed ZeRO-1/2 steps it once per parameter group with only that group's
    gradient partition present, hence the largest count over the step."""

    def __init__(self) -> None:
        self.state: StateBytes | None = None
        self._handle: Any = None
        self._steps_done = 0  # since arm

    def arm(self, state_fn: Any, *, once: bool = False) -> None:
        """Count ``state_fn()`` (a StateBytes) inside the second step from now."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.disarm()
        self.state, self._steps_done = None, 0

        def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            counting = self._steps_done >= 1
            if once:
                self._steps_done += 1
            if not counting or not optimizer.state:
                return
            got = state_fn()
            if self.state is None or got.total > self.state.total:
                self.state = got
            if once:
                self.disarm()

        self._handle = register_optimizer_step_pre_hook(hook)

    def step_done(self) -> None:
        """A step ended: stop counting once it has counted something."""
        self._steps_done += 1
        if self.state is not None:
            self.disarm()

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


IN_STEP = InStepProbe()  # one per process: the hook it registers is global


# -- functions for actor.__ray_call__ (the first argument is the actor instance) ----------------
def call_reset_peak_rss(_actor: Any) -> bool:
    return reset_peak_rss()


def call_memory_probe(_actor: Any) -> MemoryProbe:
    return memory_probe()


def call_reset_ddp_peaks(worker: Any) -> bool:
    """A DDPWorker's RankWorker.reset_peaks: peak RSS afresh, in-step state counted next."""
    IN_STEP.arm(lambda: call_ddp_worker_state(worker), once=True)  # one torch optimizer per step
    return reset_peak_rss()


def call_in_step_state(_actor: Any) -> StateBytes | None:
    return IN_STEP.state


def call_ddp_worker_state(worker: Any) -> StateBytes:
    """Model state of a ``zero_ray.testing.DDPWorker``: its DDP module's parameters and
    gradients and its torch optimizer's state (DDP's own bucket buffers are communication
    buffers, not model state, and are not counted)."""
    return module_state_bytes(worker.module.module, [t for o in worker.opts for t in optimizer_state_tensors(o)])
