"""Run a command on a Ray cluster as a Ray job: `zr.submit([...], address=...)` and
`zero-ray submit`.

Over `ray.job_submission.JobSubmissionClient`: the working directory is uploaded and becomes the
job's cwd and the head of its PYTHONPATH (for the driver and every actor, so the partition owners
import the same zero_ray as the driver), a bare ``python`` is made to mean the interpreter that
runs Ray on the cluster, the cluster's token is sent, the job's output is streamed back, and the
job's outcome becomes an exit status.

Importing this module is cheap: Ray is imported when a job is submitted.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from zero_ray.errors import AuthError, ConfigError, ControlError

# Ray's own names for the token (Ray >= 2.52), looked up in Ray's order of precedence: the
# variable, then the file it names, then the default file that `ray get-auth-token --generate`
# and a local `ray start` use.
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")

# What `submit` returns when timeout_s runs out (the job is stopped first): the convention of
# coreutils' `timeout`, so shell callers can tell a timeout from the job's own failure.
EXIT_TIMEOUT = 124

_TERMINAL = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
# Never worth uploading; added to any `excludes` the caller's runtime env has. Ray already skips
# what .gitignore lists.
_DEFAULT_EXCLUDES = (".git", "**/__pycache__", "*.pyc", ".pytest_cache")
# Runtime-env fields whose plugins activate an environment of their own in the job supervisor
# (pip/uv: a virtualenv, conda: a conda env), so the `python` on the job's PATH is theirs.
_ENV_ACTIVATING_FIELDS = ("pip", "uv", "conda")
_BARE_PYTHONS = frozenset({"python", "python3"})

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class SubmitSpec:
    """One job submission, validated before anything is sent.

    entrypoint_args: the command, as argv (``["python", "train.py", "--lr", "3e-4"]``).
    address: the job server, i.e. the head's dashboard: ``http://HOST:8265``.
    working_dir: a local directory to upload (or a remote URI Ray accepts, e.g. ``s3://...zip``).
    runtime_env: Ray runtime env; ``working_dir`` is set from the field above, not here.
    follow: stream the logs and wait for the outcome; False returns once the job is accepted.
    timeout_s: bound on the whole call; when it runs out the job is stopped.
    request_timeout_s: bound on each call to the job server.
    upload_timeout_s: bound on the submission call, which includes the upload.
    poll_interval_s: how often the job's status is checked while its log is quiet.
    """

    entrypoint_args: tuple[str, ...]
    address: str
    working_dir: str = "."
    runtime_env: Mapping[str, Any] = field(default_factory=dict)
    follow: bool = True
    timeout_s: float | None = None
    request_timeout_s: float = 60.0
    upload_timeout_s: float = 600.0
    poll_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.entrypoint_args:
            raise ConfigError("entrypoint_args is empty: give the command to run, e.g. ['python', 'train.py']")
        bad = [a for a in self.entrypoint_args if not isinstance(a, str)]
        if bad:
            raise ConfigError(f"entrypoint_args must be strings; got {bad!r} in {list(self.entrypoint_args)!r}")
        if not self.address.startswith(("http://", "https://")):
            raise ConfigError(f"address={self.address!r} is not the job server's URL; use the head's dashboard "
                              "address, e.g. http://HOST:8265")
        if not isinstance(self.runtime_env, Mapping):
            raise ConfigError(f"runtime_env={self.runtime_env!r} must be a dict")
        if "working_dir" in self.runtime_env:
            raise ConfigError(f"runtime_env sets working_dir={self.runtime_env['working_dir']!r}; pass it as "
                              "working_dir= instead so there is one source for it")
        if not _is_uri(self.working_dir) and not Path(self.working_dir).is_dir():
            raise ConfigError(f"working_dir={self.working_dir!r} is not a directory (it is uploaded as the job's cwd)")
        for name in ("timeout_s", "request_timeout_s", "upload_timeout_s", "poll_interval_s"):
            value = getattr(self, name)
            if value is None and name == "timeout_s":
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")


@dataclass(frozen=True, kw_only=True)
class Token:
    """The cluster's token and where it was found (for error messages; the value is never shown)."""

    value: str = field(repr=False)
    source: str

    def __post_init__(self) -> None:
        if not self.value or self.value != self.value.strip():
            raise ConfigError(f"the token from {self.source} is empty or has surrounding whitespace")


def _is_uri(path: str) -> bool:
    return "://" in path


def read_token_file(path: Path, *, source: str) -> Token:
    """The token held in the file ``path`` (``source`` says where the path came from)."""
    try:
        text = path.expanduser().read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ConfigError(f"cannot read the token file {str(path)!r} ({source}): {err.strerror or err}") from err
    if not text:
        raise ConfigError(f"the token file {str(path)!r} ({source}) is empty")
    return Token(value=text, source=source)


def resolve_token(explicit: str | None = None) -> Token | None:
    """The token to send: ``explicit``, else ``$RAY_AUTH_TOKEN``, else the file
    ``$RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``; None if there is none.

    The same sources, in the same order, as Ray's own token loader, so whatever token makes
    ``ray job submit`` work makes this work. A ``$RAY_AUTH_TOKEN_PATH`` that cannot be read is an
    error rather than a fall-through, as it is for Ray (a misconfiguration, not an absence).
    """
    if explicit is not None:
        return Token(value=explicit.strip(), source="the token passed in (token= or --token-file)")
    from_env = os.environ.get(TOKEN_ENV, "").strip()
    if from_env:
        return Token(value=from_env, source=f"${TOKEN_ENV}")
    path_env = os.environ.get(TOKEN_PATH_ENV, "").strip()
    if path_env:
        return read_token_file(Path(path_env), source=f"${TOKEN_PATH_ENV}")
    default = DEFAULT_TOKEN_FILE.expanduser()
    if default.is_file():
        return read_token_file(default, source=str(DEFAULT_TOKEN_FILE))
    return None


# How a bare `python` is resolved on the cluster, and why (see build_entrypoint).
#
# Ray runs the entrypoint with `/bin/sh -c` from the job supervisor, a Ray worker process, with
# the supervisor's environment: a bare `python` is whatever the PATH of the `ray start` that
# started the head finds first. That is not necessarily the interpreter running Ray: on the
# machine this was written on, Ray ran on /root/.pyenv/versions/3.11.7/bin/python, and with the
# head started under PATH=/usr/local/bin:/usr/bin:/bin a job's `python` was not found at all and
# `python3` was the system /usr/bin/python3, without ray or torch ("No module named 'ray'"). The
# client's sys.executable is no answer either: the cluster is another machine, or a container
# whose Python lives elsewhere (/home/ray/anaconda3 in Ray's images).
#
# The cluster-side sys.executable is the supervisor's own interpreter, /proc/$PPID/exe of the
# entrypoint's shell. Its process title is overwritten (`ray::JobSupervisor`), so its argv[0]
# is lost, and /proc/.../exe resolves symlinks: for a Ray run from a virtualenv it names the base
# interpreter, without the virtualenv's packages. So, in this order, the first that can find ray:
#   1. the PATH's python: right for activated virtualenvs, for pip/uv/conda runtime envs (which
#      activate their own environment in the supervisor) and for Ray's images (PATH starts with
#      their Python), so the common case is what a bare `python` always meant;
#   2. $VIRTUAL_ENV/bin/python: a virtualenv that was activated when Ray started, although
#      something else now comes first on PATH;
#   3. the environment the supervisor imported ray from: its memory map names ray's
#      `<env>/lib/pythonX.Y/site-packages/ray/_raylet.so`, and `<env>/bin/python` is that
#      environment's interpreter, a virtualenv's included, activated or not (seen: a venv
#      whose python is a symlink to pyenv's, where 4 named pyenv's python, without ray);
#   4. the supervisor's interpreter, unchecked (Ray on a pyenv or system Python with a PATH
#      that does not lead to it, ray installed outside a site-packages of its own);
#   5. the bare name, as before (no /proc: not Linux).
# The probe is `find_spec`, which looks for ray without importing it.
_RESOLVE_PYTHON = (
    'zr_has_ray() {{ [ -n "$1" ] && "$1" -c '
    '"import importlib.util as u, sys; sys.exit(u.find_spec(\'ray\') is None)" 2>/dev/null; }}; '
    'zr_py=$(command -v {name}); zr_has_ray "$zr_py"'
    ' || {{ zr_py=${{VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}}; zr_has_ray "$zr_py"; }}'
    ' || {{ zr_py=$(sed -n \'s#^.* \\(/.*\\)/lib/python[0-9.]*/site-packages/ray/_raylet[^/]*\\.so$#\\1/bin/python#p\' '
    '/proc/$PPID/maps 2>/dev/null | head -n 1); zr_has_ray "$zr_py"; }}'
    ' || zr_py=$(readlink /proc/$PPID/exe 2>/dev/null) || zr_py={name}; '
    'exec "$zr_py"'
)


def build_entrypoint(entrypoint_args: Sequence[str], runtime_env: Mapping[str, Any] | None = None) -> str:
    """The shell command Ray runs for ``entrypoint_args``, each argument quoted.

    A bare ``python``/``python3`` as the command becomes, in this order: the runtime env's
    ``py_executable`` (the interpreter its workers run, used as given since it may carry
    arguments, e.g. ``uv run python``); itself, when a pip/uv/conda runtime env activates an
    environment of its own; otherwise a shell snippet that picks, on the cluster when the job
    starts, an interpreter that can import ray (see _RESOLVE_PYTHON). Any other command, an
    interpreter given by path included, is left as it is.
    """
    args = list(entrypoint_args)
    if not args:
        raise ConfigError("entrypoint_args is empty: give the command to run, e.g. ['python', 'train.py']")
    command, rest = args[0], args[1:]
    env = runtime_env or {}
    if command not in _BARE_PYTHONS:
        return shlex.join(args)
    if env.get("py_executable"):
        interpreter = str(env["py_executable"])
    elif any(key in env for key in _ENV_ACTIVATING_FIELDS):
        return shlex.join(args)
    else:
        interpreter = _RESOLVE_PYTHON.format(name=command)
    return " ".join([interpreter, *(shlex.quote(a) for a in rest)])


def _runtime_env(spec: SubmitSpec) -> dict[str, Any]:
    env = dict(spec.runtime_env)
    if _is_uri(spec.working_dir):
        env["working_dir"] = spec.working_dir
    else:
        env["working_dir"] = str(Path(spec.working_dir).resolve())
        excludes = list(env.get("excludes", []))
        env["excludes"] = excludes + [e for e in _DEFAULT_EXCLUDES if e not in excludes]
    return env


def _bounded(what: str, fn: Callable[[], _T], timeout_s: float) -> _T:
    """``fn()``, waited for at most ``timeout_s``.

    Ray's job client sends its HTTP requests without a timeout, so a dashboard that accepts the
    connection and never answers would hang the caller forever. The call runs in a daemon thread
    that is abandoned (and dies with the process) if it does not finish in time.
    """
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread as it is
            outcome["error"] = err
        finally:
            finished.set()

    threading.Thread(target=run, name=f"zero-ray-submit: {what}", daemon=True).start()
    if not finished.wait(timeout_s):
        raise ControlError(f"{what}: the job server did not answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _JobServer:
    """The calls `submit` makes, each bounded in time and with Ray's errors turned into ours."""

    def __init__(self, spec: SubmitSpec, token: Token | None) -> None:
        self._spec = spec
        self._token = token
        headers = {"Authorization": f"Bearer {token.value}"} if token is not None else None
        # An Authorization header of our own makes Ray's client leave the header alone instead
        # of deriving one from this process's RAY_AUTH_MODE, which would need a process-wide
        # switch; the client sends the same headers on the log-tailing websocket.
        from ray.job_submission import JobSubmissionClient

        self.client = self.call("connecting", lambda: JobSubmissionClient(spec.address, headers=headers))

    def call(self, what: str, fn: Callable[[], _T], timeout_s: float | None = None) -> _T:
        from ray.exceptions import AuthenticationError

        address = self._spec.address
        try:
            return _bounded(f"{what} ({address})", fn, timeout_s or self._spec.request_timeout_s)
        except AuthenticationError as err:
            raise self._auth_error(str(err)) from err
        except OSError as err:  # refused connections, DNS, TLS (requests' errors are OSErrors)
            raise ControlError(f"{what}: cannot reach the job server at {address} ({err}); is the cluster up and "
                               "its dashboard port (8265 by default) reachable from here?") from err
        except RuntimeError as err:  # Ray's client raises RuntimeError for any non-2xx answer
            raise ControlError(f"{what}: the job server at {address} answered with an error: {err}") from err
        except ValueError as err:  # Ray's checks of the runtime env, e.g. a working_dir over its size limit
            raise ConfigError(f"{what}: {err}") from err

    def _auth_error(self, ray_message: str) -> AuthError:
        address = self._spec.address
        if self._token is None:
            return AuthError(
                f"the Ray cluster at {address} has token authentication on and no token was found here: pass "
                f"token=... (zero-ray submit --token-file FILE), set ${TOKEN_ENV}, or point ${TOKEN_PATH_ENV} at a "
                f"file holding it ({DEFAULT_TOKEN_FILE} is read last). On KubeRay the token is the `auth_token` "
                "key of the cluster's Secret; for a local `ray start` it is what `ray get-auth-token` prints.")
        if ray_message.startswith("Authentication failed"):  # Ray's wording for HTTP 403
            return AuthError(f"the Ray cluster at {address} refused the token from {self._token.source}: it is not "
                             "this cluster's token")
        return AuthError(f"the Ray cluster at {address} did not accept the token from {self._token.source}: "
                         f"{ray_message.splitlines()[0]}")


class _LogTail:
    """Follows a job's log over Ray's websocket in a daemon thread with its own event loop.

    The caller can then wait for the next chunk with a timeout and look at the job's status in
    between; waiting on Ray's async generator directly with a timeout would close it. If the
    socket hangs, the thread is cancelled and, failing that, abandoned.
    """

    END = object()

    def __init__(self, client: Any, job_id: str) -> None:
        self._client = client
        self._job_id = job_id
        self._chunks: queue.Queue[Any] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._pump())
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"zero-ray-submit: logs of {job_id}", daemon=True)

    async def _pump(self) -> None:
        async for chunk in self._client.tail_job_logs(self._job_id):
            self._chunks.put(chunk)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception as err:  # noqa: BLE001 - reported by the caller, which falls back to polling
            self.error = err
        finally:
            self._chunks.put(self.END)
            self._loop.close()

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout_s: float) -> Any:
        """The next chunk (str), END once the stream is over, or None if nothing came in time."""
        try:
            return self._chunks.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._loop.call_soon_threadsafe(self._task.cancel)
        except RuntimeError:  # the loop closed in between: the thread is finishing by itself
            pass
        self._thread.join(timeout_s)


