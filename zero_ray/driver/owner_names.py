"""The owners' actor names in Ray (namespace ``zero_ray``): what a driver starts them under, and
how it asks whether one is still alive. A new driver finds a detached run's owners by them
(``driver/attach.py``)."""

from __future__ import annotations

import ray

from zero_ray.core.ray_names import NAMESPACE


def owner_name(run_id: str, rank: int, generation: int, start: int = 0) -> str:
    """An owner's actor name. ``start`` tells apart replacements started ahead of a grow from
    owners of the same rank and generation started before or after (an ended actor's name may
    still be taken for a moment)."""
    return f"zero_ray-{run_id}-rank{rank}-g{generation}" + (f"-s{start}" if start else "")


def actor_alive(name: str | None) -> bool:
    """Whether Ray still has the named owner actor. Ray frees a named actor's name the moment
    it knows the actor dead (ray.kill, a crash, its node lost), before the process is gone;
    the registry lives in the GCS, so this works without the dashboard that ray.util.state
    needs. An owner without a name (unknown) counts as alive: gRPC probes it next."""
    if not name:
        return True
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True
