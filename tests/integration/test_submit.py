"""`zero-ray submit` / `zr.submit` against a real Ray head with its dashboard and token auth.

The head is a `ray start --head --block` subprocess owned by this module: its own temp dir and
ports (so it cannot meet another Ray on the machine), its own random token, and a `python` at the
front of its PATH that is the wrong interpreter on purpose, so that a bare `python` entrypoint
only works if zero_ray.submit resolves it. At the end its process group is stopped and every
process it started is checked to be gone. The session-wide `ray_session` fixture is not used.

The first tests need no cluster: how an entrypoint is built and where the token comes from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_head import Head, ray_head
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
    assert "zero_ray.cli.submit_command" in cli._COMMAND_MODULES
    assert cli.main(["submit", "--address", "http://127.0.0.1:1"]) == 2  # no command after --


# -- a real head ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    with ray_head(path_prefix=_wrong_python_dir(tmp_path_factory.mktemp("bin"))) as h:
        yield h


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
