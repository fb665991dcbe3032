"""A real `ray start --head` for the tests that need a cluster of their own (job submission, a
driver killed and another attaching): its own temp dir, ports and token, stopped at the end
with every process it started checked to be gone."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HEAD_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Head:
    address: str  # the dashboard's http:// address (job submission)
    gcs_address: str  # HOST:PORT, what ray.init(address=...) takes
    token: str
    temp_dir: Path

    def env(self) -> dict[str, str]:
        """The environment a driver process of this cluster needs (token auth, no other Ray)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": self.gcs_address,
                    "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"})
        return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


def _wait_for_dashboard(proc: subprocess.Popen[bytes], url: str, token: str, log: Path) -> None:
    """Poll /api/version (which needs the token) until it answers, within HEAD_START_TIMEOUT_S."""
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n{_log_tail(log)}")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                json.load(answer)
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            time.sleep(0.5)
    raise TimeoutError(f"the dashboard at {url} did not answer within {HEAD_START_TIMEOUT_S:g} s:\n{_log_tail(log)}")


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start time) of a process from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3 of stat(5)
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every process below ``root`` (the start time tells a reused pid apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[1], []).append(int(entry.name))
            starts[int(entry.name)] = stat[3]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def _alive(processes: dict[int, int]) -> dict[int, int]:
    """Those of ``processes`` still running (zombies count as gone)."""
    return {pid: start for pid, start in processes.items()
            if (stat := _stat(pid)) is not None and stat[3] == start and stat[0] != "Z"}


def _wait_gone(processes: dict[int, int], timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    while (alive := _alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _signal_all(processes: dict[int, int], sig: signal.Signals) -> None:
    for pid in _alive(processes):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _mentioning(text: str) -> dict[int, int]:
    """{pid: start time} of the processes whose command line contains ``text``."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                if (stat := _stat(int(entry.name))) is not None:
                    found[int(entry.name)] = stat[3]
        except OSError:
            continue
    return found


def stop_head(proc: subprocess.Popen[bytes], temp_dir: Path) -> None:
    """Stop the head and make sure every process it started is gone.

    SIGTERM goes to the head's process group and, by pid, to every process below it: Ray starts
    its workers in process groups of their own. Whatever is still running after STOP_GRACE_S
    (the GCS takes ~30 s to exit on SIGTERM) is killed; all of it was started by this fixture.
    """
    # Below the head, plus anything that names its temp dir (its GCS, raylet and agents do), in
    # case something left the process tree: the temp dir is unique to this fixture.
    processes = {**_descendants(proc.pid), **_mentioning(str(temp_dir))}
    processes.pop(os.getpid(), None)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # start_new_session: the group id is the pid
    except ProcessLookupError:
        pass
    _signal_all(processes, signal.SIGTERM)
    lingering = _wait_gone(processes, STOP_GRACE_S)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _signal_all(lingering, signal.SIGKILL)
    proc.wait(timeout=STOP_GRACE_S)
    still_alive = _wait_gone(lingering, STOP_GRACE_S)
    late = _alive(_mentioning(str(temp_dir)))  # started after the snapshot above
    _signal_all(late, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not still_alive, f"processes of the test's Ray head survived SIGKILL: {sorted(still_alive)}"
    assert not late, f"processes naming the test head's temp dir were left running: {sorted(late)}"



@contextmanager
def ray_head(*, num_cpus: int = 4, path_prefix: Path | None = None) -> Iterator[Head]:
    """A `ray start --head --block` subprocess with token auth and its dashboard, for the block."""
    # Short path: Ray's unix sockets live under the temp dir and socket paths are limited to ~107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="zrs-", dir="/tmp"))
    token = secrets.token_hex(32)
    dashboard_port = _free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update({
        # Token authentication, explicitly: this token and no other (the variable outranks any
        # ~/.ray/auth_token), so the tests do not depend on the machine's Ray configuration.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    })
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{os.environ.get('PATH', '')}"
    ports = {flag: _free_port() for flag in (
        "--port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
        "--metrics-export-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port")}
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=true",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
               *(f"{flag}={port}" for flag, port in ports.items())]
    log = temp_dir / "head.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(command, env=env, cwd=temp_dir, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dashboard_port}"
        _wait_for_dashboard(proc, address, token, log)
        yield Head(address=address, gcs_address=f"127.0.0.1:{ports['--port']}", token=token, temp_dir=temp_dir)
    finally:
        stop_head(proc, temp_dir)
