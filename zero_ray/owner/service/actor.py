"""PartitionOwner: the Ray actor that owns one rank's partition.

The actor is a thin shell around a ``LiveRank`` (owner/service/live_rank.py: the rank's place in
the pool, its collective group, its OwnerEngine and the membership operations that change them).
It serves the gRPC control plane on its own threads (every control operation: setup, step,
evaluate, reform, rebuild, reshard, snapshots, save, load, stats, status, abort, health, close;
see owner/service/owner_control.py, which is given the LiveRank). Its Ray methods are only the
bootstrap (``node``: where it runs and its control address; ``credentials`` and ``run_spec``:
what a driver attaching to a detached run needs before it can speak gRPC) and the data path
(``stage_batch``, ``register_dataset``, ``use_filesystem``, ``master_fragments``); the driver
calls no other (tests/unit/test_control_rule.py). Model state never leaves it except through
collectives (and the explicit consolidation ``master_fragments``).

A detached run's owners (``ElasticConfig(detached=True)``) outlive the driver; each ends itself
when no driver has been in touch for ``orphan_timeout_s`` (``ZeroTrainer.attach`` reattaches).
So does an owner started ahead of a grow (``OwnerOptions.standby``): no driver speaks to it
before the grow takes it in, so one its driver never takes in ends ``orphan_timeout_s`` after its
start.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from zero_ray.control.auth import Credentials
from zero_ray.control.client_channel import ClientConfig
from zero_ray.control.heap_freeze import freeze_heap
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.server import ControlServer, ServerConfig, format_address
from zero_ray.checkpoint.location import register_filesystem
from zero_ray.compat import ray_private
from zero_ray.core.ray_names import NAMESPACE, desired_size_key
from zero_ray.owner.service.live_rank import GroupSettings, LiveRank
from zero_ray.owner.service.owner_control import DriverContact, OwnerControl, OwnerPlace
from zero_ray.owner.step.engine import OwnerEngine
from zero_ray.owner.step.run_spec import EngineSpec, RunSpec

log = logging.getLogger(__name__)

# A relay host serves a Watch stream and a RelayStep (two, with fit's step sent ahead) per relay
# it hosts, one level each, beside its own Step, Abort, probes and Health streams.
_CONTROL_THREADS = 32
_CONTROL_STREAMS = 12


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
    client_tls: dict[str, str | None]  # ClientConfig's tls_ca / tls_cert / tls_key: a relay's calls to its children
    save_timeout_s: float = 600.0  # how long a Save may wait for this rank's file to be durable
    snapshot_every: int = 0  # peer snapshots every this many steps; 0: no in-memory redundancy
    settle_timeout_s: float = 10.0  # after an abort: how long an operation waits for the aborted one to end
    detached: bool = False  # the owners outlive the driver (ElasticConfig.detached)
    orphan_timeout_s: float = 300.0  # a detached owner no driver has reached for this long ends itself
    run: RunSpec | None = None  # what a driver attaching to a detached run rebuilds itself from
    # Started ahead of a grow (driver/replacements.py): not a member until a membership operation
    # takes it in; its Status says so, and an attaching driver ends it instead of adopting it.
    standby: bool = False


def prepare_process() -> None:
    """An owner's first act: import what its first engine would import lazily, then move the
    heap out of full collections (``control/heap_freeze.py``).

    torch.optim's first optimizer imports torch._dynamo (and sympy): about 1.2 s and 117,000
    objects. Left to the first engine, a replacement paid it inside the grow that takes it in,
    every rank waiting for it in ``publish_masters``, and those objects, tracked after the freeze,
    made every group teardown's full collection (``RingGroup.destroy``) walk them, on every rank,
    once per grow and twice per shrink. Measured on a 2-core machine at load 7-12, the soak's
    shape, 6 of each: a 3 -> 4 grow took 1.75-2.27 s (1.19-1.64 s of it that import), now
    0.21-0.39 s; a 4 -> 3 shrink 0.87-1.45 s, now 0.29-0.39 s. A replacement now pays the import
    while it starts, before it answers, off the step path."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # a throwaway: the lazy imports are its class's
    # Before any group forms: a full collection of this heap would hold the relays it may host.
    freeze_heap()


