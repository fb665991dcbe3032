"""Unit planning (zero_ray.core.stage3_units): pure, from module descriptions, in milliseconds."""

from __future__ import annotations

import pytest

from zero_ray.config import Stage3Config, ZeroConfig
from zero_ray.core.flat_layout import FlatLayout
from zero_ray.core.stage3_units import ModuleInfo, WrapPolicy, innermost_units, outermost_units, plan_units, repeated_blocks
from zero_ray.errors import ConfigError

MOD = "torch.nn.modules.module.Module"
LIN = ("torch.nn.modules.linear.Linear", MOD)
LN = ("torch.nn.modules.normalization.LayerNorm", MOD)
EMB = ("torch.nn.modules.sparse.Embedding", MOD)
LIST = ("torch.nn.modules.container.ModuleList", MOD)
BLOCK = ("zero_ray.models.Block", MOD)


def gpt_like(n_layer: int = 2) -> tuple[list[ModuleInfo], list[int], list[list[str]]]:
    """wte(0) wpe(1) blocks.i.{ln(2+2i), fc(3+2i)} ln_f head(tied to wte)."""
    numels = [640, 160]
    mods = [ModuleInfo(path="wte", classes=EMB, params=(0,), numel=640),
            ModuleInfo(path="wpe", classes=EMB, params=(1,), numel=160),
            ModuleInfo(path="blocks", classes=LIST, params=(), numel=n_layer * 1010)]
    for i in range(n_layer):
        ln, fc = len(numels), len(numels) + 1
        numels += [10, 1000]
        mods += [ModuleInfo(path=f"blocks.{i}", classes=BLOCK, params=(), numel=1010),
                 ModuleInfo(path=f"blocks.{i}.ln", classes=LN, params=(ln,), numel=10),
                 ModuleInfo(path=f"blocks.{i}.fc", classes=LIN, params=(fc,), numel=1000)]
    numels.append(10)
    mods += [ModuleInfo(path="ln_f", classes=LN, params=(len(numels) - 1,), numel=10),
             ModuleInfo(path="head", classes=LIN, params=(0,), numel=640)]
    root = ModuleInfo(path="", classes=("zero_ray.models.GPT", MOD), params=(), numel=sum(numels))
    sites: list[list[str]] = [[] for _ in numels]
    for m in mods:
        for i in m.params:
            sites[i].append(m.path)
    return [root, *mods], numels, sites


def test_default_policy_makes_each_block_and_large_child_a_unit_and_ties_go_to_the_root() -> None:
    mods, numels, sites = gpt_like()
    plan = plan_units(mods, numels, policy=WrapPolicy(min_numel=100), sites=sites)
    assert [(u.path, u.params) for u in plan.units] == [("", (0, 6)), ("wpe", (1,)), ("blocks.0", (2, 3)),
                                                        ("blocks.1", (4, 5))]
    # wte and head share parameter 0: it is gathered with the root, wherever it is used
    assert plan.units[0].depth == 0 and all(u.parent == 0 and u.depth == 1 for u in plan.units[1:])
    assert plan.nesting == 2 and plan.persistent == ()


