"""The sample order ``fit`` documents, built independently of zero_ray's code: the references
that fit's tests train one process on."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def reference_batches(dataset: TensorDataset, *, global_batch_size: int, steps: int,
                      seed: int) -> list[list[torch.Tensor]]:
    """Step k's global batch: epoch e = k // (len // global_batch_size) reads a permutation
    seeded ``seed + e``, in consecutive slices of ``global_batch_size``."""
    batches = []
    per_epoch = len(dataset) // global_batch_size
    for k in range(steps):
        epoch, offset = divmod(k, per_epoch)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
        idx = order[offset * global_batch_size:(offset + 1) * global_batch_size]
        batches.append([t[idx] for t in dataset.tensors])
    return batches
