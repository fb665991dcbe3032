"""Tensor parallelism as data: what a user asks for (``zr.TensorParallel``) and the plan it
resolves to on a model (which module is sharded how, and whether T divides what it must).

A plan maps module-name patterns to styles in torch's ``parallelize_module`` vocabulary:

- ``"colwise"``: a linear layer's output features are split over the T ranks (weight rows and
  bias); its input is whole on every rank and its input gradient is summed over them.
- ``"rowwise"``: a linear layer's input features are split (weight columns); each rank's
  partial output is summed over the ranks in forward, the bias added once after the sum.
- ``"replicated"``: the module stays whole on every rank (the same as naming it nowhere).

A pattern is a dotted module name in which ``*`` stands for one name component (``layers.*.mlp``
matches ``layers.0.mlp``), Hugging Face's ``base_model_tp_plan`` syntax. A model's own plan is
relative to its base model (``model.`` in ``LlamaForCausalLM``); a user's plan names modules
from the root the user's ``model_fn`` returns.

Pure: imports neither ray nor grpc nor torch (tests/unit/test_layering.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zero_ray.errors import ConfigError

COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated"
STYLES = (COLWISE, ROWWISE, REPLICATED)
LINEAR = "linear"  # the only module kind colwise / rowwise shard (ShardableModule.kind)

Plan = tuple[tuple[str, str], ...]


def _plan(value: object) -> Plan | None:
    """A plan given as a mapping or as (pattern, style) pairs, checked, as pairs."""
    if value is None:
        return None
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ConfigError(f"plan={value!r} must be a mapping of module-name patterns to styles, e.g. "
                          "{'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise'}, or None")
    out = []
    for pattern, style in pairs:
        if not isinstance(pattern, str) or not pattern or pattern.startswith(".") or pattern.endswith("."):
            raise ConfigError(f"plan pattern {pattern!r} must be a dotted module name, '*' standing for one "
                              "component (e.g. 'layers.*.self_attn.q_proj')")
        if style not in STYLES:
            raise ConfigError(f"plan[{pattern!r}]={style!r} is not a style zero_ray builds; use one of {STYLES} "
                              "(sequence parallelism is TensorParallel(sequence_parallel=True); embedding and loss sharding are not "
                          "built yet)")
        out.append((pattern, str(style)))
    if not out:
        raise ConfigError("plan={} shards nothing; pass None to use the model's own plan")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Megatron-style tensor parallelism inside groups of ``size`` owners (the paper's N_m).

    ``ZeroConfig(world_size=N, tensor_parallel=TensorParallel(size=T))`` forms N / T
    data-parallel ranks of T tensor-parallel owners each. T = 1 (default) is plain ZeRO.

    size: owners per tensor-parallel group (T); divides ``world_size``.
    plan: None for the model's own plan (a Hugging Face model's ``config.base_model_tp_plan``),
        or a mapping of module-name patterns to "colwise" / "rowwise" / "replicated" naming
        modules from the root of the model; docs/tensor_parallel.md.
    sequence_parallel: torch's ``SequenceParallel`` style over the blocks (Megatron's sequence
        parallelism): between the colwise/rowwise pairs, the norms and residuals hold 1/T of
        the sequence instead of all of it on every rank; a block's input is split at the first
        block, each colwise layers' parent gathers the sequence (colwise ``input_layouts=
        Shard(1)``), a rowwise layer reduce-scatters it (``output_layouts=Shard(1)``) and the
        output head gathers it again. A checkpointed block's input is then 1/T already (P_a
        keeps it as it is). Needs a model with input embeddings and an output head (a Hugging
        Face ``...ForCausalLM``) and a sequence length divisible by T.
    """

    size: int = 1
    plan: Mapping[str, str] | Plan | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"tensor_parallel size={self.size!r} must be an integer >= 1")
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(f"tensor_parallel sequence_parallel={self.sequence_parallel!r} must be True or False")
        object.__setattr__(self, "plan", _plan(self.plan))

    def check_world_size(self, world_size: int) -> None:
        """A ConfigError unless ``world_size`` owners form whole groups of ``size``."""
        if world_size % self.size:
            low = world_size - world_size % self.size
            raise ConfigError(f"world_size={world_size} is not divisible by tensor_parallel size={self.size}: the "
                              f"owners form world_size / size data-parallel ranks of {self.size} tensor-parallel "
                              f"owners each; use a world_size that is a multiple of {self.size} (e.g. "
                              f"{low or self.size} or {low + self.size}) or another size")


@dataclass(frozen=True, kw_only=True)
class ShardableModule:
    """One module of a model as the plan reads it. ``kind``: "linear" (in / out features and
    whether it has a bias) or the module's class name for anything else. ``head_dim``: where
    the module is a projection of an attention module, that module's head width (its head
    count is then its sharded dimension over ``head_dim``)."""

    name: str
    kind: str
    in_features: int = 0
    out_features: int = 0
    has_bias: bool = False
    head_dim: int | None = None