class PartitionOwner:
    """One rank's Ray actor: its control server around its LiveRank."""

    def __init__(self, *, rank: int, world_size: int, spec: EngineSpec, options: OwnerOptions) -> None:
        prepare_process()
        self._options = options
        self._rank = LiveRank(rank=rank, world_size=world_size, spec=spec,
                              settings=GroupSettings(backend=options.backend, group_prefix=options.group_prefix,
                                                     collective_timeout_s=options.collective_timeout_s,
                                                     settle_timeout_s=options.settle_timeout_s,
                                                     snapshot_every=options.snapshot_every))
        self._contact = DriverContact(standby=options.standby)  # of a driver: any control call, a heartbeat served
        torch.set_num_threads(max(1, options.threads))
        host = options.control_host or ("127.0.0.1" if options.local_cluster else ray.util.get_node_ip_address())
        # Every control operation is served here, the long ones (a step, a reshard or rebuild
        # waiting on the step lock) beside Abort, Stats probes and up to max_streams heartbeat
        # streams (an old monitor's and its replacement's during a membership change).
        self._server = ControlServer(ServerConfig(host=host, credentials=options.credentials, threads=_CONTROL_THREADS,
                                                  max_streams=_CONTROL_STREAMS, **options.server_tls))
        place = OwnerPlace(node_id=ray.get_runtime_context().get_node_id(), host=socket.gethostname(),
                           ip=ray.util.get_node_ip_address(), pid=os.getpid())
        self._server.add_owner(OwnerControl(self._rank, contact=self._contact, server=self._server, place=place,
                                            detached=options.run is not None and options.run.detached,
                                            fetch_timeout_s=options.collective_timeout_s,
                                            save_timeout_s=options.save_timeout_s,
                                            ahead_timeout_s=options.collective_timeout_s))
        # The relays this process serves, when the driver's tree has it host some (HostRelays).
        self._relays = RelayHost(rank=rank, template=ClientConfig(
            address=format_address(host, 1),  # each child's address replaces it
            credentials=options.credentials, timeout_s=options.collective_timeout_s, **options.client_tls))
        self._server.add_relay(self._relays)
        self._server.start()
        if options.detached:
            threading.Thread(target=self._watch_for_driver, name="zero_ray-orphan", daemon=True).start()

    def node(self) -> dict[str, Any]:
        """Where this owner runs: Ray node id, host, IP, process id, control address and actor
        name (the driver checks liveness by the name, without calling the actor)."""
        ctx = ray.get_runtime_context()
        return {"rank": self._rank.rank, "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "control_address": self._server.address,
                "name": ctx.get_actor_name()}

    # -- data ----------------------------------------------------------------------------------------
    def stage_batch(self, key: str, piece: Any) -> None:
        """Hold this owner's piece of a global batch until the Step or Evaluate naming ``key``
        takes it (Ray resolved the driver's object reference into ``piece``)."""
        self._rank.data.stage(key, piece)

    def register_dataset(self, name: str, source: Any, *, factory: bool, collate: Any) -> int:
        """Hold a dataset (or build it with the factory ``source``) for fit(); returns its length."""
        return self._rank.data.register(name, source, factory=factory, collate=collate)

    def use_filesystem(self, key: str, fs: Any) -> None:
        """Hold a checkpoint filesystem object the driver was given (saves and loads name it by key)."""
        register_filesystem(fs, key)

    @property
    def engine(self) -> OwnerEngine:
        """This rank's engine (raises before setup)."""
        return self._rank.engine

    def master_fragments(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        return self._rank.engine.master_fragments()

    # -- a driver reattaching ------------------------------------------------------------------------
    def credentials(self) -> Credentials:
        """The control plane's credentials, for a driver attaching through Ray (an authenticated
        channel: whoever may call this actor may already stop it)."""
        return self._options.credentials

    def run_spec(self) -> RunSpec | None:
        """What a driver attaching to this run rebuilds itself from: its ZeroConfig (the control
        plane's TLS settings among them, needed before speaking gRPC), optimizer and scheduler
        factories. Python objects, so they travel through Ray like the other data."""
        return self._options.run

    def _watch_for_driver(self) -> None:
        """A detached owner that no driver has reached for ``orphan_timeout_s`` ends itself; a
        member also drops its run's desired size (a standby no grow took in does not: its run
        may go on)."""
        limit = self._options.orphan_timeout_s
        stop = threading.Event()
        while not stop.wait(min(1.0, limit / 10)):
            if time.monotonic() - self._contact.last > limit:
                log.warning("rank %d: no driver for %.0fs (orphan_timeout_s); ending", self._rank.rank, limit)
                try:
                    if not self._contact.standby:
                        self._drop_desired_size(timeout_s=5.0)
                    self.close()
                finally:
                    os._exit(0)

    def _drop_desired_size(self, *, timeout_s: float) -> None:
        """Delete the run's desired size from Ray's key-value store (driver/desired_size.py): a
        driver shutting the run down would have; with every member ending no driver can attach
        to read it. Every member deletes it (whichever ends first; deleting twice is harmless),
        waiting at most ``timeout_s``: the owner ends either way."""
        key = desired_size_key(self._options.credentials.job_id)  # the job id is the run's id

        def delete() -> None:
            try:
                ray_private.kv_delete(key, namespace=NAMESPACE)
            except Exception as err:  # Ray's GCS unreachable: the key outlives the run, as before
                log.warning("rank %d: the run's desired size was not deleted: %s", self._rank.rank, err)

        deleting = threading.Thread(target=delete, name="zero_ray-orphan-kv", daemon=True)
        deleting.start()
        deleting.join(timeout_s)

    def close(self) -> None:
        """Stop serving and leave the collective group so the process can exit cleanly."""
        self._server.stop(grace_s=0.5)
        self._relays.close()
        self._rank.release()


RemotePartitionOwner = ray.remote(PartitionOwner)
