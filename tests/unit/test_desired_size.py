"""A detached run's desired size kept for the driver that attaches after a loss
(zero_ray/driver/desired_size.py): per run, the last one recorded wins, dropped at shutdown, and
none for a run never resized (an attaching driver then takes the config's world_size). Ray's
key-value store is replaced by a dict (the module reaches it only through compat/ray_private)."""

from __future__ import annotations

import pytest

from zero_ray.driver import desired_size


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, bytes], bytes]:
    kv: dict[tuple[str, bytes], bytes] = {}
    rp = desired_size.ray_private

    def put(key: bytes, value: bytes, *, overwrite: bool, namespace: str) -> bool:
        existed = (namespace, key) in kv
        if overwrite or not existed:
            kv[(namespace, key)] = value
        return existed

    monkeypatch.setattr(rp, "kv_put", put)
    monkeypatch.setattr(rp, "kv_get", lambda key, *, namespace: kv.get((namespace, key)))
    monkeypatch.setattr(rp, "kv_delete", lambda key, *, namespace, by_prefix=False: int(
        kv.pop((namespace, key), None) is not None))
    return kv


def test_the_last_resize_survives_for_the_next_driver(store: dict[tuple[str, bytes], bytes]) -> None:
    assert desired_size.recorded("run-a") is None
    desired_size.record("run-a", 3)
    desired_size.record("run-a", 2)  # a second resize replaces the first
    desired_size.record("run-b", 5)  # another run's is its own
    assert desired_size.recorded("run-a") == 2 and desired_size.recorded("run-b") == 5
    desired_size.forget("run-a")
    assert desired_size.recorded("run-a") is None and desired_size.recorded("run-b") == 5


def test_a_run_never_resized_has_none_recorded(store: dict[tuple[str, bytes], bytes]) -> None:
    # An attaching driver takes the configured world_size then (ZeroTrainer.__init__).
    desired_size.record("run-b", 5)
    assert desired_size.recorded("run-c") is None
