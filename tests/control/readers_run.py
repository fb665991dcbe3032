"""A process of its own for test_control_beats.py: heartbeat readers opened and closed one after
the other against one fake owner (two streams each, a beat every 20 ms), as the trainers of a
notebook that trains twice do. Prints how many beats each reader saw as one JSON line; its stderr
is the test's to read.

    readers_run.py READERS
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from control_fakes import WAIT_S, FakeOwner, server_config  # noqa: E402

from zero_ray.control.auth import Credentials  # noqa: E402
from zero_ray.control.heartbeats import HeartbeatReader  # noqa: E402
from zero_ray.control.client import ClientConfig  # noqa: E402
from zero_ray.control.server import ControlServer  # noqa: E402

BEATS = 4  # per reader, before it is closed: its streams are mid-flight when it closes


def read_some(config: ClientConfig) -> int:
    seen, enough = [0], threading.Event()

    def beat(rank: int, _: object) -> None:
        seen[0] += 1
        if seen[0] >= BEATS:
            enough.set()

    def lost(rank: int, reason: str) -> None:
        raise AssertionError(f"rank {rank} lost: {reason}")

    reader = HeartbeatReader([config] * 2, interval_s=0.02, stall_s=WAIT_S, on_beat=beat, on_lost=lost)
    try:
        if not enough.wait(WAIT_S):
            raise AssertionError(f"{seen[0]} beats in {WAIT_S}s")
    finally:
        reader.close()
    return seen[0]


def main(readers: int) -> None:
    credentials = Credentials(job_id="job-test", token=secrets.token_urlsafe(32))
    server = ControlServer(server_config(credentials, threads=6, max_streams=4))
    server.add_owner(FakeOwner())
    server.start()
    try:
        config = ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S)
        print(json.dumps([read_some(config) for _ in range(readers)]), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]))
