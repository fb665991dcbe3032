"""Sequence parallelism (``TensorParallel(sequence_parallel=True)``, owner/construction/
sequence_parallel.py) on thread ranks: the norms and residuals hold 1/T of the sequence, and the
model still computes single-process torch's loss and every parameter's gradient within 1e-5
(fp32): the GQA Llama (SDPA and eager) and Qwen2 under their own plans at T = 2 and 4."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from test_tensor_parallel_plan import PLAIN_PLAN, PlainNet
from test_tensor_parallel_threads import BATCH, CASES, SEQ, TOLERANCE, _max_dev, _reference
from thread_ranks import ThreadGroup, on_threads, run_tp_ranks
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.errors import ConfigError
from zero_ray.owner.construction.tensor_sharding import full_tensors, shard_model

HIDDEN = 32


def _sharded(name: str, size: int, state: dict[str, torch.Tensor], batch: Any = None) -> list[Any]:
    build, batch_fn, loss_fn, plan = CASES[name]
    models = [build() for _ in range(size)]  # built on the test thread (process-wide contexts)
    for m in models:
        m.load_state_dict(state)

    def rank_main(group: ThreadGroup) -> tuple[float, dict[str, torch.Tensor], dict[str, int], list[int]]:
        model = models[group.rank]
        shard_model(model, TensorParallel(size=size, plan=plan, sequence_parallel=True), group)
        norms: list[int] = []  # the sequence length each norm saw
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.register_forward_hook(lambda mod, args, out: norms.append(args[0].shape[1]))
        loss = loss_fn(model, batch if batch is not None else batch_fn())
        loss.backward()
        grads = full_tensors(model, {n: p.grad for n, p in model.named_parameters()})
        return loss.item(), grads, group.counters.snapshot(), norms

    return on_threads(size, rank_main)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["llama-gqa-sdpa", "llama-gqa-eager", "qwen2"])
def test_sequence_parallel_loss_and_gradients_equal_single_process_torch(name: str, size: int) -> None:
    state, want_loss, want_grads = _reference(CASES[name])
    for loss, grads, sent, norms in _sharded(name, size, state):
        assert abs(loss - want_loss) <= TOLERANCE
        assert _max_dev(grads, want_grads) <= TOLERANCE
        # every norm (2 per block and the final one) ran on 1/T of the sequence
        assert norms == [SEQ // size] * 5
        # per block: 2 gathers of a hidden state forward (attention, MLP) and 2 reduce-scatters
        # (o, down), the same again backward, each (T - 1) / T of one hidden state over the ring
        assert sent["sequence"] == 2 * (4 + 4) * (size - 1) * BATCH * SEQ * HIDDEN * 4 // size + \
            2 * (size - 1) * BATCH * SEQ * HIDDEN * 4 // size  # the first block's split and the head's gather, backward
        assert "all_reduce" in sent  # the norms' weights' gradients, summed over the group


def test_a_sequence_not_divisible_by_t_and_a_model_without_a_head_are_refused() -> None:
    state, _, _ = _reference(CASES["llama-gqa-sdpa"])
    odd = torch.randint(0, 96, (BATCH, SEQ - 1), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ConfigError, match=r"pad the sequences to a multiple of 2"):
        _sharded("llama-gqa-sdpa", 2, state, batch={"input_ids": odd, "labels": odd})

    def plain(group: ThreadGroup) -> None:
        shard_model(PlainNet(), TensorParallel(size=2, plan=PLAIN_PLAN, sequence_parallel=True), group)

    with pytest.raises(ConfigError, match="needs a model with input embeddings, an output head"):
        on_threads(2, plain)
    with pytest.raises(ConfigError, match="must be True or False"):
        TensorParallel(size=2, sequence_parallel=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("data_parallel", "checkpointed"), [(1, True), (2, True), (2, False)])
def test_zero_with_sequence_parallel_matches_single_process(data_parallel: int, checkpointed: bool,
                                                            stage: int) -> None:
    """The owners' engine at (T, D) = (2, D), stages 0-3, AdamW with clipping engaged, each block
    checkpointed or not: the run follows single-process torch within 1e-5, and a checkpointed
    block's kept input is the rank's half of the sequence, kept as it is (no P_a gather)."""
    from test_tensor_parallel_activations_threads import checkpointing
    from test_tensor_parallel_engine_threads import STEPS
    from tp_llama import BATCH as B, CLIP, OPTIMIZERS, SEQ as S, batches, llama, lm_loss, reference

    ref, ref_losses = reference("adamw", data_parallel, STEPS)
    options = {"checkpointing": checkpointing()} if checkpointed else {}
    got, losses, engines, _ = run_tp_ranks(2, data_parallel, llama, lm_loss, OPTIMIZERS["adamw"], batches(STEPS),
                                           stage=stage, clip=CLIP, sequence_parallel=True, **options)
    for name, value in got.items():
        assert float((value - ref[name]).abs().max()) <= TOLERANCE, name
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOLERANCE
    if checkpointed:
        for e in engines:
            saved = e.state.saved_inputs
            assert saved.gathered_bytes == 0  # no P_a: the input is the rank's chunk already
            # 2 blocks x this data rank's rows x half the sequence x hidden 32 x 4 bytes, per step
            assert saved.kept_bytes == STEPS * 2 * (B // data_parallel) * (S // 2) * HIDDEN * 4
