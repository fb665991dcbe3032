"""The simulated cluster's links without Ray: a TCP round trip between two nodes takes at least
twice the delay asked for (netem, or the delay line where the kernel has no netem), a transfer
is held to the link's rate, the kernel's counters count what crossed, and nothing the cluster
made is left after it closes; a node's link cut (``SimCluster.cut``) refuses new connections
until it is restored, and a connection open across the cut carries its round trip after it. Skips, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pytest

from benchmarks.harness.simcluster import SimCluster, available, kill_node, link_up, reachable

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no simulated cluster here: {WHY}")

SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5555)); s.listen(1)
print("LISTENING", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
got = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    if d == b"p":
        c.sendall(b"p")
    else:
        got += len(d)
        if got >= int(sys.argv[2]):
            c.sendall(b"k")
"""

CLIENT = r"""
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], 5555), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(50):
    t = time.perf_counter(); c.sendall(b"p"); c.recv(1); rtts.append(time.perf_counter() - t)
t = time.perf_counter(); c.sendall(b"x" * int(sys.argv[2])); c.recv(1)
print(json.dumps({"rtts": rtts, "transfer_s": time.perf_counter() - t}))
"""

SIZE = 4 << 20


@pytest.mark.parametrize("delay_ms", [0.0, 2.0])
def test_links_delay_rate_counters_and_teardown(delay_ms: float) -> None:
    with SimCluster(nodes=2, cpus_per_node=1, link_mbit=100, delay_ms=delay_ms, start_ray=False) as cluster:
        a, b = cluster.members
        server = subprocess.Popen(["ip", "netns", "exec", b.namespace, sys.executable, "-c", SERVER, b.ip, str(SIZE)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "LISTENING"
            before = cluster.cross_node_bytes()
            got = subprocess.run(["ip", "netns", "exec", a.namespace, sys.executable, "-c", CLIENT, b.ip, str(SIZE)],
                                 capture_output=True, text=True, timeout=120)
            sent = cluster.cross_node_bytes() - before
        finally:
            server.kill()
            server.wait(timeout=20)
        link, names = cluster.link, [n.namespace for n in cluster.members]
    assert got.returncode == 0, got.stderr[-2000:]
    out = json.loads(got.stdout)
    rtt = statistics.median(out["rtts"])
    print(f"{link}: round trip median {rtt * 1e3:.3f} ms; {SIZE >> 20} MiB in {out['transfer_s']:.3f} s; "
          f"counted {sent:,} B")
    assert ("no delay" in link) == (delay_ms == 0)
    assert rtt >= 2 * delay_ms / 1000
    # 100 Mbit/s: 4 MiB cannot cross in less than 0.336 s (the token bucket's first burst aside)
    assert out["transfer_s"] >= 0.8 * SIZE * 8 / 100e6
    # Both directions are counted: the payload, the replies and TCP/IP headers.
    assert SIZE <= sent <= 1.05 * SIZE + (1 << 16)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert not any(ns in left for ns in names)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20).stdout
    assert f"zrs{cluster.tag}" not in links


ECHO = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5556)); s.listen(8)
print("LISTENING", flush=True)
def serve(c):
    while d := c.recv(1 << 16):
        c.sendall(d)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""

HELD = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5556), timeout=60)
c.sendall(b"a"); assert c.recv(1) == b"a"
print("OPEN", flush=True)
sys.stdin.readline()  # the link is cut now: this round trip is sent into the cut
t = time.perf_counter(); c.sendall(b"b"); got = c.recv(1)
print(got.decode(), f"{time.perf_counter() - t:.3f}", flush=True)
"""


def test_a_cut_link_refuses_connections_until_restored_and_an_open_one_rides_it_out() -> None:
    with SimCluster(nodes=2, cpus_per_node=1, link_mbit=1000, delay_ms=0.0, start_ray=False) as cluster:
        a, b = cluster.members
        server = subprocess.Popen(["ip", "netns", "exec", b.namespace, sys.executable, "-c", ECHO, b.ip],
                                  stdout=subprocess.PIPE, text=True)
        procs = [server]
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "LISTENING"
            held = subprocess.Popen(["ip", "netns", "exec", a.namespace, sys.executable, "-c", HELD, b.ip],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(held)
            assert held.stdout is not None and held.stdin is not None
            assert held.stdout.readline().strip() == "OPEN"
            assert reachable(a.namespace, b.ip, 5556)
            cluster.cut(1)
            assert not link_up(b.namespace) and link_up(a.namespace)
            # Both ways: neither node opens a connection to the other during the cut.
            assert not reachable(a.namespace, b.ip, 5556, timeout_s=2)
            assert not reachable(b.namespace, a.ip, 5556, timeout_s=2)
            held.stdin.write("go\n")
            held.stdin.flush()
            cluster.restore(1)
            assert link_up(b.namespace)
            assert reachable(a.namespace, b.ip, 5556, timeout_s=10)
            out, _ = held.communicate(timeout=60)
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=20)
    echoed, seconds = out.split()
    print(f"round trip sent into the cut came back {float(seconds):.3f} s later")
    assert echoed == "b" and held.returncode == 0


def test_a_node_killed_whole_loses_every_process_in_it_and_only_those() -> None:
    """The soak's ``node_killed`` fault on the cheapest setup: ``kill_node`` SIGKILLs what runs in
    the node's namespace (there: its raylet and owners), nothing outside it."""
    with SimCluster(nodes=2, cpus_per_node=1, link_mbit=1000, delay_ms=0.0, start_ray=False) as cluster:
        inside = [subprocess.Popen(["ip", "netns", "exec", cluster.members[1].namespace, "sleep", "60"])
                  for _ in range(2)]
        beside = subprocess.Popen(["ip", "netns", "exec", cluster.members[0].namespace, "sleep", "60"])
        try:
            deadline, killed = time.monotonic() + 10, set()
            while len(killed) < 2 and time.monotonic() < deadline:  # until both have entered the namespace
                killed |= set(kill_node(cluster.members[1].namespace))
            assert killed == {p.pid for p in inside}
            assert [p.wait(timeout=10) for p in inside] == [-9, -9]
            assert beside.poll() is None
        finally:
            beside.kill()
            beside.wait(timeout=10)
