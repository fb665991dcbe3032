"""The owner's membership operations over gRPC (once Ray calls), and failures as structured
FailureDetails rather than status text."""

from __future__ import annotations

import grpc
import pytest
import torch
from control_fakes import DESCRIPTION, LAYOUT, OWNER_STATUS, Served

from zero_ray.control import json_fields as plain
from zero_ray.control.auth import Credentials
from zero_ray.control.client import OwnerClient
from zero_ray.control.handlers import SetupResult
from zero_ray.control.failure_status import FAILURE_TRAILER, MAX_DETAIL_BYTES
from zero_ray.errors import AuthError, CheckpointError, ConfigError, OwnerError, RemoteFailure


def test_membership_operations_round_trip(owner: Served) -> None:
    client, handler = owner.client, owner.handler
    assert client.setup() == SetupResult(rank=1, layout=LAYOUT)
    assert client.reform(4) is True and client.reform(5) is False
    client.set_peers(2, 0)
    assert client.resize_info() == DESCRIPTION  # integer keys (parameter indices) come back as integers
    assert client.reshard(old_world=2, new_world=3, generation=6, description=DESCRIPTION) == 1 << 40
    plan = {"old_world": 2, "holders": [0, 1], "scalars": DESCRIPTION}
    assert client.rebuild(position=1, world_size=3, generation=7, restore=plan) == 123
    assert client.rebuild(position=0, world_size=3, generation=7, restore=None) == 0
    assert client.snapshots(-1) == {1: {"step": -1, "world_size": 4, "scalars": DESCRIPTION}}
    assert client.snapshots(5, layout_complete=True)[1]["step"] == 5
    assert client.status() == OWNER_STATUS
    client.close_owner()
    assert handler.calls == ["setup", "reform", "reform", "set_peers", "resize_info", "reshard", "rebuild",
                             "rebuild", "snapshots", "snapshots", "status", "close"]
    assert handler.received[3] == ("set_peers", (2, 0))
    assert handler.received[5] == ("reshard", (2, 3, 6, DESCRIPTION))
    assert handler.received[6] == ("rebuild", (1, 3, 7, plan))
    assert handler.received[7] == ("rebuild", (0, 3, 7, None))  # empty restore_json: fresh state
    assert handler.received[8:10] == [("snapshots", (-1, False)), ("snapshots", (5, True))]


def _nested_failure() -> CheckpointError:
    try:
        raise ValueError("the manifest lists 3 files")
    except ValueError as inner:
        try:
            raise CheckpointError("rank-00001 is missing") from inner
        except CheckpointError as err:
            return err


def test_a_handler_failure_arrives_as_fields(owner: Served) -> None:
    owner.handler.fail_with = _nested_failure()
    owner.handler.phase = "updating"
    with pytest.raises(RemoteFailure) as info:
        owner.client.reshard(old_world=2, new_world=3, generation=1, description={})
    detail = info.value.detail
    assert (detail.type, detail.message, detail.rank, detail.phase, detail.operation) == \
        ("CheckpointError", "rank-00001 is missing", 1, "updating", "PartitionOwner.Reshard")
    assert detail.cause == "ValueError: the manifest lists 3 files"
    assert "_nested_failure" in detail.remote_traceback  # the frame that raised, on the server
    assert info.value.code == "FAILED_PRECONDITION"
    assert info.value.__cause__.code() is grpc.StatusCode.FAILED_PRECONDITION
    # The driver's error: the owner's own type, saying where, in what and in which phase.
    err = detail.error("rank 1 on node 10.0.0.6 (pid 77)")
    assert type(err) is CheckpointError and err.failure is detail
    assert str(err).startswith("rank 1 on node 10.0.0.6 (pid 77) failed in PartitionOwner.Reshard (updating): "
                               "rank-00001 is missing\ncaused by ValueError: the manifest lists 3 files")
    assert "Remote traceback (rank 1)" in str(err)


def test_a_foreign_exception_becomes_an_owner_error_with_the_rank(owner: Served) -> None:
    owner.handler.fail_with = RuntimeError("loss_fn failed")
    with pytest.raises(RemoteFailure) as info:
        owner.client.setup()
    err = info.value.detail.error("rank 3", rank=3)  # the caller's index wins over the owner's own
    assert type(err) is OwnerError and err.rank == 3
    assert "RuntimeError: loss_fn failed" in str(err) and "Remote traceback" in str(err)


def test_the_status_text_is_not_what_the_error_is_built_from(owner: Served) -> None:
    # A message that looks like another "Type: message" status: the type still comes from its field.
    owner.handler.fail_with = ConfigError("OwnerError: lr=-1 must be > 0")
    with pytest.raises(RemoteFailure) as info:
        owner.client.reform(1)
    assert info.value.detail.type == "ConfigError"
    assert type(info.value.detail.error("rank 1")) is ConfigError


def test_a_long_failure_stays_under_the_trailer_budget(owner: Served) -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise CheckpointError("é" * 50_000)  # multi-byte characters, cut anywhere
        deep(n - 1)

    try:
        deep(200)
    except CheckpointError as err:
        owner.handler.fail_with = err
    with pytest.raises(RemoteFailure) as info:
        owner.client.setup()
    trailers = dict(info.value.__cause__.trailing_metadata())
    assert len(trailers[FAILURE_TRAILER]) <= MAX_DETAIL_BYTES
    detail = info.value.detail
    assert detail.message.endswith("(truncated)") and "in deep" in detail.remote_traceback


def test_refusals_before_the_handler_carry_no_detail(owner: Served) -> None:
    wrong = Credentials(job_id=owner.credentials.job_id, token="y" * 43)
    with OwnerClient(owner.client_config(credentials=wrong)) as client:
        with pytest.raises(AuthError) as info:
            client.reform(1)
    assert not isinstance(info.value, RemoteFailure) and info.value.code == "UNAUTHENTICATED"
    assert owner.handler.calls == []


def test_plain_data_keeps_integer_keys_and_refuses_tensors() -> None:
    value = {0: {"holders": (1, 0), "scale": float("inf")}, "table": {3: None}, "__pairs__": 1}
    assert plain.loads(plain.dumps(value)) == {0: {"holders": [1, 0], "scale": float("inf")}, "table": {3: None},
                                               "__pairs__": 1}
    with pytest.raises(ConfigError, match=r"value\[0\]\.t is a Tensor"):
        plain.dumps({0: {"t": torch.zeros(1)}})
    with pytest.raises(ConfigError, match="not a plain-data JSON document"):
        plain.loads(b"\x00")
