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
from zero_ray.core.reshard import plan_moves
from zero_ray.owner.engine import EngineSpec, OwnerEngine
from zero_ray.owner.resize import bucket_numels, exchange, install, stage_buffers

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

    def resize_info(self) -> dict[str, Any]:
        """What every actor of a resize needs from the current layout (asked of rank 0)."""
        engine = self.engine
        return {"buckets": bucket_numels(engine.layout.buckets), "whole": engine.spec.plan.updates_whole_buffer,
                "kinds": ["master", *engine.spec.optimizer.state_names], "steps_done": engine.steps_done,
                "scale": engine.scaler.scale, "growth_tracker": engine.scaler.growth_tracker}

    def reshard(self, *, old_world: int, new_world: int, generation: int, info: dict[str, Any]) -> int:
        """Move this actor's part of the model state from the ``old_world`` layout to the
        ``new_world`` one (every actor of either calls this concurrently; see owner/resize.py).
        Returns bytes sent. Afterwards a surplus actor (index >= new_world) holds nothing."""
        me, kinds, whole = self.rank, tuple(info["kinds"]), bool(info["whole"])
        moves = plan_moves(info["buckets"], old_world=old_world, new_world=new_world, whole=whole)
        old = self._engine
        if self._group is not None:
            self._group.destroy()
            self._group = None
        self.generation, self.world_size = generation, max(old_world, new_world)
        transfer = self._join()
        staged = (stage_buffers(info["buckets"], rank=me, world_size=new_world, whole=whole, kinds=kinds)
                  if me < new_world else None)
        sent = exchange(moves, me=me, old=old.state.optimizer_slices() if old is not None else None, staged=staged,
                        kinds=kinds, group=transfer, timeout_s=self._options.collective_timeout_s)
        self._engine = old = None  # the old state is no longer needed: free it before building the new
        self.world_size = new_world
        if new_world != transfer.world_size:
            transfer.destroy()
            self._group = None
            if me >= new_world:
                return sent
            self.generation = generation + 1  # the M-rank group gets a name of its own
            group = self._join()
        else:
            group = transfer
        engine = OwnerEngine(self._spec, rank=me, group=group)
        assert staged is not None
        install(staged, engine.state.optimizer_slices())
        engine.steps_done = int(info["steps_done"])
        engine.scaler.scale, engine.scaler.growth_tracker = float(info["scale"]), int(info["growth_tracker"])
        engine.state.publish_masters()
        self._engine = engine
        return sent

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
