"""`zero-ray submit` / `zr.submit` against a real Ray head with its dashboard and token auth.

The head is a `ray start --head --block` subprocess owned by this module: its own temp dir and
ports (so it cannot meet another Ray on the machine), its own random token, and a `python` at the
front of its PATH that is the wrong interpreter on purpose, so that a bare `python` entrypoint
only works if zero_ray.submit resolves it. At the end its process group is stopped and every
process it started is checked to be gone. The session-wide `ray_session` fixture is not used.

The first tests need no cluster: how an entrypoint is built and where the token comes from.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests_paths import REPO_ROOT

import zero_ray as zr
from zero_ray import cli
from zero_ray.errors import AuthError, ConfigError
from zero_ray.submit import EXIT_TIMEOUT, build_entrypoint, resolve_token

pytestmark = pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")  # Ray's own client

STEP_LINE = re.compile(r"^step (\d)/3 loss=(\d+\.\d+)$", re.MULTILINE)
# A `python` that is not the interpreter running Ray: the stand-in for the system /usr/bin/python3
# (no ray, no torch) that a bare `python3` ran as on a head started with a minimal PATH.
WRONG_PYTHON = "#!/bin/sh\necho 'wrong interpreter: this is not the Python that runs Ray' >&2\nexit 97\n"
HEAD_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0


# -- no cluster needed ----------------------------------------------------------------------------

def _wrong_python_dir(parent: Path) -> Path:
    """A directory whose `python` and `python3` fail, to put at the front of a PATH."""
    bin_dir = parent / "wrong-bin"
    bin_dir.mkdir()
    for name in ("python", "python3"):
        (bin_dir / name).write_text(WRONG_PYTHON)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_entrypoint_other_commands_are_quoted_as_given() -> None:
    assert build_entrypoint(["bash", "-c", "echo a b"]) == "bash -c 'echo a b'"
    assert build_entrypoint(["/opt/py/bin/python", "x.py"]) == "/opt/py/bin/python x.py"


def test_entrypoint_runtime_env_interpreters_win() -> None:
    # Workers run py_executable; the driver should too.
    assert build_entrypoint(["python", "a b.py"], {"py_executable": "uv run python"}) == "uv run python 'a b.py'"
    # pip/uv/conda activate their own environment in the supervisor: its `python` is theirs.
    assert build_entrypoint(["python", "x.py"], {"pip": ["requests"]}) == "python x.py"


def test_bare_python_prefers_the_path_python_when_it_has_ray() -> None:
    ray_dir = str(Path(sys.executable).parent)
    names = [n for n in ("python", "python3") if (Path(ray_dir) / n).exists()]
    if not names:
        pytest.skip(f"{ray_dir} has neither python nor python3")
    command = build_entrypoint([names[0], "-c", "import sys; print(sys.executable)"])
    out = subprocess.run(["/bin/sh", "-c", command], env={**os.environ, "PATH": f"{ray_dir}:/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert Path(out).parent == Path(ray_dir)


def test_bare_python_falls_back_to_the_parent_interpreter(tmp_path: Path) -> None:
    # On a Ray cluster the entrypoint's parent is the job supervisor; here it is this process,
    # which has imported ray (its environment is found from ray's mapped _raylet.so even when
    # this interpreter is a virtualenv's that was never activated).
    import ray  # noqa: F401

    if not Path(f"/proc/{os.getpid()}/exe").exists():
        pytest.skip("no /proc here: the fallback to the supervisor's interpreter is Linux-only")
    bin_dir = _wrong_python_dir(tmp_path)
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    command = build_entrypoint(["python", "-c", "import sys, ray; print(sys.executable)"])
    proc = subprocess.run(["/bin/sh", "-c", command], env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert os.path.realpath(proc.stdout.strip()) == os.path.realpath(sys.executable)


def test_bare_python_uses_an_activated_virtualenv_before_the_parent(tmp_path: Path) -> None:
    bin_dir = _wrong_python_dir(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # Stands in for a virtualenv's python (one with ray): runs this interpreter, saying it was
    # chosen. A symlink would not do: Python resolves it to a base interpreter, which may lack ray.
    standin = venv / "bin" / "python"
    standin.write_text(f"#!/bin/sh\nZR_STANDIN=venv exec {sys.executable} \"$@\"\n")
    standin.chmod(0o755)
    command = build_entrypoint(["python", "-c", "import os; print(os.environ.get('ZR_STANDIN'))"])
    proc = subprocess.run(["/bin/sh", "-c", command],
                          env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "VIRTUAL_ENV": str(venv)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "venv"


def test_token_sources_in_rays_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    assert resolve_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-default-file\n")
    assert resolve_token().value == "from-default-file"
    (tmp_path / "tok").write_text("from-path-env")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert resolve_token().value == "from-path-env"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert resolve_token().value == "from-env"
    token = resolve_token("explicit")
    assert token.value == "explicit" and "explicit" not in repr(token)  # never shown
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="cannot read the token file"):
        resolve_token()


def test_invalid_arguments_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="dashboard"):
        zr.submit(["python", "x.py"], address="127.0.0.1:6379")
    with pytest.raises(ConfigError, match="empty"):
        zr.submit([], address="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="not a directory"):
        zr.submit(["true"], address="http://127.0.0.1:1", working_dir=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="timeout_s"):
        zr.submit(["true"], address="http://127.0.0.1:1", working_dir=str(tmp_path), timeout_s=0)


def test_submit_is_a_registered_subcommand() -> None:
    assert "zero_ray.cli.submit" in cli._COMMAND_MODULES
    assert cli.main(["submit", "--address", "http://127.0.0.1:1"]) == 2  # no command after --


# -- a real head ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Head:
    address: str
    token: str
    temp_dir: Path


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


def _stop_head(proc: subprocess.Popen[bytes], temp_dir: Path) -> None:
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


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    # Short path: Ray's unix sockets live under the temp dir and socket paths are limited to ~107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="zrs-", dir="/tmp"))
    token = secrets.token_hex(32)
    dashboard_port = _free_port()
    bin_dir = _wrong_python_dir(temp_dir)
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update({
        # Token authentication, explicitly: this token and no other (the variable outranks any
        # ~/.ray/auth_token), so the tests do not depend on the machine's Ray configuration.
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "OMP_NUM_THREADS": "1",
    })
    ports = {flag: _free_port() for flag in (
        "--port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
        "--metrics-export-port", "--ray-client-server-port", "--node-manager-port", "--object-manager-port")}
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--temp-dir={temp_dir}", "--num-cpus=4", "--num-gpus=0", "--include-dashboard=true",
               "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
               *(f"{flag}={port}" for flag, port in ports.items())]
    log = temp_dir / "head.log"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(command, env=env, cwd=temp_dir, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dashboard_port}"
        _wait_for_dashboard(proc, address, token, log)
        yield Head(address=address, token=token, temp_dir=temp_dir)
    finally:
        _stop_head(proc, temp_dir)


@pytest.fixture
def with_token(head: Head, monkeypatch: pytest.MonkeyPatch) -> Head:
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", head.token)
    return head


@pytest.fixture
def without_token(head: Head, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Head:
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token either
    return head


def _assert_three_steps_and_done(stdout: str) -> None:
    steps = [int(m.group(1)) for m in STEP_LINE.finditer(stdout)]
    assert steps == [1, 2, 3], stdout
    assert re.search(r"^done$", stdout, flags=re.MULTILINE), stdout


STAND_IN = textwrap.dedent('''\
    """Stands in for examples/submit_job.py without the engine: the same output, from Ray tasks."""
    import ray

    ray.init()  # the job's cluster, with the token the driver inherits from the head


    @ray.remote
    def loss(step: int) -> float:
        return 1.0 / step


    for step in range(1, 4):
        print(f"step {step}/3 loss={ray.get(loss.remote(step)):.6f}", flush=True)
    print("done", flush=True)
''')


@pytest.mark.slow
def test_stand_in_job_end_to_end(with_token: Head, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "job"
    work.mkdir()
    (work / "stand_in.py").write_text(STAND_IN)
    status = cli.main(["submit", "--address", with_token.address, "--working-dir", str(work), "--timeout", "300",
                       "--", "python", "stand_in.py"])
    out, err = capsys.readouterr()
    assert status == 0, f"stdout:\n{out}\nstderr:\n{err}"
    _assert_three_steps_and_done(out)
    assert "wrong interpreter" not in out + err


@pytest.mark.slow
def test_example_job_end_to_end(with_token: Head, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["submit", "--address", with_token.address, "--working-dir", REPO_ROOT, "--timeout", "480",
                       "--", "python", "examples/submit_job.py"])
    out, err = capsys.readouterr()
    assert status == 0, f"stdout:\n{out}\nstderr:\n{err}"
    _assert_three_steps_and_done(out)
    losses = [float(m.group(2)) for m in STEP_LINE.finditer(out)]
    assert losses[-1] < losses[0], f"the loss did not go down over three AdamW steps: {losses}"


@pytest.mark.slow
def test_failing_entrypoint_returns_its_exit_status(with_token: Head, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    status = zr.submit(["python", "-c", "import sys; print('failing on purpose'); sys.exit(3)"],
                       address=with_token.address, working_dir=str(tmp_path), timeout_s=300)
    out, err = capsys.readouterr()
    assert status == 3, f"stdout:\n{out}\nstderr:\n{err}"
    assert "failing on purpose" in out
    assert "FAILED" in err


@pytest.mark.slow
def test_missing_token_is_a_clear_error(without_token: Head, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AuthError, match="token authentication on and no token was found"):
        zr.submit(["true"], address=without_token.address, working_dir=str(tmp_path), timeout_s=60)
    assert cli.main(["submit", "--address", without_token.address, "--working-dir", str(tmp_path),
                     "--", "true"]) == 2
    assert "no token was found" in capsys.readouterr().err


@pytest.mark.slow
def test_wrong_token_is_a_clear_error(without_token: Head, tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="refused the token from the token passed in"):
        zr.submit(["true"], address=without_token.address, working_dir=str(tmp_path), token="0" * 64, timeout_s=60)


@pytest.mark.slow
def test_timeout_stops_the_job(with_token: Head, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ray.job_submission import JobSubmissionClient

    started = time.monotonic()
    status = zr.submit(["python", "-c", "import time; print('sleeping', flush=True); time.sleep(600)"],
                       address=with_token.address, working_dir=str(tmp_path), timeout_s=10)
    assert status == EXIT_TIMEOUT
    assert time.monotonic() - started < 10 + 70  # the timeout, then a bounded wait for the stop
    err = capsys.readouterr().err
    job_id = re.search(r"submitted job (\S+)", err).group(1)
    client = JobSubmissionClient(with_token.address, headers={"Authorization": f"Bearer {with_token.token}"})
    assert str(client.get_job_status(job_id)) == "STOPPED"