def test_class_and_callable_policies() -> None:
    mods, numels, sites = gpt_like()
    by_class = plan_units(mods, numels, policy=WrapPolicy(classes=("Block",)), sites=sites)
    assert [u.path for u in by_class.units] == ["", "blocks.0", "blocks.1"]
    qualified = plan_units(mods, numels, policy=WrapPolicy(classes=("zero_ray.models.Block", "Linear")), sites=sites)
    # nested units: a Linear inside a Block is its own unit, enclosed by the block's
    assert [u.path for u in qualified.units] == ["", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc"]
    assert qualified.units[2].parent == 1 and qualified.units[2].depth == 2 and qualified.nesting == 3
    fn = plan_units(mods, numels, policy=WrapPolicy(fn=lambda m: m.class_name == "LayerNorm"), sites=sites)
    assert [u.path for u in fn.units] == ["", "blocks.0.ln", "blocks.1.ln", "ln_f"]


def test_size_threshold_and_persistence() -> None:
    mods, numels, sites = gpt_like()
    plan = plan_units(mods, numels, policy=WrapPolicy(min_numel=10**6), sites=sites)
    assert [u.path for u in plan.units] == [""] and plan.units[0].numel == sum(numels)
    persistent = plan_units(mods, numels, policy=WrapPolicy(min_numel=100), persistence_threshold=11, sites=sites)
    assert persistent.persistent == (2, 4, 6)  # the three norms
    assert [u.params for u in persistent.units] == [(0,), (1,), (3,), (5,)]
    groups = persistent.groups()
    assert groups[-1] == [2, 4, 6] and persistent.persistent_bucket == 4
    layout = FlatLayout.build([(str(i), (n,), "float32") for i, n in enumerate(numels)], world_size=3, groups=groups)
    assert len(layout.buckets) == 5 and all(b.padded_numel % 3 == 0 for b in layout.buckets)


def test_a_module_shared_by_two_parents_puts_its_parameters_in_their_common_unit() -> None:
    mods = [ModuleInfo(path="", classes=(MOD,), params=(), numel=200),
            ModuleInfo(path="a", classes=BLOCK, params=(), numel=200),
            ModuleInfo(path="a.shared", classes=LIN, params=(0,), numel=100),
            ModuleInfo(path="b", classes=BLOCK, params=(), numel=200),
            ModuleInfo(path="b.own", classes=LIN, params=(1,), numel=100)]
    sites = [["a.shared", "b.shared"], ["b.own"]]
    plan = plan_units(mods, [100, 100], policy=WrapPolicy(classes=("Block",)), sites=sites)
    assert [(u.path, u.params) for u in plan.units] == [("", (0,)), ("b", (1,))]


def test_units_are_entered_by_every_module_leading_to_their_parameters() -> None:
    mods, numels, sites = gpt_like()
    by_class = plan_units(mods, numels, policy=WrapPolicy(classes=("Block",)), sites=sites)
    # the root is entered by its own forward only (the loss function calls it)
    assert [u.entries for u in by_class.units] == [("",), ("blocks.0", "blocks.0.ln", "blocks.0.fc"),
                                                   ("blocks.1", "blocks.1.ln", "blocks.1.fc")]
    nested = plan_units(mods, numels, policy=WrapPolicy(classes=("Block", "Linear")), sites=sites)
    # a nested unit's modules enter it, not the block's; the tied head enters the root only
    assert {u.path: u.entries for u in nested.units} == {
        "": ("",), "blocks.0": ("blocks.0", "blocks.0.ln"), "blocks.0.fc": ("blocks.0.fc",),
        "blocks.1": ("blocks.1", "blocks.1.ln"), "blocks.1.fc": ("blocks.1.fc",)}
    # PEFT's shape: root -> base_model (LoraModel, whose forward is bypassed) -> model -> ...
    peft = [ModuleInfo(path="", classes=(MOD,), params=(), numel=1100),
            ModuleInfo(path="base_model", classes=("peft.tuners.lora.model.LoraModel", MOD), params=(), numel=1100),
            ModuleInfo(path="base_model.model", classes=(MOD,), params=(), numel=1100),
            ModuleInfo(path="base_model.model.embed", classes=EMB, params=(0,), numel=1000),
            ModuleInfo(path="base_model.model.act", classes=(MOD,), params=(), numel=0),
            ModuleInfo(path="base_model.model.norm", classes=LN, params=(1,), numel=100),
            ModuleInfo(path="base_model.model.head", classes=LIN, params=(0,), numel=1000)]
    sites_peft = [["base_model.model.embed", "base_model.model.head"], ["base_model.model.norm"]]
    plan = plan_units(peft, [1000, 100], policy=WrapPolicy(min_numel=0), sites=sites_peft)
    assert [(u.path, u.params) for u in plan.units] == [("base_model", (0, 1))]
    assert plan.units[0].entries == ("base_model", "base_model.model", "base_model.model.embed",
                                     "base_model.model.norm", "base_model.model.head")


def test_bad_plans_and_configs_name_their_values() -> None:
    mods, numels, sites = gpt_like()
    with pytest.raises(ConfigError, match="start with the root"):
        plan_units(mods[1:], numels, policy=WrapPolicy())
    with pytest.raises(ConfigError, match="persistence_threshold=-1"):
        plan_units(mods, numels, policy=WrapPolicy(), persistence_threshold=-1)
    with pytest.raises(ConfigError, match="either classes or fn"):
        WrapPolicy(classes=("Block",), fn=lambda m: True)
    with pytest.raises(ConfigError, match="min_numel=-3"):
        WrapPolicy(min_numel=-3)
    with pytest.raises(ConfigError, match="prefetch_depth=-1"):
        Stage3Config(prefetch_depth=-1)
    with pytest.raises(ConfigError, match="max_live_units=0"):
        Stage3Config(max_live_units=0)
    with pytest.raises(ConfigError, match="init='lazy'"):
        Stage3Config(init="lazy")
    with pytest.raises(ConfigError, match="is not a file"):
        ZeroConfig(stage=3, init_state_dict="/nonexistent/model.safetensors")
    with pytest.raises(ConfigError, match="stage=2; they apply to stage 3 only"):
        ZeroConfig(stage=2, stage3=Stage3Config(prefetch_depth=2))


def test_wrap_policy_accepts_classes_names_and_callables() -> None:
    import torch

    assert Stage3Config(wrap_policy=(torch.nn.Linear, "Block")).wrap_policy.classes == (
        "torch.nn.modules.linear.Linear", "Block")
    fn = Stage3Config(wrap_policy=lambda m: m.depth == 1).wrap_policy
    assert fn.fn is not None and fn.fn(ModuleInfo(path="x", classes=LIN, params=(), numel=1))
    assert Stage3Config().wrap_policy == WrapPolicy()


def test_compiled_regions_are_the_repeated_blocks_and_at_stage_3_the_innermost_units() -> None:
    mods, numels, sites = gpt_like(n_layer=3)
    assert repeated_blocks(mods) == ("zero_ray.models.Block",)  # held thrice in a ModuleList
    assert repeated_blocks(gpt_like(n_layer=1)[0]) == ()  # one block repeats nothing
    nested = plan_units(mods, numels, policy=WrapPolicy(classes=("Block", "Linear")), sites=sites)
    # a Linear unit inside each block: compiling the block would trace the Linear's gather hooks
    assert outermost_units(nested) == ["blocks.0", "blocks.1", "blocks.2"]  # head's weight is wte's: the root's
    assert innermost_units(nested) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