def _note(message: str) -> None:
    # Our own messages go to stderr so that stdout carries the job's output alone.
    print(f"zero-ray: {message}", file=sys.stderr, flush=True)


def _status(value: Any) -> str:
    """A JobStatus (a str-valued enum) or a plain string, as the bare name: "SUCCEEDED"."""
    return str(getattr(value, "value", value))


def _exit_status(info: Any) -> int:
    """0 for SUCCEEDED; otherwise the entrypoint's exit code when it has a usable one, else 1."""
    if _status(info.status) == "SUCCEEDED":
        return 0
    code = getattr(info, "driver_exit_code", None)
    if isinstance(code, int) and code != 0:
        # Killed by a signal: Popen reports -N, shells report 128 + N.
        return code if 0 < code < 256 else (128 - code if -64 < code < 0 else 1)
    return 1


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _stop_after_timeout(server: _JobServer, job_id: str, spec: SubmitSpec) -> int:
    _note(f"job {job_id} did not finish within timeout_s={spec.timeout_s:g} s; stopping it")
    try:
        server.call("stopping the job", lambda: server.client.stop_job(job_id))
        # Bounded wait for the stop to take effect, so that nothing is left running on return.
        deadline = time.monotonic() + spec.request_timeout_s
        while time.monotonic() < deadline:
            if _status(server.call("job status", lambda: server.client.get_job_status(job_id))) in _TERMINAL:
                break
            time.sleep(spec.poll_interval_s)
        else:
            _note(f"job {job_id} had not stopped after {spec.request_timeout_s:g} s more")
    except ControlError as err:
        _note(f"could not stop job {job_id}: {err}")
    return EXIT_TIMEOUT