@dataclass(frozen=True, kw_only=True)
class ModuleShard:
    """How one module is split: ``style``, the weight dimension split (0 for colwise, 1 for
    rowwise) and its full size."""

    name: str
    style: str
    dim: int
    full: int


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """A plan resolved on a model at a size: the sharded modules, by name, in model order."""

    size: int
    shards: tuple[ModuleShard, ...]
    source: str  # "the model's base_model_tp_plan" or "the user's plan"

    def shard(self, name: str) -> ModuleShard | None:
        for s in self.shards:
            if s.name == name:
                return s
        return None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.shards)


def pattern_regex(pattern: str, prefix: str = "") -> re.Pattern[str]:
    """The regular expression of a plan pattern: ``*`` is one name component; ``prefix`` (a
    base model's attribute name) is put before it."""
    full = f"{prefix}.{pattern}" if prefix else pattern
    return re.compile("\\.".join("[^.]+" if part == "*" else re.escape(part) for part in full.split(".")) + "$")


def choose_plan(*, user: Plan | None, model: Mapping[str, str] | None, size: int,
                prefix: str = "") -> tuple[Plan, str, str]:
    """The plan a model is sharded by: ``(pairs, prefix they are relative to, source)``. The
    user's plan wins; else the model's own; a model with neither at ``size`` > 1 is refused
    naming ``plan=``."""
    if user is not None:
        return user, "", "the user's plan"
    if model:
        return _plan(dict(model)) or (), prefix, "the model's base_model_tp_plan"
    if size > 1:
        raise ConfigError(f"tensor_parallel size={size} was given, but the model has no tensor-parallel plan (no "
                          "config.base_model_tp_plan); pass TensorParallel(size=..., plan={pattern: style}) naming "
                          "which linear layers are 'colwise' and which 'rowwise', e.g. {'layers.*.mlp.up_proj': "
                          "'colwise', 'layers.*.mlp.down_proj': 'rowwise'}")
    return (), "", "no plan (size 1)"


def resolve_plan(modules: Sequence[ShardableModule], plan: Plan, *, size: int, prefix: str = "",
                 source: str = "the user's plan") -> TensorParallelPlan:
    """Resolve ``plan`` (relative to ``prefix``) on ``modules`` at ``size`` ranks, checking at
    construction what would otherwise fail mid-forward: every sharded module is a linear
    layer, T divides its sharded dimension and, for an attention projection, its head count;
    a module two patterns give different styles is refused, as is a pattern of a user's plan
    that names no module."""
    regexes = [(pattern, style, pattern_regex(pattern, prefix)) for pattern, style in plan]
    used: set[str] = set()
    shards = []
    for module in modules:
        hits = [(pattern, style) for pattern, style, rx in regexes if rx.match(module.name)]
        used.update(p for p, _ in hits)
        styles = {style for _, style in hits}
        if len(styles) > 1:
            raise ConfigError(f"module {module.name!r} is given different styles by {source}: {hits}; make the "
                              "patterns name it once")
        if not styles or styles == {REPLICATED}:
            continue
        style = styles.pop()
        shards.append(_shard(module, style, size, source))
    unused = [p for p, _ in plan if p not in used]
    if unused and source == "the user's plan":
        sample = ", ".join(repr(m.name) for m in [m for m in modules if m.kind == LINEAR][:6])
        raise ConfigError(f"plan patterns {unused} name no module of the model (its linear layers include "
                          f"{sample}); patterns name modules from the root, '*' for one component")
    return TensorParallelPlan(size=size, shards=tuple(shards), source=source)


def _shard(module: ShardableModule, style: str, size: int, source: str) -> ModuleShard:
    if module.kind != LINEAR:
        raise ConfigError(f"{source} makes {module.name!r} {style}, but it is a {module.kind}: zero_ray shards "
                          "linear layers only; mark it 'replicated' or leave it out of the plan")
    dim, full, what = (0, module.out_features, "output") if style == COLWISE else (1, module.in_features, "input")
    if module.head_dim:
        heads = full // module.head_dim
        if heads % size:
            raise ConfigError(f"{module.name!r} ({style}) carries {heads} attention heads ({_head_kind(module.name)}), "
                              f"which tensor_parallel size={size} does not divide: each rank must hold whole heads; "
                              f"use a size that divides {heads}")
    if full % size:
        raise ConfigError(f"{module.name!r} ({style}) has {full} {what} features, which tensor_parallel size={size} "
                          f"does not divide; use a size that divides {full}, or mark it 'replicated'")
    return ModuleShard(name=module.name, style=style, dim=dim, full=full)


def _head_kind(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    if last.startswith(("k_", "v_", "key", "value")):
        return "key/value heads: num_key_value_heads"
    if last.startswith(("q_", "query")):
        return "query heads: num_attention_heads"
    return "heads"
