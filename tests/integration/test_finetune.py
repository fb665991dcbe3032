"""Fine-tuning on Ray actors over gloo, against single-process PyTorch: a frozen base with an
adapter, a never-used parameter and a branch only some ranks take (``FineTune``), and PEFT LoRA
on a Hugging Face Llama (``lora_llama``), at every stage and world sizes 1-3; PEFT LoRA over
tied-embedding models (GPT-2, a tied Llama) at stage 3; what the owners hold for frozen
parameters; a LoRA checkpoint resumed at another stage and size; the adapter's weights alone."""

from __future__ import annotations

import pytest
import torch

import zero_ray as zr
from finetune_models import (
    FineTune,
    causal_lm_loss,
    finetune_batches,
    finetune_loss,
    lora_gpt2,
    lora_llama,
    lora_tied_llama,
    token_batches,
)
from safetensors.torch import load_file

from zero_ray.checkpoint.tools import consolidate, reshard
from zero_ray.core.memory_formulas import model_state_bytes, optimizer_bytes_per_param
from zero_ray.testing import single_process

pytestmark = pytest.mark.usefixtures("ray_session")

# Every stage x world size runs in the thread tier (tests/unit/*_threads.py); here real actors over
# gloo on a subset that still has every stage and world size in it.
CASES = [(0, 2), (1, 3), (2, 1), (3, 2), (3, 3)]
LLAMA_UNITS = zr.Stage3Config(wrap_policy=("LlamaDecoderLayer",))  # each decoder layer a unit: base + LoRA


def max_dev(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def train(model_fn, loss_fn, optimizer, batches, **config):  # type: ignore[no-untyped-def]
    trainer = zr.ZeroTrainer(model_fn, loss_fn, optimizer=optimizer, config=zr.ZeroConfig(**config))
    try:
        metrics = [trainer.step(b) for b in batches]
        return trainer.full_state_dict(), metrics, trainer.memory_report()
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(("stage", "world_size"), CASES)
def test_frozen_unused_and_branching_parameters_match_single_process(stage: int, world_size: int) -> None:
    opt = zr.SGD(lr=0.1, momentum=0.9, weight_decay=0.1)
    batches = finetune_batches()
    ref, ref_losses = single_process(FineTune, finetune_loss, opt, batches, pieces=(world_size, 2))
    stage3 = zr.Stage3Config(wrap_policy=zr.WrapPolicy(min_numel=0)) if stage == 3 else zr.Stage3Config()
    got, metrics, _ = train(FineTune, finetune_loss, opt, batches, stage=stage, world_size=world_size,
                            grad_accum_steps=2, bucket_bytes=2048, stage3=stage3)
    dev = max_dev(got, ref)
    print(f"FineTune stage {stage} world {world_size} SGD max |zero - single| = {dev:.3g}")
    assert dev <= 1e-6
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-6)
    torch.manual_seed(0)
    start = dict(FineTune().named_parameters())
    assert torch.equal(got["unused"], start["unused"].detach())  # no decay, no momentum: torch skips it


