"""A process of its own for test_control_hop_lifecycle.py: relay hops over two stand-in owners
built, stepped and closed one after the other, the last closed with a step in flight, as a
relay that is rebuilt after each loss does. Prints each step's failure type (or null) as one
JSON line; its stderr is the test's to read.

    hops_run.py HOPS
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from control_fakes import WAIT_S  # noqa: E402
from relay_stand_ins import relay_args, serve_tree  # noqa: E402

from zero_ray.control.auth import Credentials  # noqa: E402
from zero_ray.control.relay_hop import RelayHop, hop_children  # noqa: E402


def main(hops: int) -> None:
    served = serve_tree(Credentials(job_id="job-hops", token=secrets.token_urlsafe(32)), ["node-a"] * 2, fan_out=2)
    relay = served.tree.node_relay("node-a")
    failed: list[str | None] = []
    try:
        for n in range(hops):
            hop = RelayHop(host=relay.host, children=hop_children(served.tree, relay.id, owners=served.owner_clients,
                                                                  relays={}))
            last = n == hops - 1
            for owner in served.owners:  # the last hop closes under a step still out
                owner.block_steps = last
            done: list[str | None] = []

            def step(hop: RelayHop = hop, n: int = n, done: list[str | None] = done) -> None:
                reply = hop.relay_step(relay_args(n, 2))
                done.append(reply.failure.detail.type if reply.failure is not None else None)

            stepping = threading.Thread(target=step)
            stepping.start()
            if last and not all(owner.step_entered.wait(WAIT_S) for owner in served.owners):
                raise AssertionError("the blocked owners never got their steps")
            if not last:
                stepping.join(WAIT_S)
            hop.close()
            stepping.join(WAIT_S)
            if stepping.is_alive() or not done:
                raise AssertionError(f"hop {n}'s step did not come back after close()")
            failed.append(done[0])
        print(json.dumps(failed), flush=True)
    finally:
        served.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
