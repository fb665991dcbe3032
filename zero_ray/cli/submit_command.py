"""`zero-ray submit`: run a command on a Ray cluster as a Ray job and stream its output.

    zero-ray submit --address http://HOST:8265 [--working-dir .] [--no-follow] -- python train.py ...

The exit status is the job's (see zero_ray.submit.submit); usage and connection errors exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from zero_ray.errors import ZeroRayError
from zero_ray.submit import Token, read_token_file, submit

# The variable `ray job submit` reads the job server's address from, so one setting serves both.
ADDRESS_ENV = "RAY_API_SERVER_ADDRESS"
_USAGE_ERROR = 2


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg} at position {err.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {type(value).__name__}")
    return value


def register(subparsers: Any) -> None:
    """Add the `submit` subcommand to the `zero-ray` parser."""
    parser = subparsers.add_parser(
        "submit",
        help="run a command on a Ray cluster as a Ray job, streaming its output",
        description="Upload the working directory, run the command after `--` on the cluster as a Ray job, "
                    "stream its output and exit with its exit status. A bare `python` runs the cluster's Ray "
                    "interpreter. The cluster's token is read from $RAY_AUTH_TOKEN, the file "
                    "$RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token, unless --token-file is given.",
        epilog="example: zero-ray submit --address http://127.0.0.1:8265 -- python examples/submit_job.py",
    )
    parser.add_argument("--address", default=None, metavar="URL",
                        help=f"the job server (the head's dashboard), e.g. http://HOST:8265 (default: ${ADDRESS_ENV})")
    parser.add_argument("--working-dir", default=".", metavar="DIR",
                        help="directory uploaded as the job's cwd and PYTHONPATH (default: %(default)s)")
    parser.add_argument("--runtime-env-json", type=_json_object, default=None, metavar="JSON",
                        help='extra Ray runtime env, e.g. \'{"env_vars": {"OMP_NUM_THREADS": "1"}}\'')
    # A file, not the token itself: a command line is visible to every user of the machine.
    parser.add_argument("--token-file", type=Path, default=None, metavar="FILE",
                        help="file holding the cluster's token (default: Ray's usual places, see above)")
    parser.add_argument("--no-follow", dest="follow", action="store_false",
                        help="return once the job is accepted instead of streaming its output")
    parser.add_argument("--timeout", dest="timeout_s", type=_seconds, default=None, metavar="SECONDS",
                        help="stop the job and exit 124 if it has not finished after this long")
    parser.add_argument("entrypoint", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARG ...]",
                        help="the command to run on the cluster")
    parser.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"zero-ray submit: error: {message}", file=sys.stderr)
    return _USAGE_ERROR


def run(args: argparse.Namespace) -> int:
    """Carry out `zero-ray submit`; returns the exit status."""
    command = list(args.entrypoint)
    if command[:1] == ["--"]:  # argparse keeps the separator in a REMAINDER argument
        command = command[1:]
    if not command:
        return _fail("no command given; put it after `--`, e.g. -- python train.py")
    address = args.address or os.environ.get(ADDRESS_ENV)
    if not address:
        return _fail(f"no job server address: pass --address http://HOST:8265 or set ${ADDRESS_ENV}")
    try:
        token: Token | None = None
        if args.token_file is not None:
            token = read_token_file(args.token_file, source="--token-file")
        return submit(command, address=address, working_dir=args.working_dir, runtime_env=args.runtime_env_json,
                      token=token.value if token is not None else None, follow=args.follow, timeout_s=args.timeout_s)
    except ZeroRayError as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        # Interrupting the client does not stop a job the cluster has accepted: it runs on.
        print("zero-ray submit: interrupted; a job already submitted keeps running on the cluster "
              "(`ray job stop` ends it)", file=sys.stderr)
        return 130
