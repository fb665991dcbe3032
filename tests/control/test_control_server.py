"""Server behaviour: concurrency, limits, deadlines, streams, configuration and TLS."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
from typing import Any

import grpc
import pytest
from control_fakes import ARGS, FLIGHT, LOOPBACK, WAIT_S, FakeCoordinator, FakeOwner, Served, server_config

from zero_ray.control.auth import Credentials
from zero_ray.control.handlers import Piece
from zero_ray.control.client import ClientConfig, CoordinatorClient, OwnerClient
from zero_ray.control.server import ControlServer, ServerConfig, _missing_methods, serve_coordinator, serve_owner
from zero_ray.errors import ConfigError, ControlError


def test_abort_is_served_while_a_step_blocks(owner: Served) -> None:
    owner.handler.block_steps = True
    outcome: dict[str, Any] = {}

    def run_step() -> None:
        try:
            outcome["result"] = owner.client.step(ARGS, timeout_s=WAIT_S)
        except Exception as err:  # reported by the assertions below
            outcome["error"] = err

    stepping = threading.Thread(target=run_step, daemon=True)
    stepping.start()
    assert owner.handler.step_entered.wait(WAIT_S), "Step never reached the handler"
    assert owner.client.abort("peer lost", 2, timeout_s=WAIT_S) is True
    # Abort was answered while Step still waits for the release only this test gives.
    assert stepping.is_alive() and "result" not in outcome
    owner.handler.release_step.set()
    stepping.join(WAIT_S)
    assert not stepping.is_alive() and "error" not in outcome and outcome["result"].rank == 1
    assert owner.handler.calls == ["step", "abort"]


def test_the_flight_record_is_served_while_a_step_blocks(owner: Served) -> None:
    owner.handler.block_steps = True
    stepping = threading.Thread(target=lambda: owner.client.step(ARGS, timeout_s=WAIT_S), daemon=True)
    stepping.start()
    assert owner.handler.step_entered.wait(WAIT_S), "Step never reached the handler"
    got = owner.client.flight(timeout_s=WAIT_S)
    assert stepping.is_alive()  # answered while Step still waits
    owner.handler.release_step.set()
    stepping.join(WAIT_S)
    assert got == FLIGHT and got.current is not None and got.recent[0].ended == 1.5e9 + 0.5
    assert owner.handler.calls == ["step", "flight"]


def test_deadline_error_names_method_and_deadline(owner: Served) -> None:
    owner.handler.block_steps = True
    with pytest.raises(ControlError, match=r"PartitionOwner\.Step to 127\.0\.0\.1:\d+ did not finish within "
                                           r"its deadline of 0\.2s") as info:
        owner.client.step(ARGS, timeout_s=0.2)
    assert info.value.__cause__.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # Without a per-call timeout the client's default applies.
    with OwnerClient(owner.client_config(timeout_s=0.1)) as client:
        with pytest.raises(ControlError, match=r"deadline of 0\.1s"):
            client.step(ARGS)


def test_oversized_request_is_refused(credentials: Credentials) -> None:
    handler = FakeOwner()
    server = serve_owner(handler, server_config(credentials, max_message_bytes=64 * 1024))
    try:
        # The client would send it: only the server's limit is under test.
        config = ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S,
                              max_message_bytes=1 << 20)
        with OwnerClient(config) as client:
            with pytest.raises(ControlError, match="RESOURCE_EXHAUSTED") as info:
                client.step(dataclasses.replace(ARGS, piece=Piece(dataset="x" * (128 * 1024))))
            assert info.value.__cause__.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert client.step(ARGS).rank == 1  # a small one still goes through
    finally:
        server.stop()
    assert handler.calls == ["step"]


def test_silent_heartbeat_stream_fails_after_stall(owner: Served) -> None:
    hang = threading.Event()
    owner.handler.hang_heartbeats = hang
    try:
        with owner.client.heartbeats(0.02, stall_s=0.3) as beats:
            assert next(beats).step == 1
            with pytest.raises(ControlError, match=r"PartitionOwner\.Health .* sent nothing for 0\.3s"):
                next(beats)
    finally:
        hang.set()


def test_streams_are_capped_below_the_thread_pool(owner: Served) -> None:
    first, second = owner.client.heartbeats(0.05), owner.client.heartbeats(0.05)
    try:
        next(first), next(second)  # both admitted (max_streams=2)
        with owner.client.heartbeats(0.05) as third:
            with pytest.raises(ControlError, match="RESOURCE_EXHAUSTED.*max_streams=2"):
                next(third)
        assert owner.client.stats().rank == 1  # unary calls still find a thread
    finally:
        first.close()
        second.close()
    with pytest.raises(StopIteration):
        next(first)  # closing ends the iteration quietly


def test_server_stop_ends_heartbeat_streams(owner: Served) -> None:
    beats = owner.client.heartbeats(0.02)
    assert next(beats).step == 1
    owner.server.stop()
    with pytest.raises(ControlError, match=r"PartitionOwner\.Health"):
        for _ in range(10_000):  # drain what was buffered before the stop
            next(beats)


def test_server_refuses_to_share_a_port(owner: Served, credentials: Credentials) -> None:
    port = int(owner.address.rsplit(":", 1)[1])
    with pytest.raises(ControlError, match=f"cannot listen on 127.0.0.1:{port}"):
        serve_owner(FakeOwner(), server_config(credentials, port=port))


def test_handler_must_have_every_method(credentials: Credentials) -> None:
    class Partial:
        def status(self) -> None: ...

    server = ControlServer(server_config(credentials))
    with pytest.raises(ConfigError, match=r"Partial cannot serve Coordinator: it lacks \['checkpoint', 'metrics'"):
        server.add_coordinator(Partial())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no handler"):
        server.start()


def test_a_handler_needs_the_served_methods_not_the_constructors() -> None:
    class Service:  # a concrete handler class used as its own protocol, as RelayHost is
        @classmethod
        def serving(cls) -> Service: ...

        def relay_step(self) -> None: ...

    class Other:
        def relay_step(self) -> None: ...

    assert _missing_methods(Other(), Service) == []
    assert _missing_methods(object(), Service) == ["relay_step"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"port": 70000}, "port=70000"),
    ({"host": "0.0.0.0"}, "every interface"),
    ({"threads": 1, "max_streams": 0}, "threads=1"),
    ({"threads": 4, "max_streams": 3}, "max_streams=3"),
    ({"max_message_bytes": 10}, "max_message_bytes=10"),
    ({"tls_cert": "/nonexistent.pem"}, "tls_cert='/nonexistent.pem' and tls_key=None"),
    ({"tls_client_ca": "/ca.pem"}, "tls_client_ca='/ca.pem'"),
])
def test_server_config_is_validated(credentials: Credentials, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        server_config(credentials, **overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"address": "nowhere"}, "address='nowhere'"),
    ({"address": "::1:80"}, r"brackets, e.g. \[::1\]:80"),
    ({"timeout_s": 0.0}, "timeout_s=0.0"),
    ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "need tls_ca"),
])
def test_client_config_is_validated(credentials: Credentials, overrides: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {"address": "127.0.0.1:1", "credentials": credentials, **overrides}
    with pytest.raises(ConfigError, match=message):
        ClientConfig(**values)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, acting as its own CA for both ends."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=zero-ray-test",
                    "-addext", f"subjectAltName=IP:{LOOPBACK}"], check=True, capture_output=True, timeout=WAIT_S)
    return str(cert), str(key)


def test_mutual_tls(credentials: Credentials, certificate: tuple[str, str]) -> None:
    cert, key = certificate
    config: ServerConfig = server_config(credentials, tls_cert=cert, tls_key=key, tls_client_ca=cert)
    server = serve_coordinator(FakeCoordinator(), config)
    try:
        base = ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S, tls_ca=cert,
                            tls_cert=cert, tls_key=key)
        with CoordinatorClient(base) as client:
            assert client.status().step == 1200
        for refused in (dataclasses.replace(base, tls_cert=None, tls_key=None),  # no client certificate
                        dataclasses.replace(base, tls_ca=None, tls_cert=None, tls_key=None)):  # plain text
            with CoordinatorClient(refused) as client, pytest.raises(ControlError, match="UNAVAILABLE"):
                client.status(timeout_s=2.0)
    finally:
        server.stop()
