"""PartitionOwner: the Ray actor that owns one rank's partition.

The actor is a thin shell: it joins the collective group, builds an OwnerEngine and forwards
calls to it. Model state never leaves it except through collectives (and the explicit
consolidation ``master_fragments``).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
import torch

from zero_ray.collective.ray_group import destroy_group, form_group
from zero_ray.core.batching import Batch
from zero_ray.owner.engine import EngineSpec, OwnerEngine, StepResult


class PartitionOwner:
    """One rank: its collective group membership and its OwnerEngine."""

    def __init__(self, *, rank: int, world_size: int, spec: EngineSpec, backend: str, group_name: str,
                 collective_timeout_s: float, threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._spec = spec
        self._backend = backend
        self._group_name = group_name
        self._timeout_s = collective_timeout_s
        self._engine: OwnerEngine | None = None
        torch.set_num_threads(max(1, threads))

    def node(self) -> dict[str, Any]:
        """Where this owner runs: Ray node id, host name, IP and process id."""
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def setup(self) -> dict[str, Any]:
        """Join the group (all ranks concurrently) and build the model state."""
        group = form_group(backend=self._backend, group_name=self._group_name, rank=self.rank,
                           world_size=self.world_size, timeout_s=self._timeout_s)
        self._engine = OwnerEngine(self._spec, rank=self.rank, group=group)
        layout = self._engine.layout
        return {"rank": self.rank, "numel": layout.numel, "padded_numel": layout.padded_numel,
                "buckets": len(layout.buckets), "shapes": {p.name: list(p.shape) for p in layout.params}}

    @property
    def engine(self) -> OwnerEngine:
        if self._engine is None:
            raise RuntimeError("setup() has not run on this owner")
        return self._engine

    def step(self, piece: Batch, lr: float, global_samples: int) -> StepResult:
        return self.engine.step(piece, lr=lr, global_samples=global_samples)

    def memory_report(self) -> dict[str, int]:
        return self.engine.memory_report()

    def comm_report(self) -> dict[str, int]:
        return self.engine.comm_report()

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self.engine.master_fragments()

    def close(self) -> None:
        """Leave the collective group so the process can exit cleanly."""
        if self._engine is not None and self.world_size > 1:
            destroy_group(self._group_name)
        self._engine = None


RemotePartitionOwner = ray.remote(PartitionOwner)
