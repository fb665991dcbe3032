"""Tokens, token files, and the checks every request passes before a handler runs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc
import pytest
from control_fakes import ARGS, WAIT_S, Served, header, raw_channel

from zero_ray.control._generated import coordinator_pb2, coordinator_pb2_grpc, owner_pb2, owner_pb2_grpc
from zero_ray.control.auth import (
    PROTOCOL_VERSION,
    TOKEN_ENV,
    Credentials,
    bearer_metadata,
    new_token,
    read_token_file,
    write_token_file,
)
from zero_ray.control.client import OwnerClient
from zero_ray.errors import AuthError, ConfigError, ControlError


def test_new_token_is_random_unless_ray_has_one() -> None:
    first, second = new_token({}), new_token({})
    assert first != second and len(first) >= 43
    reused = "r" * 40
    assert new_token({TOKEN_ENV: reused}) == reused
    with pytest.raises(ConfigError, match=TOKEN_ENV):
        new_token({TOKEN_ENV: "short"})


def test_token_file_is_created_0600_and_round_trips(tmp_path: Path, credentials: Credentials) -> None:
    # A permissive umask must not matter: the mode is given at creation.
    old_umask = os.umask(0o000)
    try:
        path = write_token_file(tmp_path / "job" / "control.token", credentials)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token_file(path) == credentials
    assert sorted(p.name for p in path.parent.iterdir()) == ["control.token"]  # no temporary left behind
    write_token_file(path, credentials)  # rewriting (a restarted driver) replaces the file
    assert read_token_file(path) == credentials
    assert credentials.token not in repr(credentials)


def test_token_file_readable_by_others_is_refused(tmp_path: Path, credentials: Credentials) -> None:
    path = write_token_file(tmp_path / "control.token", credentials)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token_file(path)
    with pytest.raises(ConfigError, match="cannot open token file"):
        read_token_file(tmp_path / "missing")


def _raw_status(served: Served, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    with raw_channel(served.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Status(coordinator_pb2.StatusRequest(header=header(served.credentials)), timeout=WAIT_S,
                        metadata=metadata)
    return info.value


def test_call_without_token_is_unauthenticated(coordinator: Served) -> None:
    error = _raw_status(coordinator, ())
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED and "no bearer token" in error.details()
    error = _raw_status(coordinator, (("authorization", coordinator.credentials.token),))  # no "Bearer "
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    assert coordinator.handler.calls == []


def test_wrong_token_is_unauthenticated(owner: Served) -> None:
    wrong = Credentials(job_id=owner.credentials.job_id, token="x" * 43)
    with OwnerClient(owner.client_config(credentials=wrong)) as client:
        with pytest.raises(AuthError, match="wrong bearer token") as info:
            client.step(ARGS)
        assert info.value.__cause__.code() is grpc.StatusCode.UNAUTHENTICATED
        # Streams are guarded too.
        with pytest.raises(AuthError), client.heartbeats(0.05) as beats:
            next(beats)
    assert owner.handler.calls == [] and owner.handler.beats == 0


def test_unknown_method_is_refused_without_token(owner: Served) -> None:
    with raw_channel(owner.address) as channel:
        probe = channel.unary_unary("/zero_ray.v1.PartitionOwner/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            probe(b"", timeout=WAIT_S)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_wrong_job_id_is_refused(owner: Served) -> None:
    other_job = Credentials(job_id="job-earlier", token=owner.credentials.token)
    with OwnerClient(owner.client_config(credentials=other_job)) as client:
        with pytest.raises(ControlError, match="job_id='job-earlier'") as info:
            client.step(ARGS)
    assert info.value.__cause__.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "job-test" in str(info.value)
    assert owner.handler.calls == []


def test_unknown_protocol_version_is_refused(owner: Served) -> None:
    with OwnerClient(owner.client_config(protocol_version=99)) as client:
        with pytest.raises(ControlError, match=rf"protocol_version=99.*speaks \[{PROTOCOL_VERSION}\]") as info:
            client.stats()
    assert info.value.__cause__.code() is grpc.StatusCode.FAILED_PRECONDITION
    # A request without any header (a client that forgot it) names version 0.
    with raw_channel(owner.address) as channel:
        stub = owner_pb2_grpc.PartitionOwnerStub(channel)
        with pytest.raises(grpc.RpcError, match="protocol_version=0"):
            stub.Stats(owner_pb2.StatsRequest(), timeout=WAIT_S, metadata=bearer_metadata(owner.credentials.token))
    assert owner.handler.calls == []


def test_a_client_of_the_previous_protocol_is_refused_naming_both_versions(owner: Served) -> None:
    # Version 2 ran membership operations as Ray calls and carried failures as status text only.
    assert PROTOCOL_VERSION == 3
    with OwnerClient(owner.client_config(protocol_version=2)) as client:
        with pytest.raises(ControlError, match=r"client speaks protocol_version=2, which this server does not "
                                               r"\(it speaks \[3\]\)") as info:
            client.setup()
    assert info.value.code == "FAILED_PRECONDITION"
    assert not isinstance(info.value, AuthError)  # a refusal before the handler: no FailureDetail either
    assert owner.handler.calls == []
