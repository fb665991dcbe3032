"""gRPC servers for the control plane: a partition owner's, a relay's and the driver's.

A :class:`ControlServer` serves handlers (see :mod:`zero_ray.control.handlers`, translated by
:mod:`zero_ray.control.servicers`) on its own thread pool, so that a call such as ``Abort`` is served while another
thread is blocked in a long ``Step``. Every call first passes the token and
header checks of :mod:`zero_ray.control.auth`. Only small control messages
travel here (tensors move through Ray and the collectives), hence the small
default message limit.

Example::

    server = ControlServer(ServerConfig(host=node_ip, credentials=creds))
    server.add_owner(handler)
    address = server.start()   # "HOST:PORT", for the driver to dial
    ...
    server.stop()
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from zero_ray.control._generated import coordinator_pb2_grpc, owner_pb2_grpc, relay_pb2_grpc
from zero_ray.control.auth import (
    SUPPORTED_PROTOCOL_VERSIONS,
    Credentials,
    HeaderInterceptor,
    TokenInterceptor,
    read_pem,
)
from zero_ray.control.handlers import CoordinatorHandler, OwnerHandler
from zero_ray.control.relay_host import RelayHost
from zero_ray.control.servicers import CoordinatorServicer, OwnerServicer, RelayServicer
from zero_ray.control.stream_admission import Streams
from zero_ray.errors import ConfigError, ControlError

_log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# gRPC's own ceiling for a message length (a signed 32-bit int).
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets as gRPC targets need."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How a :class:`ControlServer` listens.

    ``host`` is the node's own IP (``ray.util.get_node_ip_address()`` on a cluster,
    ``127.0.0.1`` on one machine); wildcards are refused so that the control plane
    is never offered on every interface by accident. ``port`` 0 lets the OS pick.
    ``threads`` bounds concurrent calls; at most ``max_streams`` of them may be
    long-lived streams (Health, Metrics), which leaves threads for ``Step`` and
    ``Abort`` however many monitors connect. TLS is on when ``tls_cert`` and
    ``tls_key`` are given; ``tls_client_ca`` additionally requires client
    certificates signed by that CA (mTLS). ``protocol_versions`` are the header
    versions accepted; ``grace_s`` is how long :meth:`ControlServer.stop` lets calls
    in flight finish.
    """

    host: str
    credentials: Credentials
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    threads: int = 8
    max_streams: int = 4
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    protocol_versions: frozenset[int] = SUPPORTED_PROTOCOL_VERSIONS
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        host = self.host.strip("[]")
        if host in _WILDCARD_HOSTS:
            raise ConfigError(f"host={self.host!r} would listen on every interface; pass the node's own IP "
                              "(ray.util.get_node_ip_address()) or 127.0.0.1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535] (0 picks a free port)")
        if not 1024 <= self.max_message_bytes <= _GRPC_MAX_MESSAGE_BYTES:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes} must be in "
                              f"[1024, {_GRPC_MAX_MESSAGE_BYTES}]")
        if self.threads < 2:
            raise ConfigError(f"threads={self.threads} must be >= 2, so that Abort is served while Step runs")
        if not 0 <= self.max_streams <= self.threads - 2:
            raise ConfigError(f"max_streams={self.max_streams} must be in [0, threads - 2 = {self.threads - 2}], "
                              "leaving a thread each for Step and Abort")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(f"tls_cert={self.tls_cert!r} and tls_key={self.tls_key!r}: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(f"tls_client_ca={self.tls_client_ca!r} (mTLS) needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r} is not a file")
        if not self.protocol_versions:
            raise ConfigError(f"protocol_versions={set(self.protocol_versions)} must not be empty")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError(f"grace_s={self.grace_s} must be a finite number >= 0")

    @property
    def bind_host(self) -> str:
        """The host without IPv6 brackets."""
        return self.host.strip("[]")

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS."""
        return self.tls_cert is not None


def _missing_methods(handler: object, protocol: type) -> list[str]:
    # Instance methods only: a concrete handler class (RelayHost) also has properties and
    # constructors (classmethods), which are not served.
    names = [name for name in dir(protocol) if not name.startswith("_") and callable(getattr(protocol, name))
             and not isinstance(inspect.getattr_static(protocol, name), (classmethod, staticmethod))]
    return [name for name in names if not callable(getattr(handler, name, None))]


class ControlServer:
    """One gRPC server on its own thread pool, serving an owner handler, a
    coordinator handler, or both. Add handlers, then :meth:`start`."""

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self._streams = Streams(config.max_streams)
        self._executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="zero-ray-control")
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # gRPC sets SO_REUSEPORT by default, which would let two servers share a port silently.
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [TokenInterceptor(config.credentials.token),
                        HeaderInterceptor(config.credentials.job_id, config.protocol_versions)]
        self._server = grpc.server(self._executor, interceptors=interceptors, options=options)
        self._services: list[str] = []
        self._address: str | None = None
        self._stopped = False

    @property
    def config(self) -> ServerConfig:
        """The configuration the server was built with."""
        return self._config

    def add_owner(self, handler: OwnerHandler) -> None:
        """Serve ``zero_ray.v1.PartitionOwner`` with ``handler``."""
        self._add("PartitionOwner", handler, OwnerHandler)
        owner_pb2_grpc.add_PartitionOwnerServicer_to_server(OwnerServicer(handler, self._streams), self._server)

    def add_coordinator(self, handler: CoordinatorHandler) -> None:
        """Serve ``zero_ray.v1.Coordinator`` with ``handler``."""
        self._add("Coordinator", handler, CoordinatorHandler)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(handler, self._streams),
                                                               self._server)

    def add_relay(self, host: RelayHost) -> None:
        """Serve ``zero_ray.v1.Relay`` with ``host``: the relays this process serves (beside an
        owner's service, or alone)."""
        self._add("Relay", host, RelayHost)
        relay_pb2_grpc.add_RelayServicer_to_server(RelayServicer(host, self._streams), self._server)

    def _add(self, service: str, handler: Any, protocol: type) -> None:
        if self._address is not None:
            raise ControlError(f"cannot add {service} to the server at {self._address}: it has started")
        if service in self._services:
            raise ConfigError(f"{service} is served already by this server")
        missing = _missing_methods(handler, protocol)
        if missing:
            raise ConfigError(f"{type(handler).__name__} cannot serve {service}: it lacks {missing}")
        self._services.append(service)

    def start(self) -> str:
        """Bind, start serving and return the bound address ``HOST:PORT``."""
        if self._address is not None:
            return self._address
        if not self._services:
            raise ConfigError("the server has no handler; call add_owner(), add_relay() or add_coordinator() first")
        config = self._config
        target = format_address(config.bind_host, config.port)
        try:
            if config.tls:
                port = self._server.add_secure_port(target, _server_credentials(config))
            else:
                port = self._server.add_insecure_port(target)
        except RuntimeError as err:  # recent grpcio raises where older ones returned 0
            raise ControlError(f"cannot listen on {target}: {err}") from err
        if port == 0:
            raise ControlError(f"cannot listen on {target}: the address is in use or not this node's")
        self._server.start()
        self._address = format_address(config.bind_host, port)
        _log.info("control server for %s listening on %s (tls=%s)", "+".join(self._services), self._address,
                  config.tls)
        return self._address

    @property
    def address(self) -> str:
        """The bound ``HOST:PORT``; only after :meth:`start`."""
        if self._address is None:
            raise ControlError("the control server has not started; call start() first")
        return self._address

    def stop(self, grace_s: float | None = None) -> None:
        """End the streams, give calls in flight ``grace_s`` (default
        ``config.grace_s``) to finish, then cancel the rest. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self._config.grace_s if grace_s is None else grace_s
        self._streams.close()
        # Bounded: a handler blocked past the grace period is cancelled, not waited for.
        self._server.stop(grace).wait(timeout=grace + 5.0)
        # wait=False: a handler thread stuck in user code must not hang shutdown.
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ControlServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    assert config.tls_cert is not None and config.tls_key is not None  # checked in ServerConfig
    client_ca = read_pem(config.tls_client_ca) if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials([(read_pem(config.tls_key), read_pem(config.tls_cert))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


def serve_owner(handler: OwnerHandler, config: ServerConfig) -> ControlServer:
    """Start a server for a partition owner's handler; its ``address`` is ready."""
    server = ControlServer(config)
    server.add_owner(handler)
    server.start()
    return server


def serve_coordinator(handler: CoordinatorHandler, config: ServerConfig) -> ControlServer:
    """Start a server for the driver's coordinator handler; its ``address`` is ready."""
    server = ControlServer(config)
    server.add_coordinator(handler)
    server.start()
    return server
