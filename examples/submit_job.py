"""A tiny zero_ray training job to check that job submission works end to end.

    ray job submit --working-dir . -- python examples/submit_job.py
    zero-ray submit --address http://HOST:8265 -- python examples/submit_job.py

Run as a Ray job, ``ray.init()`` connects to the cluster the job was submitted to (Ray sets
RAY_ADDRESS for the driver, and the driver inherits the cluster's token). Three ZeRO stage-2 steps
of a small regression on two partition owners; one line per step with the loss, then "done".
"""

from __future__ import annotations

import ray
import torch

import zero_ray as zr

STEPS = 3
FEATURES = 8
SAMPLES = 32


def model_fn() -> torch.nn.Module:
    """Runs on every partition owner (after torch.manual_seed), so all start identical."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of the module's prediction on this owner's piece of the batch."""
    inputs, targets = batch
    return torch.nn.functional.mse_loss(module(inputs), targets)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch (seeded), so every run prints the same losses."""
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return inputs, targets


def main() -> None:
    ray.init()  # inside a job: connects to the job's cluster instead of starting one
    trainer = zr.ZeroTrainer(model_fn, loss_fn, optimizer=zr.AdamW(lr=1e-2),
                             config=zr.ZeroConfig(stage=2, world_size=2))
    try:
        batch = make_batch()
        for step in range(1, STEPS + 1):
            metrics = trainer.step(batch)
            print(f"step {step}/{STEPS} loss={metrics['loss']:.6f}", flush=True)
    finally:
        trainer.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
