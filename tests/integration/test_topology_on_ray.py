"""Shard groups with hpZ on Ray actors over gloo (one node, integer group sizes): parity with
the single process, replicas identical, memory per the formula with N = the group size plus the
secondary copy, bytes split inside / across nodes (through the owners' Stats replies), and a
resize that would break a group refused. The two-node case runs on a simulated cluster of network namespaces
(test_multinode.py)."""

from __future__ import annotations

import functools

import pytest
import torch

import zero_ray as zr
from zero_ray.core.memory_formulas import optimizer_bytes_per_param, topology_state_bytes
from zero_ray.models import GPT, GPTConfig, lm_loss
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

GPT_FN = functools.partial(GPT, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_shard_groups_with_hpz_match_single_process_on_ray() -> None:
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 64, (8, 17), generator=g) for _ in range(3)]
    opt = zr.AdamW(lr=1e-3, weight_decay=0.01)
    topology = zr.Topology(shard_group_size=2, secondary_group_size=2)
    cfg = zr.ZeroConfig(stage=3, world_size=4, bucket_bytes=4096, topology=topology,
                        stage3=zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)))
    with zr.ZeroTrainer(GPT_FN, lm_loss, optimizer=opt, config=cfg) as trainer:
        for b in batches:
            trainer.step(b)
        got = trainer.full_state_dict()
        memory, comm = trainer.memory_report(), trainer.comm_report()
        with pytest.raises(zr.ConfigError, match="resize to 3 owners would break the groups"):  # at once
            trainer.resize(3)
        assert trainer.world_size == 4
    ref, _ = single_process(GPT_FN, lm_loss, opt, batches)
    assert max(float((got[k] - ref[k]).abs().max()) for k in ref) <= 1e-5
    k = optimizer_bytes_per_param("adamw", mixed_precision=False)
    want = topology_state_bytes(stage=3, num_params=memory[0]["padded_numel"], world_size=4, shard_group_size=2,
                                secondary_group_size=2, param_bytes=4, grad_bytes=4, optimizer_bytes=k)
    for m in memory:
        assert m["params"] + m["padding_params"] == want.params and m["params_secondary"] == want.secondary
    for c in comm:  # one node: everything stayed inside it
        assert c["cross_node"] == 0 and c["inside_node"] == c["total"] > 0
        assert c["all_gather_backward_secondary"] > 0 and c["reduce_scatter_across"] > 0
