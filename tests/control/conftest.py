"""Loopback servers with fake handlers, and clients connected to them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from control_fakes import WAIT_S, FakeCoordinator, FakeOwner, Served, server_config

from zero_ray.control.auth import Credentials
from zero_ray.control.client import ClientConfig, CoordinatorClient, OwnerClient
from zero_ray.control.server import ControlServer


@pytest.fixture
def credentials() -> Credentials:
    return Credentials(job_id="job-test", token=secrets.token_urlsafe(32))


@pytest.fixture
def owner(credentials: Credentials) -> Iterator[Served]:
    handler = FakeOwner()
    server = ControlServer(server_config(credentials))
    server.add_owner(handler)
    server.start()
    client = OwnerClient(ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S))
    yield Served(server, handler, client, credentials)
    handler.release_step.set()  # never leave a pool thread blocked past the test
    client.close()
    server.stop()


@pytest.fixture
def coordinator(credentials: Credentials) -> Iterator[Served]:
    handler = FakeCoordinator()
    server = ControlServer(server_config(credentials))
    server.add_coordinator(handler)
    server.start()
    client = CoordinatorClient(ClientConfig(address=server.address, credentials=credentials, timeout_s=WAIT_S))
    yield Served(server, handler, client, credentials)
    client.close()
    server.stop()
