"""Corrupting a process's offloaded state the way a failing disk would: through the file, not
through the process's own tensors. The state files are unlinked, so they are reached by their
mappings in ``/proc/<pid>/map_files`` (root, as here and on CI); a write there lands in the page
cache the process reads its mapping from."""

from __future__ import annotations

import os


def state_mappings(pid: int, *, rank: int, directory: str) -> list[tuple[int, int]]:
    """The (start, end) addresses of ``pid``'s mappings of rank ``rank``'s state files under
    ``directory`` (as ``StateFiles`` names them)."""
    marker = f"{os.path.abspath(directory)}/zero_ray-rank{rank}-"
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and marker in fields[5] and fields[5].rstrip().endswith("(deleted)"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end))
    return found


def flip_byte(pid: int, start: int, end: int, *, offset: int = 0) -> None:
    """Invert one byte of the file mapped at ``start``-``end`` in ``pid``."""
    fd = os.open(f"/proc/{pid}/map_files/{start:x}-{end:x}", os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        assert os.pwrite(fd, bytes([old ^ 0xFF]), offset) == 1
    finally:
        os.close(fd)


def corrupt_state(pid: int, *, rank: int, directory: str) -> int:
    """Flip the first byte of every state file of rank ``rank`` under ``directory`` mapped in
    ``pid``; how many. Raises when there is none: a fault that did not fire must not pass for
    one that did."""
    mappings = state_mappings(pid, rank=rank, directory=directory)
    if not mappings:
        raise AssertionError(f"process {pid} maps no state file of rank {rank} under {directory}: nothing was "
                             "corrupted")
    for start, end in mappings:
        flip_byte(pid, start, end)
    return len(mappings)
