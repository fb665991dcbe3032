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


def reference_block_indices(block_sizes: list[int], *, global_batch_size: int, steps: int, seed: int,
                            window: int) -> list[list[int]]:
    """Step k's global batch in the block order docs/data.md documents, followed literally: the
    epoch's blocks permuted (seed + epoch), cut into windows of ``window``, each window's
    samples shuffled by the seed BLAKE2b-64("seed:epoch:window") gives, the windows' samples
    concatenated; consecutive slices of the epoch's whole sequence."""
    import hashlib

    offsets = [sum(block_sizes[:b]) for b in range(len(block_sizes) + 1)]
    per_epoch = offsets[-1] // global_batch_size
    out, epochs = [], {}
    for k in range(steps):
        epoch, offset = divmod(k, per_epoch)
        if epoch not in epochs:
            perm = torch.randperm(len(block_sizes), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
            sequence: list[int] = []
            for w in range(0, len(perm), window):
                samples = [i for b in perm[w:w + window] for i in range(offsets[b], offsets[b + 1])]
                digest = hashlib.blake2b(f"{seed}:{epoch}:{w // window}".encode(), digest_size=8).digest()
                g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
                sequence += [samples[j] for j in torch.randperm(len(samples), generator=g).tolist()]
            epochs[epoch] = sequence
        out.append(epochs[epoch][offset * global_batch_size:(offset + 1) * global_batch_size])
    return out


def token_windows(tokens, seq_len: int, indices: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The nanoGPT reading of a token stream: sample i is tokens [i * seq_len, i * seq_len + seq_len + 1)."""
    return torch.stack([torch.as_tensor(tokens[i * seq_len:i * seq_len + seq_len + 1].astype("int64"))
                        for i in indices])
