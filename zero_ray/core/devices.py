"""Device facts and what they allow: the start-up checks of an owner's device and backend, the
driver's choice of device, and the allocator's figures. Pure: the owner probes torch and cupy
into ``DeviceFacts``; nothing here imports ray, grpc, torch or cupy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zero_ray.errors import ConfigError

GPU_EXTRA = "pip install -e '.[gpu]' (from the checkout)"


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What an owner's process can see.

    cuda_available / visible_gpus: torch's view (Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPUs
        it assigned the actor, so an owner that asked for one GPU sees exactly one).
    visible_env: ``CUDA_VISIBLE_DEVICES`` as set (None when unset), for the error text.
    cupy_error: why ``import cupy`` (and its NCCL bindings) failed; None when it worked.
    """

    cuda_available: bool
    visible_gpus: int
    visible_env: str | None = None
    cupy_error: str | None = None


def check_owner_device(facts: DeviceFacts, *, device: str, backend: str, rank: int) -> None:
    """Raise a ``ConfigError`` naming the fix unless ``device`` and ``backend`` can run here: a
    CUDA owner sees exactly one GPU; NCCL has cupy with its NCCL bindings (Ray's NCCL backend
    imports them)."""
    if device == "cuda":
        if not facts.cuda_available or facts.visible_gpus == 0:
            raise ConfigError(f"rank {rank}: device='cuda' but torch sees no GPU (CUDA_VISIBLE_DEVICES="
                              f"{facts.visible_env!r}); give each owner a GPU (Ray num_gpus=1 per owner), or use "
                              "device='cpu'")
        if facts.visible_gpus != 1:
            raise ConfigError(f"rank {rank}: the owner sees {facts.visible_gpus} GPUs (CUDA_VISIBLE_DEVICES="
                              f"{facts.visible_env!r}); each owner must own exactly one. Start owners through Ray, "
                              "which assigns each its GPU, and do not set CUDA_VISIBLE_DEVICES by hand")
    if backend == "nccl":
        if device != "cuda":
            raise ConfigError(f"rank {rank}: backend='nccl' needs device='cuda' (got {device=}); use backend='gloo'")
        if facts.cupy_error is not None:
            raise ConfigError(f"rank {rank}: backend='nccl' needs cupy with NCCL, which Ray's NCCL backend imports: "
                              f"{facts.cupy_error}. Install it with {GPU_EXTRA} (or use backend='gloo')")


@dataclass(frozen=True, kw_only=True)
class DeviceChoice:
    """The device and backend a run uses, and why (the trainer logs ``reason``; as a warning when
    ``warn``: "auto" chose the CPU, which a cluster whose GPU nodes are still to come would
    regret)."""

    device: str
    backend: str
    reason: str
    warn: bool = False


def choose_device(*, device: str, backend: str, cluster_gpus: float, world_size: int,
                  one_machine: bool = False) -> DeviceChoice:
    """The device and backend for ``world_size`` owners on a cluster with ``cluster_gpus`` GPUs now.

    "auto" means CUDA when the cluster has a GPU for every owner now, else the CPU, said loudly
    (``warn``): GPU nodes an autoscaler has yet to start are not counted, since Ray 2.60 tells a
    driver nothing of them (its autoscalers never report their node types to the GCS), and
    waiting for GPUs that may never come would hang a machine with fewer GPUs than owners. A
    cluster whose GPU nodes are autoscaled runs with ``device="cuda"``: its owners' requests for
    GPUs are the autoscaler's demand, and start-up waits for them (``core/capacity.py``). NCCL on
    CUDA, gloo on the CPU, unless ``backend`` says otherwise. The CPU is not warned about on
    ``one_machine`` (every node is the driver's) without a GPU: a laptop, not a cluster to come.
    """
    have = f"{cluster_gpus:g} GPU{'s' if cluster_gpus != 1 else ''}"
    if device == "auto":
        if cluster_gpus >= world_size:
            device, warn = "cuda", False
            reason = f"device='auto' chose CUDA: the cluster has {have} for {world_size} owners"
        else:
            device, warn = "cpu", not (one_machine and cluster_gpus == 0)
            reason = (f"device='auto' chose the CPU: the cluster has {have} now for {world_size} owners (GPU nodes an "
                      "autoscaler could start are not counted). If its GPU nodes are autoscaled or still joining, "
                      "use device='cuda': start-up then waits for them, up to capacity_timeout_s")
    elif device == "cuda":
        reason = f"device='cuda': the cluster has {have} now for {world_size} owners"
        warn = False
    else:
        reason, warn = f"device={device!r}", False
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    return DeviceChoice(device=device, backend=backend, reason=reason, warn=warn)


@dataclass(frozen=True, kw_only=True)
class AllocatorFigures:
    """The CUDA caching allocator's figures, in bytes (``torch.cuda.memory_stats``).

    allocated / reserved: held by tensors / by the allocator from the driver, now.
    peak_allocated / peak_reserved: their highest values since the peaks were last reset.
    fragmentation: reserved but unallocated bytes when allocation peaked, i.e. what the
        allocator held beyond the tensors: ``peak_reserved - peak_allocated`` (the reserved
        peak is reached no earlier than the allocated one, and reserved memory is only given back
        on ``empty_cache``).
    """

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int

    @property
    def fragmentation(self) -> int:
        return max(0, self.peak_reserved - self.peak_allocated)

    def report(self) -> dict[str, int]:
        """As ``memory_report()`` keys."""
        return {"cuda_allocated": self.allocated, "cuda_reserved": self.reserved,
                "cuda_peak_allocated": self.peak_allocated, "cuda_peak_reserved": self.peak_reserved,
                "cuda_fragmentation": self.fragmentation}


def allocator_figures(stats: Mapping[str, int]) -> AllocatorFigures:
    """Read ``torch.cuda.memory_stats()``'s aggregate ("all" pools) counters."""
    def get(key: str) -> int:
        try:
            return int(stats[key])
        except KeyError as err:
            raise ConfigError(f"allocator statistics lack {key!r}; is this torch.cuda.memory_stats()?") from err

    return AllocatorFigures(allocated=get("allocated_bytes.all.current"), reserved=get("reserved_bytes.all.current"),
                            peak_allocated=get("allocated_bytes.all.peak"), peak_reserved=get("reserved_bytes.all.peak"))
