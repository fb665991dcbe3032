"""The soak's S3 server error rules, armed from another process (benchmarks/soak.py).

The S3 server (tests/s3_server.py, moto in a thread) lives in the soak's supervisor, which
outlives the training driver it SIGKILLs (``driver_sigkill``): the checkpoints and the corpus
stay where they are. The driver's fault injector arms its 503 rules through ``RemoteS3``, which
has the one method of ``S3Server`` it uses (``failing``), over a Unix socket the supervisor
serves (``serve``), so the injector reads the same either way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import Client, Connection, Listener
from typing import Any


def serve(s3: Any, address: str, authkey: bytes) -> Listener:
    """Serve ``s3.failing`` at the Unix socket ``address`` on daemon threads; close the listener
    to stop taking connections. Requests: ("arm", pattern, count, methods) -> rule id,
    ("hits", id) -> errors answered, ("end", id) -> None (the rule removed)."""
    listener = Listener(address, family="AF_UNIX", authkey=authkey)

    def handle(conn: Connection) -> None:
        rules: dict[int, tuple[ExitStack, Any]] = {}
        try:
            while True:
                op, *rest = conn.recv()
                if op == "arm":
                    pattern, count, methods = rest
                    stack = ExitStack()
                    rule = stack.enter_context(s3.failing(pattern, count=count, methods=tuple(methods)))
                    rules[len(rules)] = (stack, rule)
                    conn.send(len(rules) - 1)
                elif op == "hits":
                    conn.send(rules[rest[0]][1].hits)
                elif op == "end":
                    rules[rest[0]][0].close()
                    conn.send(None)
        except (EOFError, OSError):  # the driver ended (or was SIGKILLed): its rules end with it
            for stack, _ in rules.values():
                stack.close()

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=handle, args=(conn,), name="soak-s3-remote", daemon=True).start()

    threading.Thread(target=accept, name="soak-s3-accept", daemon=True).start()
    return listener


class RemoteRule:
    """An armed rule's ``hits``, read from the server when asked."""

    _remote: RemoteS3
    _id: int

    def __init__(self, remote: RemoteS3, rule_id: int) -> None:
        self._remote, self._id = remote, rule_id

    @property
    def hits(self) -> int:
        return int(self._remote.call("hits", self._id))


class RemoteS3:
    """``S3Server.failing`` through ``serve``'s socket."""

    _conn: Connection
    _lock: threading.Lock

    def __init__(self, address: str, authkey: bytes) -> None:
        self._conn, self._lock = Client(address, family="AF_UNIX", authkey=authkey), threading.Lock()

    def call(self, *request: Any) -> Any:
        with self._lock:
            self._conn.send(request)
            return self._conn.recv()

    @contextmanager
    def failing(self, pattern: str, *, count: int = -1, methods: tuple[str, ...] = ("GET",)) -> Iterator[RemoteRule]:
        rule_id = int(self.call("arm", pattern, count, list(methods)))
        try:
            yield RemoteRule(self, rule_id)
        finally:
            self.call("end", rule_id)
