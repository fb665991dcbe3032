"""The GPU path: CUDA owners, NCCL through ray.util.collective, stream overlap and the memory
report, on the device. Marked ``gpu``; skipped where torch sees no CUDA device (the conftest),
and the multi-GPU tests where there are fewer GPUs than they need.

Run them, and the throughput check, with ``python -m benchmarks.gpu_check``."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import zero_ray as zr
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
MODEL = functools.partial(GPT, CFG)


def _batches(steps: int = 3, n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, CFG.vocab_size, (n, CFG.block_size + 1), generator=g) for _ in range(steps)]


def _cuda_reference(optimizer: Any, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-process CUDA training with torch.optim, from the same host-built initial weights."""
    params, _ = single_process(lambda: MODEL().cuda(), lambda m, b: lm_loss(m, b.cuda()), optimizer, batches)
    return {k: v.cpu() for k, v in params.items()}


def _train(stage: int, world_size: int, optimizer: Any, batches: list[torch.Tensor], **config: Any) -> zr.ZeroTrainer:
    trainer = zr.ZeroTrainer(MODEL, lm_loss, optimizer=optimizer,
                             config=zr.ZeroConfig(stage=stage, world_size=world_size, device="cuda", **config))
    for batch in batches:
        trainer.step(batch)
    return trainer


def _max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_on_one_gpu_matches_single_process_cuda(ray_session: None, stage: int) -> None:
    opt = zr.AdamW(lr=1e-3, weight_decay=0.1)
    batches = _batches()
    ref = _cuda_reference(opt, batches)
    trainer = _train(stage, 1, opt, batches)
    try:
        assert trainer.device == "cuda"
        assert _max_dev(trainer.full_state_dict(), ref) <= 1e-5
    finally:
        trainer.shutdown()


@pytest.mark.skipif(GPUS < 2, reason="NCCL parity needs 2 or more GPUs")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nccl_at_every_world_size_the_machine_has_matches_single_process(ray_session: None, stage: int) -> None:
    opt = zr.AdamW(lr=1e-3, weight_decay=0.1)
    batches = _batches(n=4 * GPUS)
    ref = _cuda_reference(opt, batches)
    for n in range(2, GPUS + 1):
        trainer = _train(stage, n, opt, batches, backend="nccl")
        try:
            assert _max_dev(trainer.full_state_dict(), ref) <= 1e-5, n
            sent = trainer.comm_report()[0]["total"]
            assert sent > 0
        finally:
            trainer.shutdown()


def test_the_memory_report_on_cuda_counts_the_formula_and_the_allocator(ray_session: None) -> None:
    trainer = _train(3, 1, zr.AdamW(lr=1e-3), _batches(steps=1), dtype="bfloat16")
    try:
        report = trainer.memory_report()[0]
        psi = sum(p.numel() for p in MODEL().parameters())
        # bf16 parameters and gradients, fp32 master and two moments: the paper's 16 bytes
        expected = zr.memory.model_state_bytes(stage=3, num_params=psi, world_size=1, param_bytes=2, grad_bytes=2,
                                               optimizer_bytes=12)
        assert report["params"] + report["grads"] + report["optimizer"] == expected.total
        assert report["cuda_peak_allocated"] >= report["total"]
        assert report["cuda_peak_reserved"] >= report["cuda_peak_allocated"]
        assert report["cuda_fragmentation"] == report["cuda_peak_reserved"] - report["cuda_peak_allocated"]
    finally:
        trainer.shutdown()


def _kernel_intervals(prof: Any) -> list[tuple[str, float, float]]:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def _overlaps(kernels: list[tuple[str, float, float]], comm: str) -> bool:
    ours = [k for k in kernels if comm in k[0].lower()]
    others = [k for k in kernels if comm not in k[0].lower()]
    return any(a[1] < b[2] and b[1] < a[2] for a in ours for b in others)


