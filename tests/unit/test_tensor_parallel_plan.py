"""zr.TensorParallel and the plan it resolves to (issue 45): the config's checks, Hugging Face
plans resolved on transformers models built from small configs (Llama with grouped-query
attention, Qwen2), a user's plan on a plain module, and the errors a plan refuses at
construction (a head count or a dimension T does not divide, no plan at T > 1). Pure plans and
modules built on the meta device: milliseconds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_ray as zr
from zero_ray.config_record import config_record, restore_config
from zero_ray.core.tensor_parallel_plan import ShardableModule, TensorParallel, choose_plan, resolve_plan
from zero_ray.errors import ConfigError
from zero_ray.owner.construction.tensor_sharding import model_plan, plan_model


def tiny_llama(*, heads: int = 8, kv_heads: int = 4, hidden: int = 32, inter: int = 64, layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def tiny_qwen2(*, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


class Block(nn.Module):
    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class PlainNet(nn.Module):
    """A plain module with no plan of its own."""

    def __init__(self, width: int = 16, inner: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width, inner) for _ in range(2)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


PLAIN_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


# -- the config --------------------------------------------------------------------------------

def test_the_default_is_size_one_and_changes_nothing() -> None:
    assert zr.ZeroConfig().tensor_parallel == TensorParallel(size=1, plan=None)
    assert zr.TensorParallel is TensorParallel


def test_a_plan_is_kept_as_pattern_style_pairs_and_survives_the_config_record() -> None:
    tp = TensorParallel(size=2, plan=PLAIN_PLAN)
    assert tp.plan == (("blocks.*.up", "colwise"), ("blocks.*.down", "rowwise"))
    cfg = zr.ZeroConfig(world_size=4, tensor_parallel=tp)
    assert restore_config(config_record(cfg)).config.tensor_parallel == tp


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"size": 0}, ["size=0", ">= 1"]),
    ({"size": True}, ["size=True"]),
    ({"size": 2, "plan": {"a.b": "sequence_parallel"}}, ["'sequence_parallel'", "colwise"]),
    ({"size": 2, "plan": {"a.*.": "colwise"}}, ["'a.*.'", "dotted"]),
    ({"size": 2, "plan": {}}, ["plan={}", "None"]),
    ({"size": 2, "plan": ["a"]}, ["mapping"]),
])
def test_bad_settings_are_refused_by_name(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        TensorParallel(**kwargs)  # type: ignore[arg-type]
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_world_size_that_is_not_a_multiple_of_the_size_is_refused_naming_both_and_the_fix() -> None:
    with pytest.raises(ConfigError) as err:
        zr.ZeroConfig(world_size=6, tensor_parallel=TensorParallel(size=4))
    text = str(err.value)
    assert "world_size=6" in text and "size=4" in text and "4 or 8" in text
    assert zr.ZeroConfig(world_size=8, tensor_parallel=TensorParallel(size=4)).tensor_parallel.size == 4


def test_the_driver_hands_the_owners_tp_and_refuses_what_is_not_built_on_ray() -> None:
    from zero_ray.driver.run_specs import engine_spec, pool_spec

    tp = TensorParallel(size=2, plan=PLAIN_PLAN)
    cfg = zr.ZeroConfig(world_size=4, tensor_parallel=tp)
    spec = engine_spec(cfg, model_fn=PlainNet, loss_fn=None, optimizers=(), lr_scheduler=None, device="cpu")  # type: ignore[arg-type]
    assert spec.tensor_parallel == tp
    assert pool_spec(cfg, device="cpu", backend="gloo", optimizer=zr.SGD(lr=0.1), lr_scheduler=None).tensor_parallel == 2
    with pytest.raises(ConfigError, match="STRICT_SPREAD") as err:
        pool_spec(zr.ZeroConfig(world_size=4, tensor_parallel=tp, placement_strategy="STRICT_SPREAD"), device="cpu",
                  backend="gloo", optimizer=zr.SGD(lr=0.1), lr_scheduler=None)
    assert "tensor_parallel size=2" in str(err.value)
    # peer redundancy is built with T > 1: snapshots as asked, kept within each TP shard
    peer = zr.ZeroConfig(world_size=4, tensor_parallel=tp, elastic=zr.ElasticConfig(redundancy="peer", snapshot_every=2))
    assert pool_spec(peer, device="cpu", backend="gloo", optimizer=zr.SGD(lr=0.1), lr_scheduler=None).snapshot_every == 2


# -- a Hugging Face model's own plan -----------------------------------------------------------

def test_llama_uses_its_own_plan_under_its_base_model() -> None:
    model = tiny_llama()
    plan, prefix = model_plan(model)
    assert prefix == "model" and plan is not None and plan["layers.*.self_attn.o_proj"] == "rowwise"
    resolved = plan_model(model, TensorParallel(size=4))
    assert resolved.source == "the model's base_model_tp_plan"
    styles = {name: resolved.shard(name).style for name in resolved.names}  # type: ignore[union-attr]
    assert len(styles) == 14  # 7 linear layers in each of 2 blocks; embeddings, norms, lm_head whole
    assert styles["model.layers.1.self_attn.k_proj"] == "colwise"
    assert styles["model.layers.0.mlp.down_proj"] == "rowwise"
    o_proj = resolved.shard("model.layers.0.self_attn.o_proj")
    assert o_proj is not None and (o_proj.dim, o_proj.full) == (1, 32)
    assert resolved.shard("lm_head") is None and resolved.shard("model.embed_tokens") is None


def test_the_plan_resolves_on_a_base_model_without_a_prefix() -> None:
    resolved = plan_model(tiny_llama().model, TensorParallel(size=2))
    assert "layers.0.self_attn.q_proj" in resolved.names


def test_qwen2_ships_a_plan_and_its_biased_projections_are_sharded() -> None:
    model = tiny_qwen2()
    resolved = plan_model(model, TensorParallel(size=2))
    assert resolved.shard("model.layers.0.self_attn.v_proj").style == "colwise"  # type: ignore[union-attr]
    assert model.model.layers[0].self_attn.v_proj.bias is not None


@pytest.mark.parametrize(("kv_heads", "size", "module", "count"), [
    (4, 8, "model.layers.0.self_attn.k_proj", 4),  # 8 query heads divide, 4 key/value heads do not
    (2, 4, "model.layers.0.self_attn.k_proj", 2),
])
def test_a_key_value_head_count_the_size_does_not_divide_is_refused_naming_module_count_and_size(
        kv_heads: int, size: int, module: str, count: int) -> None:
    with pytest.raises(ConfigError) as err:
        plan_model(tiny_llama(kv_heads=kv_heads), TensorParallel(size=size))
    text = str(err.value)
    assert f"'{module}'" in text and f"{count} attention heads" in text and f"size={size}" in text
    assert "num_key_value_heads" in text


def test_a_query_head_count_the_size_does_not_divide_is_refused() -> None:
    # 6 query heads of width 8 over 4 ranks: 48 features divide by 4, but heads would split
    with pytest.raises(ConfigError) as err:
        plan_model(tiny_llama(heads=6, kv_heads=6, hidden=48, inter=64), TensorParallel(size=4))
    text = str(err.value)
    assert "'model.layers.0.self_attn.q_proj'" in text and "6 attention heads" in text and "size=4" in text
    assert "num_attention_heads" in text


def test_a_sharded_dimension_the_size_does_not_divide_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        plan_model(tiny_llama(heads=4, kv_heads=4, inter=66), TensorParallel(size=4))
    text = str(err.value)
    assert "'model.layers.0.mlp.gate_proj'" in text and "66 output features" in text and "size=4" in text


# -- a user's plan -----------------------------------------------------------------------------

def test_a_plain_module_with_a_user_plan() -> None:
    resolved = plan_model(PlainNet(), TensorParallel(size=4, plan=PLAIN_PLAN))
    assert resolved.names == ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down")
    assert [(s.style, s.dim, s.full) for s in resolved.shards[:2]] == [("colwise", 0, 32), ("rowwise", 1, 32)]


def test_a_plain_module_without_a_plan_is_refused_at_size_two_naming_plan() -> None:
    with pytest.raises(ConfigError, match=r"plan=\{pattern: style\}"):
        plan_model(PlainNet(), TensorParallel(size=2))
    assert plan_model(PlainNet(), TensorParallel(size=1)).shards == ()


def test_a_user_plan_overrides_the_model_plan_and_names_modules_from_the_root() -> None:
    resolved = plan_model(tiny_llama(), TensorParallel(size=2, plan={"model.layers.*.mlp.up_proj": "colwise",
                                                                     "model.layers.*.mlp.down_proj": "rowwise"}))
    assert len(resolved.shards) == 4 and resolved.source == "the user's plan"


@pytest.mark.parametrize(("plan", "words"), [
    ({"blocks.*.upp": "colwise"}, ["'blocks.*.upp'", "name no module", "'blocks.0.up'"]),
    ({"blocks.*.norm": "colwise"}, ["'blocks.0.norm'", "LayerNorm", "linear layers only"]),
    ({"blocks.*.up": "colwise", "blocks.0.up": "rowwise"}, ["'blocks.0.up'", "different styles"]),
])
def test_user_plan_mistakes_are_refused_by_name(plan: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        plan_model(PlainNet(), TensorParallel(size=2, plan=plan))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_replicated_leaves_a_module_whole() -> None:
    resolved = plan_model(PlainNet(), TensorParallel(size=2, plan={**PLAIN_PLAN, "out": "replicated"}))
    assert "out" not in resolved.names and len(resolved.shards) == 4


def test_the_pure_resolver_on_records() -> None:
    modules = [ShardableModule(name="a.0.q", kind="linear", in_features=16, out_features=24, head_dim=8)]
    pairs, prefix, _ = choose_plan(user=None, model={"0.q": "colwise"}, size=3, prefix="a")
    assert resolve_plan(modules, pairs, size=3, prefix=prefix).shards[0].full == 24
    with pytest.raises(ConfigError, match="3 attention heads"):
        resolve_plan(modules, pairs, size=2, prefix=prefix)
