"""A detached run's desired world size, kept where it outlives the driver: Ray's GCS key-value
store (the store the owners' names live in), under the run's id.

The desired size is the driver's: ``ZeroConfig.world_size`` until a ``resize`` changes it, and
what the run grows back to after a loss. The owners' run spec keeps the config they started
with, so a driver attaching after its predecessor's loss would otherwise take the started size
for the desired one and undo the user's resize at its first grow check (issue 46's soak: a run
resized 4 -> 3 was at 4 owners one step after the attach). Only detached runs record it: no
other run is ever attached. The key's name is in core/ray_names.py: a detached run's owners drop
it themselves when they end without a driver."""

from __future__ import annotations

from zero_ray.compat import ray_private
from zero_ray.core.ray_names import NAMESPACE, desired_size_key


def record(run_id: str, size: int) -> None:
    """Keep ``size`` as run ``run_id``'s desired size (replacing the one before)."""
    ray_private.kv_put(desired_size_key(run_id), str(size).encode(), overwrite=True, namespace=NAMESPACE)


def recorded(run_id: str) -> int | None:
    """The desired size last recorded for run ``run_id``; None if none was."""
    value = ray_private.kv_get(desired_size_key(run_id), namespace=NAMESPACE)
    return None if value is None else int(value)


def forget(run_id: str) -> None:
    """Drop the record (the run is shut down)."""
    ray_private.kv_delete(desired_size_key(run_id), namespace=NAMESPACE)
