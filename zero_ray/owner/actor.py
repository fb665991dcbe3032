"""PartitionOwner: the Ray actor that owns one rank's partition.

The actor is a thin shell: it serves the gRPC control plane (step, abort, health, stats) on
its own threads, joins the collective group of the current generation, builds an OwnerEngine
and forwards calls to it. Model state never leaves it except through collectives (and the
explicit consolidation ``master_fragments``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import ray
import torch

from zero_ray.collective.group import Collective
from zero_ray.collective.ray_group import destroy_group, form_group
from zero_ray.control.auth import Credentials
from zero_ray.control.server import ControlServer, ServerConfig, serve_owner
from zero_ray.owner.checkpointing import ShardSaver
from zero_ray.owner.control import OwnerControl
from zero_ray.owner.engine import EngineSpec, OwnerEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OwnerOptions:
    """How an owner joins its run."""

    backend: str
    group_prefix: str
    collective_timeout_s: float
    threads: int
    credentials: Credentials
    control_host: str | None  # None: this node's IP from Ray (loopback when the cluster is local)
    local_cluster: bool
    server_tls: dict[str, str | None]  # ServerConfig's tls_cert / tls_key / tls_client_ca
    save_timeout_s: float = 600.0  # how long a Save may wait for this rank's file to be durable


class PartitionOwner:
    """One rank: its control server, its collective group membership and its OwnerEngine."""

    def __init__(self, *, rank: int, world_size: int, spec: EngineSpec, options: OwnerOptions) -> None:
        self.rank = rank
        self.world_size = world_size
        self.generation = 0
        self._spec = spec
        self._options = options
        self._engine: OwnerEngine | None = None
        self._group: Collective | None = None
        self.saver = ShardSaver()
        torch.set_num_threads(max(1, options.threads))
        host = options.control_host or ("127.0.0.1" if options.local_cluster else ray.util.get_node_ip_address())
        self._server: ControlServer = serve_owner(
            OwnerControl(self, fetch_timeout_s=options.collective_timeout_s, save_timeout_s=options.save_timeout_s),
            ServerConfig(host=host, credentials=options.credentials, **options.server_tls))

    def node(self) -> dict[str, Any]:
        """Where this owner runs: Ray node id, host, IP, process id and control address."""
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "control_address": self._server.address}

    def _group_name(self) -> str:
        return f"{self._options.group_prefix}-g{self.generation}"

    def _join(self) -> Collective:
        o = self._options
        self._group = form_group(backend=o.backend, group_name=self._group_name(), rank=self.rank,
                                 world_size=self.world_size, timeout_s=o.collective_timeout_s)
        return self._group

    def setup(self) -> dict[str, Any]:
        """Join the group (all ranks concurrently) and build the model state."""
        self._engine = OwnerEngine(self._spec, rank=self.rank, group=self._join())
        layout = self._engine.layout
        return {"rank": self.rank, "numel": layout.numel, "padded_numel": layout.padded_numel,
                "buckets": len(layout.buckets), "shapes": {p.name: list(p.shape) for p in layout.params}}

    @property
    def engine(self) -> OwnerEngine:
        if self._engine is None:
            raise RuntimeError("setup() has not run on this owner")
        return self._engine

    @property
    def engine_or_none(self) -> OwnerEngine | None:
        return self._engine

    def abort(self, *, reason: str, generation: int) -> bool:
        """Tear down this generation's group so that collectives blocked on it fail (called
        from a gRPC thread). Returns whether a step was in flight."""
        if generation != self.generation or self._group is None:
            return False
        log.warning("rank %d aborting generation %d: %s", self.rank, generation, reason)
        busy = self._engine is not None and self._engine.phase.value != "idle"
        # Tearing down may block while this rank's own compute thread waits inside the group;
        # the point is to close its sockets for the peers, so do it without holding the caller.
        threading.Thread(target=self._group.abort, name="zero_ray-abort", daemon=True).start()
        return busy

    def reform(self, generation: int) -> bool:
        """Leave the current group and join ``generation``'s (all ranks concurrently); forget
        the interrupted step. Returns whether the model state is still consistent."""
        if self._group is not None:
            self._group.abort()
        self.generation = generation
        consistent = self.engine.discard_step()
        self.engine.rebind(self._join())
        return consistent

    def memory_report(self) -> dict[str, int]:
        return self.engine.memory_report()

    def comm_report(self) -> dict[str, int]:
        return self.engine.comm_report()

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self.engine.master_fragments()

    def close(self) -> None:
        """Stop serving and leave the collective group so the process can exit cleanly."""
        self._server.stop(grace_s=0.5)
        self.saver.close()
        if self._engine is not None and self.world_size > 1:
            destroy_group(self._group_name())
        self._engine = None


RemotePartitionOwner = ray.remote(PartitionOwner)
