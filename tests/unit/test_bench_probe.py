"""In-process measurements: bytes held by tensors (views and shards counted once) and peak RSS."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.probe import (
    HeldBytes,
    InStepProbe,
    StateBytes,
    count_bytes,
    memory_probe,
    module_state_bytes,
)
from zero_ray.errors import ConfigError


def test_views_into_one_buffer_are_counted_once() -> None:
    flat = torch.zeros(100)
    held = HeldBytes()
    assert held.add(flat[10:20]) == 40
    assert held.add(flat[15:30]) == 40  # 5 of its 15 elements were already counted
    assert held.add(flat) == 320
    assert held.add(flat[:5]) == 0
    assert held.add(torch.zeros(3)) == 12  # another storage


def test_nested_containers_and_none() -> None:
    a, b = torch.zeros(4), torch.zeros(2, dtype=torch.float64)
    assert count_bytes([a, None, {"x": [b, a]}], HeldBytes()) == 16 + 16


def test_module_with_tied_weights_and_adam_state() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    module = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.AdamW(module.parameters())
    module["head"](module["emb"](torch.tensor([1, 2]))).sum().backward()
    opt.step()
    tensors = [v for s in opt.state.values() for v in s.values()]
    got = module_state_bytes(module, tensors)
    # 40 parameters once, their gradient once, two moments and a float32 step counter.
    assert got == StateBytes(params=160, grads=160, optimizer=2 * 160 + 4)
    assert got.as_dict()["total"] == 160 + 160 + 324


def test_state_bytes_validation() -> None:
    with pytest.raises(ConfigError, match="grads=-1"):
        StateBytes(params=0, grads=-1, optimizer=0)


def test_memory_probe_reads_this_process() -> None:
    probe = memory_probe()
    assert probe.peak_rss_bytes > 1 << 20 and probe.lifetime_peak_rss_bytes > 1 << 20
    assert probe.source in ("VmHWM since reset", "VmHWM (no reset)", "ru_maxrss")


def test_in_step_probe_counts_the_largest_call_of_one_step() -> None:
    weight, bias = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([{"params": [weight]}, {"params": [bias]}])
    groups = opt.param_groups
    probe = InStepProbe()
    calls: list[int] = []

    def state() -> StateBytes:
        calls.append(1)
        moments = [v for s in opt.state.values() for v in s.values()]
        return module_state_bytes(torch.nn.ParameterList([weight, bias]), moments)

    probe.arm(state)
    for _ in range(3):
        # As DeepSpeed ZeRO-1/2 steps: one parameter group at a time, only its gradient present.
        for p, group in zip((weight, bias), groups):
            p.sum().backward()
            opt.param_groups = [group]
            opt.step()
            p.grad = None
        opt.param_groups = groups
        probe.step_done()
    # The first step creates the moments (its second call would see the weight's, not the
    # bias's: not counted); the second is counted at both calls and the larger kept (the
    # weight's gradient present); then the hook is gone, so the third costs nothing.
    assert len(calls) == 2
    assert probe.state == StateBytes(params=80, grads=64, optimizer=2 * 80 + 2 * 4)


def test_in_step_probe_once_stops_at_the_first_count() -> None:
    module = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(module.parameters())
    probe = InStepProbe()
    calls: list[int] = []

    def state() -> StateBytes:
        calls.append(1)
        return module_state_bytes(module, [v for s in opt.state.values() for v in s.values()])

    probe.arm(state, once=True)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        module(torch.ones(1, 4)).sum().backward()
        opt.step()
    assert calls == [1]  # the second step's
    assert probe.state == StateBytes(params=80, grads=80, optimizer=2 * 80 + 2 * 4)


def test_in_step_probe_skips_a_wrapper_without_state() -> None:
    # ZeroRedundancyOptimizer's own step() fires the hook with no state of its own, then its
    # wrapped optimizer's does with the moments.
    module = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(module.parameters())
    wrapper = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)  # stands in: no state
    probe = InStepProbe()
    probe.arm(lambda: module_state_bytes(module, [v for s in inner.state.values() for v in s.values()]))
    for _ in range(3):
        inner.zero_grad(set_to_none=True)
        module(torch.ones(1, 4)).sum().backward()
        wrapper.step()
        inner.step()
        probe.step_done()
    assert probe.state == StateBytes(params=80, grads=80, optimizer=2 * 80 + 2 * 4)
