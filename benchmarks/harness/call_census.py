"""Which zero_ray source files a process runs, counted per call: a profile hook on every thread.

``install(directory)`` counts each call of a function defined under ``zero_ray/`` by its file,
in this process and every thread it starts afterwards, and a daemon thread writes the counts to
``directory/<pid>.json`` every 50 ms. In Ray workers it is installed by the job's runtime env:
``worker_process_setup_hook="benchmarks.harness.call_census.install_from_env"`` with
``ZR_CALL_CENSUS=<directory>`` (and the checkout on ``PYTHONPATH``). ``read(directory)`` returns
every process's counts.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
from types import FrameType
from typing import Any

ENV = "ZR_CALL_CENSUS"
_MARK = os.sep + "zero_ray" + os.sep
_counts: collections.Counter[str] = collections.Counter()
_stop = threading.Event()
_flusher: list[threading.Thread] = []


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call":
        name = frame.f_code.co_filename
        if _MARK in name:
            _counts[name] += 1


def _flush(path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dict(_counts), f)
    os.replace(tmp, path)


def install(directory: str) -> None:
    """Count this process's zero_ray calls into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{os.getpid()}.json")

    def flusher() -> None:
        while not _stop.wait(0.05):
            _flush(path)
        _flush(path)

    _stop.clear()
    _flusher[:] = [threading.Thread(target=flusher, name="call-census", daemon=True)]
    _flusher[0].start()
    threading.setprofile(_profile)
    sys.setprofile(_profile)


def uninstall() -> None:
    """Stop counting (threads already started keep their hook until they end), flushed once more."""
    threading.setprofile(None)
    sys.setprofile(None)
    _stop.set()
    for thread in _flusher:
        thread.join(timeout=10)


def install_from_env() -> None:
    """The Ray worker setup hook: install where ``ZR_CALL_CENSUS`` says, if it is set."""
    directory = os.environ.get(ENV)
    if directory:
        install(directory)


def read(directory: str) -> dict[int, collections.Counter[str]]:
    """Every process's counts so far, by process id."""
    out: dict[int, collections.Counter[str]] = {}
    for name in os.listdir(directory):
        if name.endswith(".json"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out[int(name.removesuffix(".json"))] = collections.Counter(json.load(f))
    return out
