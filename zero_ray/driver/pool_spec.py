"""How the owners are placed and started (``PoolSpec``), and what the Ray cluster has room for:
``check_resources`` (a resize's fail-fast check) and ``await_room`` (start-up's bounded wait for
nodes, ``core/capacity.py``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray

from zero_ray.config import ControlTLS
from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig
from zero_ray.core.relay_tree import RelayConfig
from zero_ray.core.capacity import CapacityWait, Room, Verdict, room
from zero_ray.errors import ResourceError
from zero_ray.owner.step.run_spec import RunSpec


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """How to place and start the owners."""

    world_size: int
    tensor_parallel: int = 1  # T: owners r // T form one TP group, placed on one node (core/placement.py)
    use_gpu: bool
    num_cpus_per_owner: float
    backend: str
    placement_strategy: str
    collective_timeout_s: float
    init_timeout_s: float
    capacity_timeout_s: float = 0.0  # start-up's wait for nodes with room for every owner; 0: fail at once
    health_interval_s: float
    health_timeout_s: float
    tls: ControlTLS | None = None
    relays: RelayConfig = RelayConfig()
    snapshot_every: int = 0  # peer snapshots every this many steps; 0: none
    detached: bool = False
    orphan_timeout_s: float = 300.0
    run: RunSpec | None = None  # what an attaching driver reads back (config, optimizer)

    @property
    def demand(self) -> dict[str, float]:
        """One owner's slot."""
        return {"GPU": 1.0, "CPU": 1.0} if self.use_gpu else {"CPU": self.num_cpus_per_owner}

    @property
    def settle_timeout_s(self) -> float:
        """After an abort, how long an owner may take to leave the aborted operation."""
        return max(2 * self.health_timeout_s, 5.0)

    def server_tls(self) -> dict[str, str | None]:
        """The TLS arguments of a control ServerConfig."""
        t = self.tls
        if t is None:
            return {}
        return {"tls_cert": t.cert, "tls_key": t.key, "tls_client_ca": t.ca if t.mutual else None}

    def client_tls(self) -> dict[str, str | None]:
        """The TLS arguments of a control ClientConfig."""
        return client_tls(self.tls)

    def client_config(self, address: str, credentials: Credentials) -> ClientConfig:
        """How the driver reaches the control server at ``address``: an owner's or a relay host's."""
        return ClientConfig(address=address, credentials=credentials, timeout_s=self.init_timeout_s,
                            **self.client_tls())


def client_tls(tls: ControlTLS | None) -> dict[str, str | None]:
    """The TLS arguments of a control ClientConfig for a run configured with ``tls``."""
    if tls is None:
        return {}
    return {"tls_ca": tls.ca, "tls_cert": tls.cert if tls.mutual else None,
            "tls_key": tls.key if tls.mutual else None}


def check_resources(*, world_size: int, use_gpu: bool, num_cpus_per_owner: float) -> None:
    """Fail fast, naming the resources, when the cluster can never host the owners."""
    total = ray.cluster_resources()
    if use_gpu:
        need, have, what = float(world_size), total.get("GPU", 0.0), "GPU"
        hint = "lower world_size or add GPU nodes"
    else:
        need, have, what = world_size * num_cpus_per_owner, total.get("CPU", 0.0), "CPU"
        hint = ("lower world_size, add nodes, or start Ray with more logical CPUs "
                "(ray.init(num_cpus=...)); or lower num_cpus_per_owner")
    if have < need:
        raise ResourceError(f"world_size={world_size} needs {need:g} {what} ({'1 GPU' if use_gpu else f'{num_cpus_per_owner:g} CPU'} "
                            f"per partition owner) but the Ray cluster has {have:g} {what}; {hint}")


log = logging.getLogger(__name__)
ROOM_POLL_S = 1.0  # how often start-up looks at the cluster's nodes while it waits for room


def cluster_room(*, owners: int, demand: dict[str, float]) -> Room:
    """What the live nodes can hold of ``owners`` owners of ``demand``, now."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return room(owners=owners, demand=demand, nodes=nodes, free=ray.available_resources())


def await_room(*, owners: int, demand: dict[str, float], bound_s: float) -> float:
    """Wait until the live nodes can hold ``owners`` owners of ``demand`` (a pool's owners already
    created, so that their pending requests are what an autoscaler sees), logging what it waits
    for; ``ResourceError`` after ``bound_s`` with room still missing. Returns the seconds waited."""
    start = time.monotonic()
    wait = CapacityWait(bound_s=bound_s, started_s=start)
    while True:
        now = time.monotonic()
        current = cluster_room(owners=owners, demand=demand)
        verdict = wait.check(current, now)
        if verdict is Verdict.READY:
            if wait.reported_s is not None:
                log.warning("the cluster has room for all %d owners after %.0fs", owners, now - start)
            return now - start
        if verdict is Verdict.REPORT:
            log.warning("%s", current.waiting(waited_s=now - start, bound_s=bound_s))
        time.sleep(min(ROOM_POLL_S, max(0.0, start + bound_s - now)))


def cluster_is_local() -> bool:
    """Every node of the cluster is this machine: the control plane can stay on loopback."""
    try:
        here = ray.util.get_node_ip_address()
        return all(n.get("NodeManagerAddress") == here for n in ray.nodes() if n.get("Alive"))
    except Exception:
        return False
