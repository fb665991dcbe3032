"""Host copies of an owner's tensors for peer snapshots and checkpoints.

From a GPU the copies go into pinned (page-locked) host buffers with non-blocking copies, all
queued before one wait: a pageable copy is staged through a driver buffer and blocks per
tensor. From a CPU they are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_copies(tensors: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A host copy of each tensor (converted to ``dtype`` when given), complete on return."""
    out: list[torch.Tensor] = []
    on_gpu = [t for t in tensors if t.device.type == "cuda"]
    for t in tensors:
        t = t.detach()
        want = dtype if dtype is not None else t.dtype
        if t.device.type != "cuda":
            out.append(t.to("cpu", want, copy=True))
            continue
        host = torch.empty(t.shape, dtype=want, pin_memory=True)
        host.copy_(t if t.dtype == want else t.to(want), non_blocking=True)
        out.append(host)
    for device in {t.device for t in on_gpu}:
        torch.cuda.current_stream(device).synchronize()  # every copy queued above is done
    return out
