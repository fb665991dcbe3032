"""A simulated multi-node Ray cluster on this machine: K Ray nodes, each in a network namespace
of its own, every node's only link shaped by ``tc`` (rate) and delayed (netem, or a delay line).

Layout, for the cluster of process P (names carry P in hex, so leftovers of a dead process are
recognisable and removed by ``sweep``):

    namespace zrsim-<P>-n<k>:  lo, and ``zrsim0`` (198.18.213.<k+1>/24): the node's only link,
                               egress shaped with netem (delay + rate), or with tbf (rate)
    root namespace, netem:     bridge zrs<P>b (no address), veth ends zrs<P>h<k> on it
    root namespace, no netem:  the delay line (benchmarks/harness/delayline.py), a process
                               holding every node's ``zrsim0`` as a TUN device (created as
                               zrs<P>t<k>, then moved into the node's namespace)

The kernels this project runs on have no netem, and no other qdisc delays packets by a fixed
time; where a delay is asked for and netem is missing, the nodes are joined by the delay line
instead of the bridge (``link`` says which). Only addresses inside those namespaces are used
(198.18.0.0/15 is the range set aside for network benchmarks); the bridge has no address, the
delay line forwards only between the nodes' addresses, and no route leads out. Ray runs
``ray start`` inside each namespace with ``--node-ip-address`` (head in n0, token auth, no
dashboard) and ``GLOO_SOCKET_IFNAME=zrsim0`` in its environment (the owners inherit it), since
gloo would otherwise bind by hostname to 127.0.0.1. Drivers run inside n0 (``run_in_head``).
A link cut (``cut_link``, ``SimCluster.cut``) sets a node's ``zrsim0`` down inside its namespace
while every process on it runs; ``restore_link`` sets it up again.
Cross-node bytes are counted by the kernel: everything node k sends to another node leaves
through its ``zrsim0`` (its tx counter; ``cross_node_bytes``).

Teardown (``close``: in ``finally``, at process exit, and for a dead process's leftovers in
``sweep``) stops every process it started, by pid and by the Ray temp dirs it made, then every
process still inside its namespaces, then deletes the namespaces and the bridge by name (the
delay line's devices go with its process and the namespaces). Every wait is bounded. Needs root
and ``ip``/``tc``; ``available()`` says why not when it can't.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.netdev import parse_net_dev

SUBNET = "198.18.213"
IFNAME = "zrsim0"
CMD_TIMEOUT_S = 20.0
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
GCS_PORT = 6379
TUN_MTU = 65000  # the delay line forwards one packet per write: large packets keep it cheap


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=check)


def _ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _ip("netns", "exec", ns, *args, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"zrsim-{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"ip netns add failed: {err}"
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "delete", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_pids(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL what is left after STOP_GRACE_S (bounded)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pids.discard(pid)
        deadline = time.monotonic() + STOP_GRACE_S
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p) and not _zombie(p)}
            if pids:
                time.sleep(0.1)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] == "Z"


def _mentioning(text: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.add(int(entry.name))
            except OSError:
                continue
    found.discard(os.getpid())
    return found


def _ns_pids(ns: str) -> set[int]:
    got = _ip("netns", "pids", ns, check=False)
    return {int(p) for p in got.stdout.split() if p.isdigit()} - {os.getpid()}


def cross_node_bytes(namespaces: list[str]) -> int:
    """Bytes the nodes have sent each other so far: the tx counters of each node's only link,
    read inside its namespace (so from any namespace, as root)."""
    total = 0
    for ns in namespaces:
        total += parse_net_dev(_ns(ns, "cat", "/proc/net/dev").stdout)[IFNAME].tx_bytes
    return total


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried on a namespace's loopback, then removed)."""
    probe = f"zrsim-{os.getpid()}-netem"
    _ip("netns", "add", probe)
    try:
        return _ns(probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _ip("netns", "delete", probe, check=False)


def kill_node(namespace: str) -> list[int]:
    """Lose a simulated node at once: SIGKILL every process in its namespace (its raylet, its
    Ray workers and owners), as a machine that dies does. Returns the pids killed."""
    pids = sorted(_ns_pids(namespace))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def start_node(namespace: str, *, ip: str, address: str, cpus: int, env: dict[str, str],
               log: str) -> subprocess.Popen[bytes]:
    """``ray start`` a worker node in ``namespace`` again (after ``kill_node``), joining the head
    at ``address``: what a node's supervisor does. Its processes live in the namespace, so the
    cluster's teardown stops them with the rest."""
    with open(log, "ab") as out:
        return subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-m", "ray.scripts.scripts",
                                 "start", "--block", f"--address={address}", f"--node-ip-address={ip}",
                                 f"--num-cpus={cpus}", "--num-gpus=0", "--disable-usage-stats"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def cut_link(namespace: str) -> None:
    """Cut a simulated node off the others while every process on it lives: its only link set
    down inside its namespace. Its own sends fail at once (no route); what the others send it
    is lost on the way, as over a cut cable. ``restore_link`` ends the cut."""
    _ns(namespace, "ip", "link", "set", IFNAME, "down")


def restore_link(namespace: str) -> None:
    """End ``cut_link``: the link up again (its address and route come back with it, and any
    qdisc shaping it stays as it was)."""
    _ns(namespace, "ip", "link", "set", IFNAME, "up")


def shape_link(namespace: str, *, mbit: float, delay_ms: float, netem: bool) -> None:
    """Reshape a node's link as ``SimCluster`` shapes it at the start (netem's delay and rate
    where the kernel has netem, else a token bucket at the rate, no delay): a degraded link,
    and back."""
    if netem:
        _ns(namespace, "tc", "qdisc", "replace", "dev", IFNAME, "root", "netem", "delay", f"{delay_ms:g}ms",
            "rate", f"{mbit:g}mbit", "limit", "100000")
        return
    burst = max(TUN_MTU + 1024, int(mbit * 1e6 / 8 / 100))
    _ns(namespace, "tc", "qdisc", "replace", "dev", IFNAME, "root", "tbf", "rate", f"{mbit:g}mbit", "burst",
        str(burst), "latency", "100ms")


def link_shape(namespace: str) -> str:
    """The root qdisc on the node's link, as ``tc`` prints it (the proof a reshape took)."""
    return _ns(namespace, "tc", "qdisc", "show", "dev", IFNAME).stdout.strip().splitlines()[0]


def link_up(namespace: str) -> bool:
    """Whether the node's only link is administratively up (read inside its namespace)."""
    got = _ns(namespace, "ip", "-o", "link", "show", IFNAME)
    flags = re.search(r"<([^>]*)>", got.stdout)
    return flags is not None and "UP" in flags.group(1).split(",")


def reachable(namespace: str, ip: str, port: int, *, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection from inside ``namespace`` to ``ip:port`` opens within
    ``timeout_s`` (bash's /dev/tcp: no interpreter to start, so it is cheap on a loaded machine)."""
    try:
        got = _ns(namespace, "timeout", f"{timeout_s:g}", "bash", "-c", f"exec 3<>/dev/tcp/{ip}/{port}", check=False)
    except subprocess.TimeoutExpired:
        return False
    return got.returncode == 0


def _remove(tag: str, namespaces: list[str], temp_dirs: list[Path], pids: set[int]) -> None:
    """Stop the processes, then delete namespaces and links by name (never raises)."""
    for d in temp_dirs:
        pids |= _mentioning(str(d))
    for ns in namespaces:
        pids |= _ns_pids(ns)
    _kill_pids(pids)
    for ns in namespaces:
        _kill_pids(_ns_pids(ns))
        _ip("netns", "delete", ns, check=False)
    # The veth ends go with their namespace's deletion, but later (the kernel cleans a namespace
    # up asynchronously): delete them and the bridge by name now.
    for line in _ip("-o", "link", "show", check=False).stdout.split("\n"):
        m = re.match(rf"\d+: (zrs{tag}[bh]\d*)[:@]", line)
        if m:
            _ip("link", "delete", m.group(1), check=False)
    for d in temp_dirs:
        shutil.rmtree(d, ignore_errors=True)


def sweep() -> list[str]:
    """Remove the namespaces and bridges of simulated clusters whose process is gone; returns
    the names removed."""
    spaces: dict[int, list[str]] = {}
    for line in _ip("netns", "list", check=False).stdout.split("\n"):
        m = re.match(r"(zrsim-(\d+)-(?:n\d+|netem|probe))", line.strip())
        if m:
            spaces.setdefault(int(m.group(2)), []).append(m.group(1))
    bridges: dict[int, str] = {}
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.split("\n"):
        m = re.search(r"\d+: (zrs([0-9a-f]{6})b)[:@]", line)
        if m:
            bridges[int(m.group(2), 16)] = m.group(1)
    removed: list[str] = []
    for pid in sorted(set(spaces) | set(bridges)):
        if not _alive(pid):
            _remove(f"{pid:06x}", spaces.get(pid, []), [], set())
            removed += spaces.get(pid, []) + ([bridges[pid]] if pid in bridges else [])
    return removed


@dataclass(kw_only=True)
class SimNode:
    index: int
    namespace: str
    ip: str
    temp_dir: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass(kw_only=True)
class SimCluster:
    """K Ray nodes in namespaces (see the module docstring). Use as a context manager."""

    nodes: int
    cpus_per_node: int
    link_mbit: float
    delay_ms: float
    start_ray: bool = True  # False: the namespaces and links only (to test the network itself)
    ray_env: dict[str, str] = field(default_factory=dict)  # more environment for every node (RAY_health_check_*)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    members: list[SimNode] = field(default_factory=list)
    _pids: set[int] = field(default_factory=set)
    _closed: bool = False
    link: str = ""  # how the nodes are joined and shaped, in words (set by _network)

    def __post_init__(self) -> None:
        self.tag = f"{os.getpid():06x}"
        if len(self.tag) > 6:
            raise RuntimeError(f"pid {os.getpid()} does not fit the 15-character interface names")

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> SimCluster:
        atexit.register(self.close)
        try:
            sweep()
            self._network()
            if self.start_ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for n in self.members:
            if n.proc is not None:
                self._pids.add(n.proc.pid)
        _remove(self.tag, [n.namespace for n in self.members], [n.temp_dir for n in self.members], set(self._pids))

    # -- the network --------------------------------------------------------------------------------
    def _network(self) -> None:
        netem = netem_available()
        for k in range(self.nodes):
            ns = f"zrsim-{os.getpid()}-n{k}"
            self.members.append(SimNode(index=k, namespace=ns, ip=f"{SUBNET}.{k + 1}",
                                        temp_dir=Path(tempfile.mkdtemp(prefix=f"zrsim{k}-", dir="/tmp"))))
            _ip("netns", "add", ns)
        if netem or self.delay_ms == 0:
            self._bridge()
        else:
            self._delay_line()
        rate = f"{self.link_mbit:g}mbit"
        for n in self.members:
            _ns(n.namespace, "ip", "addr", "add", f"{n.ip}/24", "dev", IFNAME)
            _ns(n.namespace, "ip", "link", "set", IFNAME, "up")
            _ns(n.namespace, "ip", "link", "set", "lo", "up")
            if netem:
                _ns(n.namespace, "tc", "qdisc", "add", "dev", IFNAME, "root", "netem", "delay",
                    f"{self.delay_ms:g}ms", "rate", rate, "limit", "100000")
            else:
                # burst: at least one 10 ms tick's worth of bytes (so the rate is reached) and one packet
                burst = max(TUN_MTU + 1024, int(self.link_mbit * 1e6 / 8 / 100))
                _ns(n.namespace, "tc", "qdisc", "add", "dev", IFNAME, "root", "tbf", "rate", rate, "burst",
                    str(burst), "latency", "100ms")
        self.link = (f"netem: {self.link_mbit:g} Mbit/s, {self.delay_ms:g} ms delay" if netem else
                     f"tbf {self.link_mbit:g} Mbit/s, " + ("no delay" if self.delay_ms == 0 else
                     f"{self.delay_ms:g} ms delay by a user-space delay line (no netem in this kernel)"))

    def _bridge(self) -> None:
        """Each node's ``zrsim0`` is a veth whose other end is on a bridge in the root namespace."""
        bridge = f"zrs{self.tag}b"
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for n in self.members:
            host, peer = f"zrs{self.tag}h{n.index}", f"zrs{self.tag}e{n.index}"
            _ip("link", "add", host, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", n.namespace)
            _ns(n.namespace, "ip", "link", "set", peer, "name", IFNAME)
            _ip("link", "set", host, "master", bridge)
            _ip("link", "set", host, "up")

    def _delay_line(self) -> None:
        """Each node's ``zrsim0`` is a TUN device of the delay line, which forwards between them."""
        names = [f"zrs{self.tag}t{n.index}" for n in self.members]
        cmd = [sys.executable, "-m", "benchmarks.harness.delayline", "--names", ",".join(names),
               "--ips", ",".join(n.ip for n in self.members), "--delay-ms", f"{self.delay_ms:g}",
               "--parent-pid", str(os.getpid())]
        repo = str(Path(__file__).resolve().parent.parent.parent)
        log = self.members[0].temp_dir / "delayline.log"
        with log.open("wb") as err_out:
            proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=err_out, start_new_session=True)
        self._pids.add(proc.pid)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], CMD_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"READY":
            _kill_pids({proc.pid})
            raise RuntimeError(f"the delay line did not start within {CMD_TIMEOUT_S:g}s: {line!r} "
                               f"{log.read_text(errors='replace')[-2000:]}")
        for n, name in zip(self.members, names):
            _ip("link", "set", name, "netns", n.namespace)
            _ns(n.namespace, "ip", "link", "set", name, "name", IFNAME)
            _ns(n.namespace, "ip", "link", "set", IFNAME, "mtu", str(TUN_MTU))

    def cut(self, index: int) -> None:
        """Cut node ``index``'s link (``cut_link``); every process on it goes on running."""
        cut_link(self.members[index].namespace)

    def restore(self, index: int) -> None:
        """Restore node ``index``'s link (``restore_link``)."""
        restore_link(self.members[index].namespace)

    def cross_node_bytes(self) -> int:
        """Bytes every node has sent to the others so far (see the module function)."""
        return cross_node_bytes([n.namespace for n in self.members])

    # -- Ray ----------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                    "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": IFNAME})
        env.update(self.ray_env)
        return env

    @property
    def address(self) -> str:
        return f"{self.members[0].ip}:{GCS_PORT}"

    def _start_ray(self) -> None:
        for n in self.members:
            head = n.index == 0
            role = (["--head", f"--port={GCS_PORT}", "--include-dashboard=false"] if head
                    else [f"--address={self.address}"])
            cmd = ["ip", "netns", "exec", n.namespace, sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                   *role, f"--node-ip-address={n.ip}", f"--temp-dir={n.temp_dir}" if head else "",
                   f"--num-cpus={self.cpus_per_node}", "--num-gpus=0", "--disable-usage-stats"]
            log = (n.temp_dir / "ray.log").open("wb")
            n.proc = subprocess.Popen([c for c in cmd if c], env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            self._pids.add(n.proc.pid)
            if head:
                self._wait_nodes(1)
        self._wait_nodes(self.nodes)

    def _wait_nodes(self, count: int) -> None:
        """Until ``count`` nodes are alive (asked from inside the head's namespace), bounded."""
        probe = ("import ray,sys; ray.init(address='%s', log_to_driver=False); "
                 "print(sum(1 for n in ray.nodes() if n['Alive'])); ray.shutdown()") % self.address
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            for n in self.members:
                if n.proc is not None and n.proc.poll() is not None:
                    raise RuntimeError(f"ray start on node {n.index} exited with {n.proc.returncode}: "
                                       f"{(n.temp_dir / 'ray.log').read_text(errors='replace')[-3000:]}")
            try:
                got = self.run_in_head([sys.executable, "-c", probe], timeout_s=60)
                last = got.stdout.strip().splitlines()[-1] if got.stdout.strip() else got.stderr[-500:]
                if got.returncode == 0 and int(last) >= count:
                    return
            except (subprocess.TimeoutExpired, ValueError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{count} simulated Ray nodes were not up within {START_TIMEOUT_S:g}s (last: {last})")

    def run_in_head(self, argv: list[str], *, timeout_s: float, cwd: str | None = None,
                    extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the head node's namespace with the cluster's environment
        (``RAY_ADDRESS`` set), bounded by ``timeout_s``; its output is returned."""
        env = {**self.env(), "RAY_ADDRESS": self.address, **(extra_env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.members[0].namespace, *argv], env=env, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._pids.add(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_pids({proc.pid})
            proc.communicate(timeout=STOP_GRACE_S)
            raise
        finally:
            self._pids.discard(proc.pid)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)
