"""`zero-ray status / checkpoint now / stop / resize` against a fake coordinator."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest
from control_fakes import STATUS, Served

from zero_ray.cli import _COMMAND_MODULES
from zero_ray.cli import operator_commands as control_cli
from zero_ray.cli.subcommand_groups import subcommand_group
from zero_ray.control.auth import Credentials, write_token_file


def _parser() -> argparse.ArgumentParser:
    # Only this module's commands: the full registry names modules other engineers are still writing.
    parser = argparse.ArgumentParser(prog="zero-ray")
    control_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def token_file(tmp_path: Path, coordinator: Served) -> str:
    return str(write_token_file(tmp_path / "control.token", coordinator.credentials))


def test_status_prints_job_and_ranks(coordinator: Served, token_file: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["status", "--address", coordinator.address, "--token-file", token_file]) == 0
    out = capsys.readouterr().out
    for expected in ("state       running", "world size  2", "stage       2", "step        1200",
                     "last loss   2.3412", "grads=1.0 GiB params=3.0 GiB", "10.0.0.6", "NO", "never"):
        assert expected in out, f"{expected!r} missing from:\n{out}"


def test_format_status_dates_heartbeats() -> None:
    text = control_cli.format_status(STATUS, now=STATUS.ranks[0].last_heartbeat + 2.5)
    rank0 = next(line for line in text.splitlines() if line.startswith("0 "))
    assert "yes" in rank0 and "2.5s ago" in rank0


def test_stop_resize_and_checkpoint_now(coordinator: Served, token_file: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--address", coordinator.address, "--token-file", token_file]
    assert _run(["stop", *common, "--reason", "done"]) == 0
    assert "the job is stopping" in capsys.readouterr().out
    assert _run(["resize", "4", *common]) == 0
    assert "2 -> 4" in capsys.readouterr().out
    assert _run(["checkpoint", "now", *common, "--path", "/ckpt/x"]) == 0
    assert "step 1200 written to /ckpt/x" in capsys.readouterr().out
    assert coordinator.handler.calls == [("stop", "done"), ("resize", 4), ("checkpoint", "/ckpt/x")]


def test_bad_token_is_one_line_and_exit_1(coordinator: Served, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    wrong = write_token_file(tmp_path / "wrong.token", Credentials(job_id="job-test", token="w" * 43))
    assert _run(["status", "--address", coordinator.address, "--token-file", str(wrong)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zero-ray status: error:") and "wrong bearer token" in err
    assert coordinator.handler.calls == []


def test_unreachable_address_is_one_line_and_exit_1(token_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert _run(["stop", "--address", f"127.0.0.1:{port}", "--token-file", token_file, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zero-ray stop: error:" in err and "unreachable" in err


def test_missing_token_file_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["checkpoint", "now", "--address", "127.0.0.1:1", "--token-file", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zero-ray checkpoint now: error: cannot open token file" in err


def test_checkpoint_group_is_shared_with_offline_commands() -> None:
    parser = argparse.ArgumentParser(prog="zero-ray")
    subparsers = parser.add_subparsers(dest="command", required=True)
    control_cli.register(subparsers)
    # What the offline checkpoint module will do: join the same group.
    subcommand_group(subparsers, "checkpoint", help="ignored: the group exists").add_parser("inspect")
    assert parser.parse_args(["checkpoint", "inspect"]).checkpoint_action == "inspect"
    assert parser.parse_args(["checkpoint", "now", "--address", "a:1", "--token-file", "f"]).path is None
    assert "zero_ray.cli.operator_commands" in _COMMAND_MODULES
