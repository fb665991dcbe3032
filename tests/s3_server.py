"""A local S3-compatible server for the tests: moto in server mode on 127.0.0.1 and a free port.

Code under test reaches it only as a user reaches S3: through the standard environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), which
``S3Server.env`` holds and the session fixture exports before Ray starts (Ray's workers inherit
the environment the local cluster was started with).

A thin WSGI layer in front of moto lets a test see and steer the traffic: a log of requests
(method, key, Range header), errors injected into matching requests (a store that is briefly or
always overloaded), and requests held until released (an upload caught in the middle).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from moto.server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

ACCESS_KEY = "zero-ray-test-access"
SECRET_KEY = "zero-ray-test-secret-never-printed"  # the tests check no message carries it
REGION = "us-east-1"


@dataclass
class Seen:
    method: str
    path: str  # "/bucket/key"
    query: str
    range: str | None


@dataclass
class _Rule:
    pattern: re.Pattern[str]
    methods: tuple[str, ...]
    remaining: int  # errors still to inject (-1: every time)
    status: int
    code: str
    hits: int = 0


@dataclass
class Hold:
    """Requests whose ``path?query`` matches ``pattern`` wait until ``release()``; ``arrived`` is
    set at the first."""

    pattern: re.Pattern[str]
    methods: tuple[str, ...]
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    seen: list[str] = field(default_factory=list)

    def release(self) -> None:
        self.released.set()


class _Steering:
    """The WSGI layer in front of moto's app."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.log: list[Seen] = []
        self.rules: list[_Rule] = []
        self.holds: list[Hold] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self.lock:
            self.log.append(Seen(method, path, environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE")))
            rule = next((r for r in self.rules if r.remaining != 0 and method in r.methods and r.pattern.search(path)),
                        None)
            if rule is not None:
                rule.remaining -= 1 if rule.remaining > 0 else 0
                rule.hits += 1
            target = f"{path}?{environ.get('QUERY_STRING', '')}"
            holds = [h for h in self.holds if method in h.methods and h.pattern.search(target)]
        for hold in holds:
            hold.seen.append(f"{method} {target}")
            hold.arrived.set()
            hold.released.wait(timeout=120)  # bounded: a test that forgets to release still ends
        if rule is not None:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
                    f"<Message>injected by the test</Message></Error>").encode()
            start_response(f"{rule.status} {rule.code}", [("Content-Type", "application/xml"),
                                                          ("Content-Length", str(len(body)))])
            return [body]
        return self.app(environ, start_response)


class _Server(ThreadedMotoServer):
    """moto's threaded server with ``_Steering`` in front of its application."""

    def __init__(self, steering: Callable[[Any], _Steering], host: str, port: int) -> None:
        super().__init__(ip_address=host, port=port, verbose=False)
        self._steering_factory = steering
        self.steering: _Steering | None = None

    def _server_entry(self) -> None:  # as ThreadedMotoServer's, with the app wrapped
        self.steering = self._steering_factory(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, self.steering, True,
                                   request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()


class S3Server:
    """moto's S3 on 127.0.0.1:<free port>, with the environment to reach it and test hooks.
    ``host`` / ``port``: another address, for owners on other (simulated) nodes, which must
    have the endpoint in their environment before their Ray starts (benchmarks/soak.py)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        self._server = _Server(_Steering, host, port)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                    "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    @property
    def steering(self) -> _Steering:
        assert self._server.steering is not None
        return self._server.steering

    def stop(self) -> None:
        self._server.stop()

    def client(self) -> Any:
        """A boto3 S3 client on this server (for setting up and looking at buckets)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    # -- steering ----------------------------------------------------------------------------------
    def requests(self) -> list[Seen]:
        with self.steering.lock:
            return list(self.steering.log)

    @contextmanager
    def failing(self, pattern: str, *, count: int = -1, status: int = 503, code: str = "SlowDown",
                methods: tuple[str, ...] = ("GET", "PUT", "POST", "HEAD", "DELETE")) -> Iterator[_Rule]:
        """Answer the next ``count`` requests whose path matches ``pattern`` (all, with -1) with
        ``status`` and the S3 error ``code``."""
        rule = _Rule(pattern=re.compile(pattern), methods=methods, remaining=count, status=status, code=code)
        with self.steering.lock:
            self.steering.rules.append(rule)
        try:
            yield rule
        finally:
            with self.steering.lock:
                self.steering.rules.remove(rule)

    @contextmanager
    def holding(self, pattern: str, *, methods: tuple[str, ...] = ("PUT", "POST")) -> Iterator[Hold]:
        """Hold requests whose ``path?query`` matches ``pattern`` until the block ends (or
        ``release()``)."""
        hold = Hold(pattern=re.compile(pattern), methods=methods)
        with self.steering.lock:
            self.steering.holds.append(hold)
        try:
            yield hold
        finally:
            hold.release()
            with self.steering.lock:
                self.steering.holds.remove(hold)

    @contextmanager
    def authenticating(self) -> Iterator[None]:
        """While open, the server checks credentials (moto's IAM authentication): the test's
        access key, unknown to its IAM, is refused as a wrong one would be."""
        import urllib.request

        def reset(count: str) -> None:
            request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(),
                                             method="POST", headers={"Content-Type": "text/plain"})
            with urllib.request.urlopen(request, timeout=30) as reply:
                reply.read()

        reset("0")
        try:
            yield
        finally:
            reset("inf")
