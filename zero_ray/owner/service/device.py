"""An owner's device at start-up: probe what the process can see, check it against the run's
device and backend (``core.devices``), and make the owner's one GPU current."""

from __future__ import annotations

import os

import torch

from zero_ray.core.devices import DeviceFacts, check_owner_device


def _cupy_error() -> str | None:
    """Why Ray's NCCL backend could not load here (None: it can)."""
    try:
        import cupy  # noqa: F401  (Ray's NCCL backend imports it; so do we, to fail early)
        from cupy.cuda import nccl

        nccl.get_version()
    except Exception as err:  # ImportError, or a cupy built without NCCL / a missing libnccl
        return f"{type(err).__name__}: {err}"
    return None


def probe(*, need_nccl: bool) -> DeviceFacts:
    """What this process can see (cupy is only imported when NCCL is wanted)."""
    available = torch.cuda.is_available()
    return DeviceFacts(cuda_available=available, visible_gpus=torch.cuda.device_count() if available else 0,
                       visible_env=os.environ.get("CUDA_VISIBLE_DEVICES"),
                       cupy_error=_cupy_error() if need_nccl else None)


def setup_device(*, device: str, backend: str, rank: int, facts: DeviceFacts | None = None) -> torch.device:
    """Check that this owner can run ``device``/``backend`` (a ``ConfigError`` naming the fix
    otherwise) and make its GPU current: Ray sets ``CUDA_VISIBLE_DEVICES`` to the one GPU it
    assigned the actor, which torch then numbers 0."""
    facts = facts if facts is not None else probe(need_nccl=backend == "nccl")
    check_owner_device(facts, device=device, backend=backend, rank=rank)
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)
