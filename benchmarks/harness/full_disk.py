"""A full disk under a save, as a user with a local checkpoint directory hits it: a small tmpfs
(mounted by the caller, before the simulated nodes start, so every node's mount namespace has
it) filled to all but a few KiB, then a save into it. ``visible`` is what a reader of the
checkpoint root sees, so a test or the soak can show that the refused save left nothing behind
(benchmarks/harness/soak_faults.py, tests/integration/test_full_disk_save.py)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from zero_ray.checkpoint.format import LATEST_NAME
from zero_ray.checkpoint.store import committed

FILLER = "filler.bin"


def mount_tmpfs(directory: str, *, size_bytes: int) -> None:
    """A tmpfs of ``size_bytes`` at ``directory`` (root only); ``unmount`` removes it."""
    os.makedirs(directory, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", directory], check=True,
                   capture_output=True, timeout=20)


def unmount(directory: str) -> None:
    subprocess.run(["umount", directory], check=False, capture_output=True, timeout=20)
    try:
        os.rmdir(directory)
    except OSError:
        pass


def fill(directory: str, *, leave_bytes: int) -> Path:
    """Take all of ``directory``'s filesystem but ``leave_bytes`` with one file; the file, whose
    removal frees the room again. Raises when the filesystem did not fill (a fault that did
    not fire must not pass for one that did)."""
    path = Path(directory) / FILLER
    st = os.statvfs(directory)
    room = st.f_bavail * st.f_frsize - leave_bytes
    with path.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(room, 1))
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize > 2 * leave_bytes:
        raise AssertionError(f"{directory} still has {st.f_bavail * st.f_frsize} bytes free after filling")
    return path


@dataclass(frozen=True, kw_only=True)
class Visible:
    """What a reader of a checkpoint root finds: the committed checkpoints, what ``latest``
    names, and any other entry (an unfinished save's directory left behind)."""

    committed: tuple[str, ...]
    latest: str | None
    others: tuple[str, ...]


def visible(root: str) -> Visible:
    if not os.path.isdir(root):
        return Visible(committed=(), latest=None, others=())
    names = tuple(committed(root))
    latest_path = os.path.join(root, LATEST_NAME)
    latest = Path(latest_path).read_text().strip() if os.path.exists(latest_path) else None
    others = tuple(sorted(n for n in os.listdir(root) if n not in names and n != LATEST_NAME))
    return Visible(committed=names, latest=latest, others=others)
