"""Sharded checkpoints: format (manifest + per-rank safetensors), storage (a local filesystem, or
any pyarrow.fs filesystem: S3, GCS, fsspec; ``location`` resolves paths, URLs and filesystem
objects), atomic commit, ranged verified reads, and the offline tools (inspect, reshard,
consolidate, export).

Knows neither the driver nor the owners; both use it.
"""

from zero_ray.checkpoint.format import FORMAT_VERSION, Manifest
from zero_ray.checkpoint.store import CheckpointReader, resolve
from zero_ray.checkpoint.tools import consolidate, inspect_checkpoint, reshard

__all__ = ["FORMAT_VERSION", "CheckpointReader", "Manifest", "consolidate", "inspect_checkpoint", "reshard", "resolve"]
