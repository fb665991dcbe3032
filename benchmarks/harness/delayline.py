"""A delay line between simulated nodes, for kernels without netem (benchmarks/harness/simcluster.py).

Linux delays packets with the netem qdisc; a kernel built without it (this project's machines)
has no qdisc that holds a packet for a fixed time. This process does it in user space: it opens
one TUN device per node (``IFF_TUN``: IP packets, no link header); the cluster moves each into
its node's namespace as that node's only link. Every IPv4 packet a node sends arrives here, waits
``--delay-ms`` and is written into the TUN of the node it is addressed to. The delay is constant,
so a FIFO keeps the packets in order.

    python -m benchmarks.harness.delayline --names zrs...t0,zrs...t1 --ips 198.18.213.1,198.18.213.2
        --delay-ms 0.5 --parent-pid P

It prints ``READY`` once the devices exist, and exits when its parent is gone (checked at least
every second), so a killed benchmark leaves no forwarder behind; closing its descriptors removes
the devices. A packet for an address it does not know, or one the kernel refuses (the node's
namespace torn down), is dropped, as a network drops it. The devices' MTU is large (the cluster
sets 65000): TUN without offloads gets one write per packet, and 64 KB packets keep a 1 Gbit/s
link to ~2,000 of them a second, which one Python loop forwards with room to spare.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PARENT_CHECK_S = 1.0
READ_SIZE = 65536


def open_tun(name: str) -> int:
    """A TUN device named ``name`` (IP packets, no packet-info header), non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def forward(fds: dict[bytes, int], *, delay_s: float, parent_pid: int) -> None:
    """Move packets between the devices, each ``delay_s`` after it arrived, until the parent is gone."""
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    readers = list(fds.values())
    next_check = time.monotonic() + PARENT_CHECK_S
    while True:
        now = time.monotonic()
        timeout = min(max(0.0, queue[0][0] - now), PARENT_CHECK_S) if queue else PARENT_CHECK_S
        ready, _, _ = select.select(readers, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    packet = os.read(fd, READ_SIZE)
                except OSError:  # BlockingIOError: drained; others: the device is gone
                    break
                if len(packet) >= 20 and packet[0] >> 4 == 4:
                    target = fds.get(packet[16:20])
                    if target is not None:
                        queue.append((now + delay_s, target, packet))
        while queue and queue[0][0] <= now:
            _, target, packet = queue.popleft()
            try:
                os.write(target, packet)
            except OSError:
                pass  # the receiving node is gone or its queue is full: the packet is lost
        if now >= next_check:
            next_check = now + PARENT_CHECK_S
            if os.getppid() != parent_pid:
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.delayline", description=__doc__.split("\n")[0])
    p.add_argument("--names", required=True, help="comma-separated TUN device names, one per node")
    p.add_argument("--ips", required=True, help="comma-separated IPv4 addresses of the nodes, in the same order")
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    names, ips = args.names.split(","), args.ips.split(",")
    if len(names) != len(ips):
        p.error(f"--names has {len(names)} devices but --ips has {len(ips)} addresses")
    if args.delay_ms < 0:
        p.error(f"--delay-ms {args.delay_ms} must be >= 0")
    fds = {bytes(int(o) for o in ip.split(".")): open_tun(name) for name, ip in zip(names, ips)}
    print("READY", flush=True)
    forward(fds, delay_s=args.delay_ms / 1000.0, parent_pid=args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