def _follow(server: _JobServer, job_id: str, spec: SubmitSpec, deadline: float | None) -> int:
    """Stream the job's log to stdout until the job is over; return its exit status."""
    out = sys.stdout
    printed = 0  # characters of the log written so far: the catch-up below starts there
    tail = _LogTail(server.client, job_id)
    tail.start()
    terminal_since: float | None = None
    try:
        while True:
            left = _remaining(deadline)
            if left is not None and left <= 0:
                return _stop_after_timeout(server, job_id, spec)
            chunk = tail.get(spec.poll_interval_s if left is None else min(spec.poll_interval_s, left))
            if chunk is _LogTail.END:
                break
            if chunk is not None:
                out.write(chunk)
                out.flush()
                printed += len(chunk)
                continue
            # The log is quiet: make sure the job is still running. Ray closes the stream after
            # the job ends; if it has not a few polls after the end, stop waiting for it.
            if _status(server.call("job status", lambda: server.client.get_job_status(job_id))) in _TERMINAL:
                now = time.monotonic()
                terminal_since = terminal_since or now
                if now - terminal_since > 5 * spec.poll_interval_s:
                    break
    finally:
        tail.stop()
    if tail.error is not None:
        _note(f"the log stream broke ({tail.error}); fetching the rest of the log")
    # A broken or abandoned stream may have missed the end of the log. The stream sends the log
    # file from its first byte, so what has been printed is a prefix of the full log.
    while True:
        info = server.call("job info", lambda: server.client.get_job_info(job_id))
        if _status(info.status) in _TERMINAL:
            break
        left = _remaining(deadline)
        if left is not None and left <= 0:
            return _stop_after_timeout(server, job_id, spec)
        time.sleep(spec.poll_interval_s if left is None else min(spec.poll_interval_s, left))
    logs = server.call("job logs", lambda: server.client.get_job_logs(job_id))
    if len(logs) > printed:
        out.write(logs[printed:])
        out.flush()
    code = _exit_status(info)
    status = _status(info.status)
    if code == 0:
        _note(f"job {job_id} {status}")
    else:
        message = (getattr(info, "message", "") or "").splitlines()
        _note(f"job {job_id} {status} (exit status {code})" + (f": {message[0]}" if message else ""))
    return code