@pytest.mark.parametrize(("stage", "world_size"), CASES)
def test_peft_lora_llama_matches_single_process(stage: int, world_size: int) -> None:
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches()
    ref, ref_losses = single_process(lora_llama, causal_lm_loss, opt, batches)
    stage3 = LLAMA_UNITS if stage == 3 else zr.Stage3Config()
    got, metrics, memory = train(lora_llama, causal_lm_loss, opt, batches, stage=stage, world_size=world_size,
                                 stage3=stage3)
    dev = max_dev(got, ref)
    print(f"LoRA Llama stage {stage} world {world_size} SGD max |zero - single| = {dev:.3g}")
    assert dev <= 1e-6
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-6)
    torch.manual_seed(0)
    start = dict(lora_llama().named_parameters())
    trained = [n for n, p in start.items() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert all(torch.equal(got[n], p.detach()) for n, p in start.items() if not p.requires_grad)
    assert memory[0]["trainable_numel"] == sum(start[n].numel() for n in trained)


TIED = {"gpt2": (lora_gpt2, "GPT2Block"), "tied-llama": (lora_tied_llama, "LlamaDecoderLayer")}
# "base_model": the unit the default policy picks for any PEFT model above 2**16 elements (the
# root's only child, PEFT's LoraModel, whose forward PEFT never calls); min_numel=0 picks it at
# these sizes. "blocks": each decoder block a unit, the tied embedding in the root's.
# (Stages 0-2, world size 1 and every other pairing run on thread ranks: test_finetune_threads.py.)
TIED_CASES = [("gpt2", "blocks", 3), ("tied-llama", "base_model", 2)]


@pytest.mark.parametrize(("model", "units", "world_size"), TIED_CASES)
def test_peft_lora_over_tied_embeddings_matches_single_process_at_stage_3(model: str, units: str,
                                                                           world_size: int) -> None:
    model_fn, block = TIED[model]
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches()
    ref, ref_losses = single_process(model_fn, causal_lm_loss, opt, batches)
    policy = zr.WrapPolicy(min_numel=0) if units == "base_model" else (block,)
    got, metrics, memory = train(model_fn, causal_lm_loss, opt, batches, stage=3, world_size=world_size,
                                 stage3=zr.Stage3Config(wrap_policy=policy))
    dev = max_dev(got, ref)
    print(f"LoRA {model} ({units} units) stage 3 world {world_size} SGD max |zero - single| = {dev:.3g}")
    assert dev <= 1e-6
    assert [m["loss"] for m in metrics] == pytest.approx(ref_losses, abs=1e-6)
    assert memory[0]["units"] == (1 if units == "base_model" else 3)  # blocks: two and the root
    torch.manual_seed(0)
    lora_model = model_fn()
    inner = lora_model.get_base_model()
    assert inner.get_input_embeddings().weight is inner.get_output_embeddings().weight
    start = dict(lora_model.named_parameters())
    assert all(torch.equal(got[n], p.detach()) == (not p.requires_grad) for n, p in start.items())


# Stage 3 (parameters partitioned too); AdamW at stages 1-2 against DDP is test_parity's.
@pytest.mark.parametrize("stage", [3])
def test_peft_lora_llama_with_adamw_is_as_close_as_ddp(stage: int) -> None:
    opt = zr.AdamW(lr=1e-2, weight_decay=0.1)
    batches = token_batches()
    ref, _ = single_process(lora_llama, causal_lm_loss, opt, batches)
    got, _, _ = train(lora_llama, causal_lm_loss, opt, batches, stage=stage, world_size=2,
                      stage3=LLAMA_UNITS if stage == 3 else zr.Stage3Config())
    # DDP as its 2 ranks' splits of every batch in one process (test_checkpoint's measure): two
    # actors importing transformers and peft fewer. DDP itself on actors is test_parity's.
    ddp, _ = single_process(lora_llama, causal_lm_loss, opt, batches, pieces=(2, 1))
    ddp_dev = max_dev(ddp, ref)
    zero_dev = max_dev(got, ref)
    print(f"LoRA Llama stage {stage} world 2 AdamW: zero_ray {zero_dev:.3g}, DDP {ddp_dev:.3g}")
    assert zero_dev <= max(2 * ddp_dev, 1e-6)


@pytest.mark.parametrize(("stage", "dtype"), [(0, "float32"), (1, "bfloat16"), (2, "float32"), (3, "bfloat16")])
def test_frozen_parameters_hold_parameter_bytes_only(stage: int, dtype: str) -> None:
    world_size = 2
    trainer = zr.ZeroTrainer(lora_llama, causal_lm_loss, optimizer=zr.AdamW(lr=1e-3),
                             config=zr.ZeroConfig(stage=stage, world_size=world_size, dtype=dtype,
                                                  stage3=LLAMA_UNITS if stage == 3 else zr.Stage3Config()))
    try:
        trainer.step(token_batches(1)[0])
        memory = trainer.memory_report()
        sizes = trainer.actors[0].__ray_call__.remote(_group_sizes)
        trainable_padded, frozen_padded = ray_get(sizes)
    finally:
        trainer.shutdown()
    mixed = dtype != "float32"
    element = 2 if mixed else 4
    k = optimizer_bytes_per_param("adamw", mixed_precision=mixed)
    expected = model_state_bytes(stage=stage, num_params=trainable_padded + frozen_padded, world_size=world_size,
                                 param_bytes=element, grad_bytes=element, optimizer_bytes=k,
                                 trainable_params=trainable_padded)
    for rank in memory:
        assert rank["params"] + rank["padding_params"] == expected.params
        assert rank["grads"] + rank["padding_grads"] == expected.grads  # the trainable groups' only
        assert rank["optimizer"] + rank["padding_optimizer"] == expected.optimizer
        assert rank["held_storage_bytes"] == rank["total"]
    torch.manual_seed(0)
    model = lora_llama()
    assert memory[0]["numel"] == sum(p.numel() for p in model.parameters())
    assert memory[0]["trainable_numel"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def _group_sizes(actor) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(trainable, frozen) padded elements of an owner's groups (runs inside the actor)."""
    groups = actor.engine.state.groups
    return (sum(g.bucket.padded_numel for g in groups if g.policy.trainable),
            sum(g.bucket.padded_numel for g in groups if not g.policy.trainable))


def ray_get(ref):  # type: ignore[no-untyped-def]
    import ray

    return ray.get(ref, timeout=60)


def test_a_lora_checkpoint_resumes_at_another_stage_and_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches(4)
    # The uninterrupted run is the saving one going on after its committed save: one pool fewer.
    first = zr.ZeroTrainer(lora_llama, causal_lm_loss, optimizer=opt, config=zr.ZeroConfig(stage=1, world_size=2))
    try:
        for b in batches[:2]:
            first.step(b)
        saved = first.save_checkpoint(str(tmp_path), wait=True)
        for b in batches[2:]:
            first.step(b)
        whole = first.full_state_dict()
    finally:
        first.shutdown()
    resumed = zr.ZeroTrainer.from_checkpoint(saved, lora_llama, causal_lm_loss,
                                             config=zr.ZeroConfig(stage=3, world_size=3, stage3=LLAMA_UNITS))
    try:
        assert resumed.step_count == 2
        for b in batches[2:]:
            resumed.step(b)
        got = resumed.full_state_dict()
        adapter = resumed.full_state_dict(trainable_only=True)
    finally:
        resumed.shutdown()
    assert max_dev(got, whole) <= 1e-6
    torch.manual_seed(0)
    model = lora_llama()
    assert set(adapter) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.equal(adapter[n], got[n]) for n in adapter)
    consolidated = tmp_path / "lora.safetensors"
    consolidate(saved, str(consolidated))  # frozen base and adapter together, as the module names them
    model.load_state_dict(load_file(str(consolidated)))
    # Offline resharding keeps the frozen parameters (master values, no moments) and the adapter's.
    resharded = reshard(saved, str(tmp_path / "resharded"), world_size=3)
    again = tmp_path / "again.safetensors"
    consolidate(resharded, str(again))
    assert load_file(str(again)).keys() == load_file(str(consolidated)).keys()
    assert all(torch.equal(v, load_file(str(consolidated))[k]) for k, v in load_file(str(again)).items())


def test_a_lora_run_resizes_live_and_continues_as_the_uninterrupted_one() -> None:
    opt = zr.SGD(lr=0.5, momentum=0.9)
    batches = token_batches(4)
    # The uninterrupted run is one process's (the pool of 2 matches it within 1e-6: the tests above),
    # not a second pool to start.
    whole, _ = single_process(lora_llama, causal_lm_loss, opt, batches)
    trainer = zr.ZeroTrainer(lora_llama, causal_lm_loss, optimizer=opt, config=zr.ZeroConfig(stage=2, world_size=2))
    try:
        for k, b in enumerate(batches):
            if k == 1:
                trainer.resize(3)
            if k == 3:
                trainer.resize(1)
            trainer.step(b)
        got = trainer.full_state_dict()
    finally:
        trainer.shutdown()
    assert max_dev(got, whole) <= 1e-6