def test_communication_on_the_comm_thread_overlaps_compute_on_one_gpu() -> None:
    # The stream arrangement itself: a job on the CommStream's thread (the legacy default
    # stream, where Ray runs NCCL's copies) runs its kernel while the compute thread's kernels
    # run on the side stream CudaSync makes current. A spin kernel stands in for NCCL here.
    from zero_ray.collective.device_sync import CudaSync
    from zero_ray.collective.collective_api import ByteCounters
    from zero_ray.collective.stream import CommStream

    class _TwoRanks:  # a world size above 1, so that jobs run on the stream's thread
        rank, world_size, counters = 0, 2, ByteCounters()

    sync = CudaSync(torch.device("cuda", 0))
    stream = CommStream(_TwoRanks(), sync=sync, name="comm")  # type: ignore[arg-type]
    a = torch.randn(4096, 4096, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with sync.computing():
            done = stream.submit(lambda: torch.cuda._sleep(200_000_000))
            for _ in range(40):
                a = torch.tanh(a @ a)
            done.result(timeout=60)
        torch.cuda.synchronize()
    stream.close()
    assert _overlaps(_kernel_intervals(prof), "sleep")


@pytest.mark.skipif(GPUS < 2, reason="NCCL overlap needs 2 GPUs")
def test_nccl_collectives_overlap_compute(ray_session: None) -> None:
    import ray

    @ray.remote(num_gpus=1, num_cpus=1)
    class Rank:
        def run(self, rank: int) -> bool:
            from zero_ray.collective.device_sync import CudaSync
            from zero_ray.collective.ray_group import form_group
            from zero_ray.collective.stream import CommStream
            from zero_ray.owner.service.device import setup_device

            setup_device(device="cuda", backend="nccl", rank=rank)
            group = form_group(backend="nccl", group_name="overlap-test", rank=rank, world_size=2, timeout_s=120)
            sync = CudaSync(torch.device("cuda", 0))
            stream = CommStream(group, sync=sync)
            grads = torch.ones(256 * 2**20, device="cuda")
            a = torch.randn(4096, 4096, device="cuda")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                with sync.computing():
                    done = [stream.submit(functools.partial(stream.all_reduce, grads)) for _ in range(4)]
                    for _ in range(60):
                        a = torch.tanh(a @ a)
                    for d in done:
                        d.result(timeout=120)
                torch.cuda.synchronize()
            stream.close()
            assert float(grads[0]) == 2.0 ** 4
            return _overlaps(_kernel_intervals(prof), "nccl")

    ranks = [Rank.remote() for _ in range(2)]
    assert all(ray.get([r.run.remote(i) for i, r in enumerate(ranks)], timeout=300))


def test_host_copies_from_the_gpu_are_pinned_and_complete() -> None:
    from zero_ray.owner.tensors.host_copy import host_copies

    src = [torch.arange(1 << 20, device="cuda", dtype=torch.bfloat16), torch.ones(3, device="cuda")]
    out = host_copies(src, dtype=torch.float32)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in out)
    assert torch.equal(out[0], src[0].float().cpu()) and out[1].sum() == 3


def test_activation_checkpointing_with_offload_on_cuda_trains_identically(ray_session: None) -> None:
    opt = zr.AdamW(lr=1e-3)
    batches = _batches()
    plain = _train(3, 1, opt, batches)
    from zero_ray.models import Block

    ckpt = _train(3, 1, opt, batches,
                  activation_checkpointing=zr.ActivationCheckpointing(offload=True, wrap_policy=(Block,)))
    try:
        assert _max_dev(plain.full_state_dict(), ckpt.full_state_dict()) == 0.0
    finally:
        plain.shutdown()
        ckpt.shutdown()


@pytest.mark.skipif(GPUS < 2, reason="tensor parallelism of 2 needs 2 GPUs: NCCL takes one rank per device")
@pytest.mark.parametrize("stage", [2, 3])
def test_tensor_parallel_2_over_nccl_matches_single_process_cuda(ray_session: None, stage: int) -> None:
    """Issue 45's device check: a GQA Llama under its own plan, split over 2 GPUs (T = 2, D = 1),
    the TP layers' all-reduces and ZeRO's rounds on NCCL, against one process on one GPU."""
    from tp_llama import CLIP, OPTIMIZERS, batches, llama, lm_loss

    steps = batches(3)
    params, _ = single_process(lambda: llama().cuda(), lambda m, b: lm_loss(m, b.cuda()), OPTIMIZERS["adamw"], steps,
                               max_grad_norm=CLIP)
    ref = {k: v.cpu() for k, v in params.items()}
    trainer = zr.ZeroTrainer(llama, lm_loss, optimizer=OPTIMIZERS["adamw"],
                             config=zr.ZeroConfig(stage=stage, world_size=2, device="cuda", backend="nccl",
                                                  max_grad_norm=CLIP, tensor_parallel=zr.TensorParallel(size=2)))
    try:
        for batch in steps:
            trainer.step(batch)
        assert _max_dev(trainer.full_state_dict(), ref) <= 1e-5
        assert all(c["tensor_parallel"] > 0 for c in trainer.comm_report())
    finally:
        trainer.shutdown()
