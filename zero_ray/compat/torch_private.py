"""torch's private APIs zero_ray relies on, each behind one named function or name; written for
torch 2.11 to 2.14 (the GPU image runs 2.11, pyproject.toml allows >=2.13,<2.15).

Checked at import: the installed torch is in that range (``check_version``) and has every
private attribute used here (``check_attributes``); otherwise ``UnsupportedVersionError`` names
what differs.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Iterator

import torch
import torch._ops as _ops
import torch.distributed.distributed_c10d as _c10d
import torch.utils._pytree as _pytree
import torch.utils._python_dispatch as _dispatch

from zero_ray.compat.versions import missing, require

LOWEST, BELOW = (2, 11), (2, 15)
FIX = "install torch==2.13.0 (pyproject.toml), or check zero_ray/compat/torch_private.py against the new version"


def check_version(installed: str) -> None:
    """Raise ``UnsupportedVersionError`` unless ``installed`` is a torch these adapters were written for."""
    require("torch", installed, lowest=LOWEST, below=BELOW, fix=FIX)


def _absent() -> list[str]:
    gone = [f"{mod.__name__}.{name}" for mod, name in (
        (torch._C, "_current_graph_task_id"), (_c10d, "_world"), (_c10d, "default_pg_timeout"),
        (_c10d, "_get_default_timeout"), (_pytree, "tree_flatten"), (_pytree, "tree_unflatten"),
        (_dispatch, "TorchDispatchMode"), (_ops, "OpOverload")) if not hasattr(mod, name)]
    if not hasattr(torch.empty(0, device="meta").untyped_storage(), "_cdata"):
        gone.append("torch.UntypedStorage._cdata")
    if not hasattr(torch.nn.Module(), "_compiled_call_impl"):
        gone.append("torch.nn.Module._compiled_call_impl")
    if hasattr(_c10d, "_world"):
        prop = getattr(type(_c10d._world), "group_count", None)
        if not (isinstance(prop, property) and prop.fset is not None):
            gone.append("a settable torch.distributed.distributed_c10d._world.group_count")
    # The timeout patch works only while torch reads the module global when a group is formed.
    if hasattr(_c10d, "_get_default_timeout") and "default_pg_timeout" not in _c10d._get_default_timeout.__code__.co_names:
        gone.append("torch.distributed.distributed_c10d._get_default_timeout reading default_pg_timeout")
    return gone


def check_attributes() -> None:
    """Raise ``UnsupportedVersionError`` naming any private attribute the installed torch lacks."""
    missing("torch", torch.__version__, _absent(), fix=FIX)


check_version(torch.__version__)
check_attributes()


# -- autograd ----------------------------------------------------------------------------------------

def in_backward() -> bool:
    """Whether this thread is inside autograd's execution of a graph: a forward running now is
    activation checkpointing's recomputation (stage 3 gathers its unit again). Private API:
    ``torch._C._current_graph_task_id`` (-1 outside backward; torch.utils.checkpoint uses it
    the same way). torch 2.13 has no public way to ask."""
    return torch._C._current_graph_task_id() != -1


# torch.utils._pytree: flattening the nested tensors of a unit's inputs and outputs. Private
# module (torch 2.13 has no public pytree); used by torch's own checkpoint, compile and export.
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten

# Low-memory construction (owner/construction/materialize.py) intercepts the ops that initialise parameters
# with a dispatch mode, and tells an op overload from other callables. Private names: torch 2.13
# exports neither under a public one.
TorchDispatchMode = _dispatch.TorchDispatchMode
OpOverload = _ops.OpOverload


def storage_key(t: torch.Tensor) -> int:
    """An integer naming the storage under ``t``, equal for every view of it and distinct from
    every other live storage: low-memory construction tells (views of) the meta parameters it
    tracks from other tensors by it. Private: ``UntypedStorage._cdata`` (the storage's C++
    address; torch's own StorageWeakRef and fake tensors name storages by it). No public value
    is exact: ``data_ptr()`` is 0 for every meta storage, and ``id(t.untyped_storage())`` is
    stable only because torch keeps one Python object per live storage, which it does not document."""
    return t.untyped_storage()._cdata


# -- torch.distributed ---------------------------------------------------------------------------------

@contextlib.contextmanager
def default_pg_timeout(seconds: float) -> Iterator[None]:
    """Within this block, process groups formed without a timeout of their own time out after
    ``seconds``. Needed because ``ray.util.collective``'s gloo group calls ``new_group`` with no
    ``timeout=`` (torch's default is 30 minutes), and zero_ray cannot pass one through it; the
    groups zero_ray forms itself pass ``timeout=`` (public). Patches the module global
    ``torch.distributed.distributed_c10d.default_pg_timeout`` (public name, but writing it is
    not a documented API) for the whole process: one formation at a time."""
    saved = _c10d.default_pg_timeout
    _c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    try:
        yield
    finally:
        _c10d.default_pg_timeout = saved


def reset_group_count() -> None:
    """Reset torch.distributed's per-process count of groups formed, as torch's own
    ``destroy_process_group`` does. Needed after a formation that failed half-way: the count
    names the default group's keys in the store, and a count left raised makes this process
    wait on keys no fresh peer writes. Private API: ``_world.group_count`` (torch exposes only
    ``get_pg_count()``, which reads it)."""
    _c10d._world.group_count = 0


# -- torch.compile -----------------------------------------------------------------------------------
# torch.compile(module) returns an OptimizedModule wrapping the original as ``_orig_mod``, and
# module.compile() stores its compiled __call__ in ``_compiled_call_impl``: neither has a public
# way to be recognised or undone in torch 2.13. torch._dynamo is imported by the first compile,
# not here (it costs over a second), so these look it up only once it is loaded.

def compiled_original(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module that ``torch.compile(module)`` wrapped, when ``module`` is such a wrapper;
    otherwise None. Private: ``torch._dynamo.eval_frame.OptimizedModule._orig_mod``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:  # nothing has been compiled in this process
        return None
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is None:
        missing("torch", torch.__version__, ["torch._dynamo.eval_frame.OptimizedModule"], fix=FIX)
    return module._orig_mod if isinstance(module, wrapper) else None


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called (private: ``nn.Module._compiled_call_impl``)."""
    return module._compiled_call_impl is not None


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far: each recompilation adds one.
    Private: ``torch._dynamo.utils.counters`` (torch 2.13 counts them nowhere public)."""
    import torch._dynamo.utils as dynamo_utils

    counters = getattr(dynamo_utils, "counters", None)
    if counters is None:
        missing("torch", torch.__version__, ["torch._dynamo.utils.counters"], fix=FIX)
    return int(counters["frames"]["ok"])
