"""Shared fixtures. Ray is started once per test session and stopped at the end."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests_paths import REPO_ROOT, SHARED_DIR  # noqa: F401  (shared by test modules)

if TYPE_CHECKING:
    from s3_server import S3Server


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """One local S3-compatible server (moto) for the session, reached through the standard AWS_*
    environment variables, which are exported here: before Ray starts (``ray_session`` asks for
    this fixture), so that the owners' processes inherit them as a user's cluster would."""
    from s3_server import S3Server

    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture(scope="session")
def ray_session(s3: S3Server) -> Iterator[None]:
    """One local Ray for the whole test session, with more logical CPUs than cores so that
    four single-CPU partition owners fit on a two-core machine. Started after the S3 server,
    whose environment its workers inherit."""
    import ray
    from ray import cloudpickle

    # Functions and classes defined in test modules travel to the actors by value: the actors'
    # interpreters cannot import test modules by name.
    tests_dir = os.path.join(REPO_ROOT, "tests")
    for module in list(sys.modules.values()):
        if (getattr(module, "__file__", None) or "").startswith(tests_dir):
            cloudpickle.register_pickle_by_value(module)
    if not ray.is_initialized():
        # address="local": a new Ray of our own even when a `ray start` cluster runs on this machine.
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are collected everywhere and skipped where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none is visible here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
