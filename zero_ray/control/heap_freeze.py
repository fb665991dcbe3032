"""A control process's heap, as it is when the process takes up its part in the relay tree,
moved out of the garbage collector's full collections (issue 44: fit's bimodal added latency at
1,024 owners).

A process that imported torch, Ray and zero_ray tracks about a million objects. CPython's full
(generation-2) collection walks all of them: 145-160 ms in a relay's process and 185-940 ms in the
driver's on this 2-core machine (``benchmarks/control_scale --relays 8 --stand-in``, traced per
step). One landing in a step's path holds a relay's hop or the driver's dispatch that long, so a
step sent ahead reached its subtree after the step before it had ended, and fit's 20-step window
(0.4 s) lost the whole pause: the runs with one and the runs without made the two modes.

:func:`freeze_heap` moves every object tracked so far into the permanent generation
(``gc.freeze``: a list splice, microseconds): later full collections walk only the objects made
since, so they take milliseconds. It is called once per process, before the process holds state
that relies on being collected: an owner at its start, before any collective group forms (a
destroyed group's sockets close when it is collected: ``collective/ray_group.py``), and the
driver when it first plans the tree (``RelayPlane.replan``), before it builds its hop (a hop
dropped unclosed is closed when collected).

The cost: an object tracked at the freeze that is, or later becomes, garbage in a reference cycle
is never reclaimed (objects freed by reference counting are freed as ever). What a process holds
at that point (its modules, its configuration, the pool's clients) lives about as long as the
process, and freezing once, not at every re-plan, keeps all that is built later collectable.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["freeze_heap"]

_lock = threading.Lock()
_frozen = False  # this process's heap was frozen once


def freeze_heap() -> bool:
    """Once per process: move every object the collector tracks now out of its future
    collections. Returns whether this call did it."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        gc.freeze()
        _frozen = True
        return True
