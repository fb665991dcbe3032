"""The names a run keeps in Ray's GCS that both sides use: the namespace of its owners' actor
names and of its key-value records, and the key of a detached run's desired size. The driver
records that size (driver/desired_size.py) and drops it at shutdown; a detached run's owners drop
it when they end without a driver (``orphan_timeout_s``), which no driver's shutdown follows."""

NAMESPACE = "zero_ray"  # owners are named actors here, so that a new driver can find a detached run


def desired_size_key(run_id: str) -> bytes:
    """The key of run ``run_id``'s desired world size (its control-plane job id)."""
    return f"zero_ray-{run_id}/desired_world_size".encode()
