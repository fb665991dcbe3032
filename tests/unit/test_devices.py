"""Device start-up checks, the driver's device choice, allocator figures, host copies and the
pre-allocated buffer pools: everything of the GPU path that runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from zero_ray.core.devices import DeviceFacts, allocator_figures, check_owner_device, choose_device
from zero_ray.errors import ConfigError
from zero_ray.owner.tensors.buffers import BufferPool
from zero_ray.owner.service.device import probe, setup_device
from zero_ray.owner.tensors.host_copy import host_copies

ONE_GPU = DeviceFacts(cuda_available=True, visible_gpus=1, visible_env="3")


def test_a_cuda_owner_with_its_one_gpu_and_cupy_passes() -> None:
    check_owner_device(ONE_GPU, device="cuda", backend="nccl", rank=0)
    check_owner_device(ONE_GPU, device="cuda", backend="gloo", rank=0)
    check_owner_device(DeviceFacts(cuda_available=False, visible_gpus=0), device="cpu", backend="gloo", rank=0)


@pytest.mark.parametrize(("facts", "device", "backend", "message"), [
    (DeviceFacts(cuda_available=False, visible_gpus=0, visible_env=""), "cuda", "gloo",
     r"rank 2: device='cuda' but torch sees no GPU \(CUDA_VISIBLE_DEVICES=''\); give each owner a GPU"),
    (DeviceFacts(cuda_available=True, visible_gpus=2, visible_env="0,1"), "cuda", "nccl",
     r"rank 2: the owner sees 2 GPUs \(CUDA_VISIBLE_DEVICES='0,1'\); each owner must own exactly one"),
    (DeviceFacts(cuda_available=True, visible_gpus=1, cupy_error="ModuleNotFoundError: No module named 'cupy'"),
     "cuda", "nccl", r"rank 2: backend='nccl' needs cupy .*No module named 'cupy'.*pip install -e '\.\[gpu\]' \(from the checkout\)"),
    (ONE_GPU, "cpu", "nccl", r"backend='nccl' needs device='cuda' \(got device='cpu'\); use backend='gloo'"),
])
def test_what_an_owner_cannot_run_is_refused_with_the_fix(facts: DeviceFacts, device: str, backend: str,
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_owner_device(facts, device=device, backend=backend, rank=2)


def test_setup_on_this_machine_checks_what_it_probes() -> None:
    assert setup_device(device="cpu", backend="gloo", rank=0) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no GPU"):
            setup_device(device="cuda", backend="gloo", rank=0)
    facts = probe(need_nccl=True)
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert facts.cupy_error is not None and "cupy" in facts.cupy_error
    assert probe(need_nccl=False).cupy_error is None  # cupy is not imported unless NCCL is wanted


def test_auto_picks_cuda_only_with_a_gpu_per_owner_and_warns_when_it_picks_the_cpu() -> None:
    def pick(device: str, backend: str, gpus: float, world: int) -> tuple[str, str, bool]:
        c = choose_device(device=device, backend=backend, cluster_gpus=gpus, world_size=world)
        return c.device, c.backend, c.warn

    assert pick("auto", "auto", 4, 4) == ("cuda", "nccl", False)
    assert pick("auto", "auto", 8, 4) == ("cuda", "nccl", False)
    assert pick("auto", "auto", 3, 4) == ("cpu", "gloo", True)
    assert pick("auto", "auto", 0, 1) == ("cpu", "gloo", True)
    # One machine without a GPU (a laptop) is no cluster whose GPU nodes are still to come: no warning.
    laptop = choose_device(device="auto", backend="auto", cluster_gpus=0, world_size=2, one_machine=True)
    assert (laptop.device, laptop.warn) == ("cpu", False) and "chose the CPU" in laptop.reason
    assert choose_device(device="auto", backend="auto", cluster_gpus=1, world_size=2, one_machine=True).warn
    assert pick("cpu", "auto", 4, 4) == ("cpu", "gloo", False)
    # The CPU fallback says why and what to do on a cluster whose GPU nodes are autoscaled.
    cpu = choose_device(device="auto", backend="auto", cluster_gpus=1, world_size=2)
    assert "has 1 GPU now for 2 owners" in cpu.reason and "use device='cuda'" in cpu.reason
    assert "capacity_timeout_s" in cpu.reason


def test_explicit_cuda_with_too_few_gpus_now_is_kept_for_start_up_to_wait_for() -> None:
    """No error here: the owners' requests for GPUs are what an autoscaler starts nodes for, and
    start-up waits for them within capacity_timeout_s (test_capacity.py)."""
    choice = choose_device(device="cuda", backend="auto", cluster_gpus=0, world_size=4)
    assert (choice.device, choice.backend, choice.warn) == ("cuda", "nccl", False)
    assert choose_device(device="cuda", backend="gloo", cluster_gpus=2, world_size=2).backend == "gloo"


def test_allocator_figures_and_fragmentation() -> None:
    stats = {"allocated_bytes.all.current": 100, "reserved_bytes.all.current": 300,
             "allocated_bytes.all.peak": 900, "reserved_bytes.all.peak": 1200, "num_ooms": 0}
    figures = allocator_figures(stats)
    assert figures.report() == {"cuda_allocated": 100, "cuda_reserved": 300, "cuda_peak_allocated": 900,
                                "cuda_peak_reserved": 1200, "cuda_fragmentation": 300}
    with pytest.raises(ConfigError, match="allocator statistics lack 'reserved_bytes.all.peak'"):
        allocator_figures({k: v for k, v in stats.items() if k != "reserved_bytes.all.peak"})


def test_host_copies_are_independent_and_converted() -> None:
    src = [torch.arange(6, dtype=torch.bfloat16), torch.ones(2, 3)]
    out = host_copies(src, dtype=torch.float32)
    assert [t.dtype for t in out] == [torch.float32, torch.float32]
    assert out[0].tolist() == list(range(6)) and out[1].shape == (2, 3)
    src[1].zero_()
    assert out[1].sum() == 6  # a copy, not a view
    assert host_copies([src[0]])[0].dtype == torch.bfloat16


def test_a_preallocated_pool_is_one_block_and_finds_the_buffer_a_view_belongs_to() -> None:
    pool = BufferPool(name="gather", count=3, numel=8, dtype=torch.float32, device=torch.device("cpu"),
                      preallocate=True)
    assert pool.block is not None and pool.block.numel() == 24
    assert {b.tensor.untyped_storage().data_ptr() for b in pool.buffers} == {pool.block.untyped_storage().data_ptr()}
    assert [b.tensor.storage_offset() for b in pool.buffers] == [0, 8, 16]
    assert pool.buffer_of(pool.buffers[1].tensor[3:5].view(2, 1)) is pool.buffers[1]
    assert pool.buffer_of(pool.buffers[2].tensor[7:]) is pool.buffers[2]
    assert pool.buffer_of(torch.zeros(8)) is None
    lazy = BufferPool(name="staging", count=2, numel=8, dtype=torch.float32, device=torch.device("cpu"),
                      preallocate=False)
    assert lazy.block is None and lazy.buffers == []