def submit(entrypoint_args: Sequence[str], *, address: str, working_dir: str = ".",
           runtime_env: dict[str, Any] | None = None, token: str | None = None, follow: bool = True,
           timeout_s: float | None = None) -> int:
    """Run ``entrypoint_args`` on the Ray cluster whose job server is ``address`` and return
    the job's exit status: 0 if it SUCCEEDED, the entrypoint's non-zero exit code if it failed
    with one, 1 for any other failure (a runtime env that could not be set up, a stopped job),
    124 (EXIT_TIMEOUT) if ``timeout_s`` ran out, in which case the job has been stopped.

    ``working_dir`` is uploaded (less .git, caches and what .gitignore lists) and becomes the
    job's cwd and the front of its PYTHONPATH, on the driver and on every worker. A bare
    ``python`` runs the cluster's Ray interpreter (see build_entrypoint). The token comes from
    ``token``, else Ray's usual places (see resolve_token); a cluster with token authentication
    answers a missing or wrong token with AuthError. With ``follow`` the job's output is written
    to stdout as it is produced (our own messages go to stderr); without it, the call returns 0
    once the job is accepted.

    Raises ConfigError for invalid arguments, AuthError for refused credentials and
    ControlError when the job server cannot be reached or does not answer in time.
    """
    spec = SubmitSpec(entrypoint_args=tuple(entrypoint_args), address=address.rstrip("/"), working_dir=working_dir,
                      runtime_env=dict(runtime_env or {}), follow=follow, timeout_s=timeout_s)
    deadline = None if spec.timeout_s is None else time.monotonic() + spec.timeout_s
    server = _JobServer(spec, resolve_token(token))
    entrypoint = build_entrypoint(spec.entrypoint_args, spec.runtime_env)
    env = _runtime_env(spec)
    upload_s = spec.upload_timeout_s if deadline is None else max(1.0, min(spec.upload_timeout_s, deadline - time.monotonic()))
    job_id = server.call("submitting the job", lambda: server.client.submit_job(entrypoint=entrypoint, runtime_env=env),
                         timeout_s=upload_s)
    _note(f"submitted job {job_id} to {spec.address}: {shlex.join(spec.entrypoint_args)}")
    if not spec.follow:
        _note(f"not following it; see `ray job logs --address {spec.address} {job_id}`")
        return 0
    return _follow(server, job_id, spec, deadline)
