"""Ray's private APIs zero_ray relies on, each behind one named function; written for Ray 2.60.

Checked at import: the installed Ray is 2.60.x (``check_version``) and has every private
attribute used here (``check_attributes``); otherwise ``UnsupportedVersionError`` names what
differs. The gloo group's process group is probed on first use instead, since importing
``ray.util.collective`` takes over a second and most processes never form a group.
"""

from __future__ import annotations

import functools
from typing import Any

import ray
import ray.experimental.internal_kv as _kv

from zero_ray.compat.versions import missing, require

LOWEST, BELOW = (2, 60), (2, 61)
FIX = "install ray[default,data]==2.60.* (pyproject.toml), or check zero_ray/compat/ray_private.py against the new version"
_KV_NAMES = ("_internal_kv_put", "_internal_kv_get", "_internal_kv_exists", "_internal_kv_del", "_internal_kv_list")


def check_version(installed: str) -> None:
    """Raise ``UnsupportedVersionError`` unless ``installed`` is a Ray these adapters were written for."""
    require("ray", installed, lowest=LOWEST, below=BELOW, fix=FIX)


def check_attributes() -> None:
    """Raise ``UnsupportedVersionError`` naming any private attribute the installed Ray lacks."""
    missing("ray", ray.__version__, [f"ray.experimental.internal_kv.{n}" for n in _KV_NAMES if not hasattr(_kv, n)],
            fix=FIX)


check_version(ray.__version__)
check_attributes()


# -- the GCS key-value store ------------------------------------------------------------------------
# Why private: zero_ray's abortable rendezvous (collective/rendezvous.py) needs a store every node
# reaches without a server of its own, with atomic put-if-absent, listing and deletion by prefix.
# Ray 2.60 has no public key-value API; ray.util.collective's own rendezvous uses this one.

def kv_put(key: bytes, value: bytes, *, overwrite: bool, namespace: str) -> bool:
    """Store ``value`` under ``key`` (only if absent unless ``overwrite``); whether the key
    already existed. Private API: ``_internal_kv_put`` (no public key-value store in Ray 2.60)."""
    return bool(_kv._internal_kv_put(key, value, overwrite, namespace=namespace))


def kv_get(key: bytes, *, namespace: str) -> bytes | None:
    """The value under ``key``, None if absent. Private API: ``_internal_kv_get``."""
    return _kv._internal_kv_get(key, namespace=namespace)


def kv_exists(key: bytes, *, namespace: str) -> bool:
    """Whether ``key`` has a value. Private API: ``_internal_kv_exists``."""
    return bool(_kv._internal_kv_exists(key, namespace=namespace))


def kv_delete(key: bytes, *, namespace: str, by_prefix: bool = False) -> int:
    """Delete ``key`` (every key starting with it when ``by_prefix``); how many were deleted.
    Private API: ``_internal_kv_del``."""
    return int(_kv._internal_kv_del(key, del_by_prefix=by_prefix, namespace=namespace))


def kv_list(prefix: bytes, *, namespace: str) -> list[bytes]:
    """Every key starting with ``prefix``. Private API: ``_internal_kv_list``."""
    return list(_kv._internal_kv_list(prefix, namespace=namespace))


# -- the torch process group under a ray.util.collective gloo group ---------------------------------

@functools.cache
def _check_gloo_group() -> None:
    # ``_pg`` is an instance attribute set in TorchGLOOGroup.__init__: the class cannot be probed
    # with hasattr, but its constructor's code names every attribute it assigns.
    from ray.util.collective.collective_group.torch_gloo_collective_group import TorchGLOOGroup

    missing("ray", ray.__version__, [] if "_pg" in TorchGLOOGroup.__init__.__code__.co_names
            else ["TorchGLOOGroup._pg"], fix=FIX)


def process_group_of(group_name: str) -> Any:
    """The ``torch.distributed`` process group under ``ray.util.collective``'s gloo group
    ``group_name``. Private API: the group handle's ``_pg``. Needed because ``RingGroup`` runs
    its ring collectives as isend/irecv with finite waits on that process group (Ray's own
    gloo ``reducescatter`` is a loop of all-reduces and its calls take no timeout), and DDP in
    zero_ray.testing needs it; ``ray.util.collective.get_group_handle`` is public, but Ray 2.60
    exposes the process group behind it by no public name."""
    import ray.util.collective as col

    _check_gloo_group()
    handle = col.get_group_handle(group_name)
    pg = getattr(handle, "_pg", None)
    if pg is None:
        missing("ray", ray.__version__, [f"{type(handle).__name__}._pg (group {group_name!r})"], fix=FIX)
    return pg
