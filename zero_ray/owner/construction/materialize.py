"""Low-memory construction: run ``model_fn()`` with every parameter on the meta device, record
how each one is initialised, and materialise the parameters one at a time afterwards.

While ``model_fn()`` runs, a global parameter-registration hook swaps each newly registered
parameter for a meta tensor of the same shape (its real tensor is dropped at once, or kept as
the parameter's *base* value until something overwrites it), and a dispatch mode records every
in-place operation on a parameter (or a view of one). Random operations (``uniform_``,
``normal_``, ...) are also executed on a scratch tensor of the parameter's size, so the random
stream advances exactly as in an ordinary construction (buffers and later parameters draw the
same numbers), and the generator state before each is saved. A parameter's recipe is the ops
since its last full overwrite; materialising it replays them with their saved generator states,
which gives bit-for-bit the tensor ``torch.manual_seed(seed); model_fn()`` would have built.

Reproduced exactly: initialisation by in-place ops whose other arguments are numbers or real
tensors (every ``torch.nn.init`` function except ``orthogonal_``/``sparse_``, module
``reset_parameters``, re-initialisation after construction as in ``post_init``/``apply(init)``,
``nn.Parameter(torch.randn(...))``, partial writes such as ``padding_idx``). Refused with a
``ModelError``: a random op on a temporary derived from a parameter (``orthogonal_``), an in-place
op whose operand is another parameter, and buffers computed from parameter values. Memory while
recording: at most one parameter's scratch tensor, plus the base values not yet overwritten
and the real operands of recorded ``copy_``-style ops (both held until materialisation).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.module as torch_module

from zero_ray.compat.torch_private import OpOverload, TorchDispatchMode, storage_key, tree_flatten, tree_unflatten
from zero_ray.errors import ModelError

aten = torch.ops.aten

# In-place ops that write every element of their target without reading it: a segment starts.
_OVERWRITES = frozenset({aten.uniform_, aten.normal_, aten.zero_, aten.fill_, aten.random_, aten.bernoulli_,
                         aten.exponential_, aten.log_normal_, aten.cauchy_, aten.geometric_, aten.copy_})


# torch.nn.init functions: recorded as one call each (replayed whole with the saved generator
# state), because several of them return early on meta tensors (trunc_normal_, orthogonal_,
# dirac_, sparse_) and so never reach the dispatcher.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


class _Target:
    """Placeholder for the recorded op's target tensor in its saved arguments."""


_TARGET = _Target()

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, storage offset


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


@dataclass(kw_only=True)
class RecordedOp:
    """One in-place op on (a view of) a parameter."""

    func: Any  # an aten OpOverload, or a torch.nn.init function
    flat_args: list[Any]  # args and kwargs flattened; the target is _TARGET
    spec: Any  # their pytree spec
    target: Geometry
    generator: torch.Generator | None
    rng_state: torch.Tensor | None  # the generator state just before the op (random ops only)

    def run(self, storage: torch.Tensor) -> None:
        view = storage.as_strided(*self.target)
        args, kwargs = tree_unflatten([view if a is _TARGET else a for a in self.flat_args], self.spec)
        if self.rng_state is None:
            self.func(*args, **kwargs)
            return
        gen = self.generator if self.generator is not None else torch.default_generator
        saved = gen.get_state()
        gen.set_state(self.rng_state)
        try:
            self.func(*args, **kwargs)
        finally:
            gen.set_state(saved)


@dataclass(kw_only=True)
class ParamRecipe:
    """How to rebuild one parameter: its geometry, an optional base value and the ops since the
    last full overwrite."""

    geometry: Geometry
    storage_numel: int
    dtype: torch.dtype
    base: torch.Tensor | None
    ops: list[RecordedOp] = field(default_factory=list)

    def materialize(self) -> torch.Tensor:
        """The parameter's value (a new CPU tensor); the base is released."""
        storage = torch.empty(self.storage_numel, dtype=self.dtype)
        param = storage.as_strided(*self.geometry)
        if self.base is not None:
            param.copy_(self.base)
            self.base = None
        for op in self.ops:
            op.run(storage)
        self.ops = []
        return param


@dataclass(kw_only=True)
class _Tracked:
    recipe: ParamRecipe
    meta: torch.nn.Parameter
    name_hint: str


class InitRecorder(TorchDispatchMode):
    """Records parameter initialisation during ``model_fn()``; see the module docstring.

    ``record=False`` only builds the structure (meta parameters, nothing recorded, no random
    numbers drawn for them): for loading values from a state dict afterwards.
    """

    def __init__(self, *, record: bool = True) -> None:
        super().__init__()
        self._record = record
        self._tracked: dict[int, _Tracked] = {}  # meta storage -> its parameter's recipe
        self._replaced: dict[int, tuple[weakref.ref[torch.Tensor], torch.nn.Parameter]] = {}
        self._handle: Any = None
        self._originals: dict[str, Callable[..., Any]] = {}

    # -- parameter registration ---------------------------------------------------------------------
    def _on_register(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> Any:
        if param is None or param.is_meta:
            return None
        known = self._replaced.get(id(param))
        if known is not None and known[0]() is param:
            return known[1]  # the same real parameter registered a second time: share its replacement
        meta = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        base = param.detach() if self._record else None
        recipe = ParamRecipe(geometry=_geometry(meta), storage_numel=meta.untyped_storage().nbytes() // meta.element_size(),
                             dtype=param.dtype, base=base)
        self._tracked[storage_key(meta)] = _Tracked(recipe=recipe, meta=meta, name_hint=f"{type(module).__name__}.{name}")
        self._replaced[id(param)] = (weakref.ref(param), meta)
        return meta

    def __enter__(self) -> InitRecorder:
        self._handle = torch_module.register_module_parameter_registration_hook(self._on_register)
        for name in _INIT_FUNCTIONS:
            original = getattr(torch.nn.init, name)
            self._originals[name] = original
            setattr(torch.nn.init, name, self._wrap_init(original))
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.nn.init, name, original)
            self._originals.clear()
            self._handle.remove()
            self._replaced.clear()

    def _wrap_init(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta and storage_key(tensor) in self._tracked):
                return fn(tensor, *args, **kwargs)
            if self._record:
                self._record_op(fn, tensor, (tensor, *args), kwargs, seeded=True)
            return tensor

        return init

    # -- ops ----------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        tracked = [t for t in tensors if t.is_meta and storage_key(t) in self._tracked]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if not tracked:
            if seeded and any(t.is_meta for t in tensors):
                raise ModelError(f"low_memory construction cannot reproduce {func} on a temporary derived from a "
                                 "parameter (e.g. torch.randn_like(weight)); use init='full' or init_state_dict")
            return func(*args, **kwargs)
        writes = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if not writes:
            if seeded:
                raise ModelError(f"low_memory construction cannot reproduce {func} on a temporary derived from a "
                                 "parameter (e.g. torch.randn_like(weight)); use init='full' or init_state_dict")
            return func(*args, **kwargs)  # a view or a read of a parameter: nothing to record
        if not self._record:
            return func(*args, **kwargs)  # structure only: the values will come from elsewhere
        target = args[writes[0]] if writes[0] < len(args) else None
        if not isinstance(target, torch.Tensor) or not target.is_meta or storage_key(target) not in self._tracked:
            raise ModelError(f"low_memory construction cannot record {func}: it writes a tensor computed from a parameter")
        self._record_op(func, target, args, kwargs, seeded=seeded)
        return target

    def _record_op(self, func: Any, target: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                   seeded: bool) -> None:
        """Append one op on ``target`` to its parameter's recipe (drawing its random numbers now)."""
        entry = self._tracked[storage_key(target)]
        flat, spec = tree_flatten((args, kwargs))
        saved: list[Any] = []
        for a in flat:
            if a is target:
                saved.append(_TARGET)
            elif isinstance(a, torch.Tensor) and a.is_meta:
                raise ModelError(f"low_memory construction cannot record {getattr(func, '__name__', func)} on "
                                 f"{entry.name_hint}: its operand is another parameter or a value computed from one; "
                                 "use init='full' or init_state_dict")
            elif isinstance(a, torch.Tensor):
                saved.append(a.detach().clone())  # a real operand (copy_ from a table): kept until replay
            else:
                saved.append(a)
        gen = kwargs.get("generator")
        op = RecordedOp(func=func, flat_args=saved, spec=spec, target=_geometry(target), generator=gen,
                        rng_state=None)
        if seeded:
            op.rng_state = (gen if gen is not None else torch.default_generator).get_state()
            # Draw the numbers now, into scratch memory, so the stream advances as it would.
            scratch = torch.empty(entry.recipe.storage_numel, dtype=entry.recipe.dtype)
            view = scratch.as_strided(*op.target)
            s_args, s_kwargs = tree_unflatten([view if a is _TARGET else a for a in saved], spec)
            func(*s_args, **s_kwargs)
            del scratch, view
        recipe = entry.recipe
        # Every torch.nn.init function writes all of its target without reading it.
        overwrites = not isinstance(func, OpOverload) or func.overloadpacket in _OVERWRITES
        if overwrites and op.target == recipe.geometry:
            recipe.base = None
            recipe.ops = [op]
        else:
            recipe.ops.append(op)

    # -- results ------------------------------------------------------------------------------------
    def recipe_for(self, param: torch.Tensor) -> ParamRecipe:
        entry = self._tracked.get(storage_key(param)) if param.is_meta else None
        if entry is None:
            raise ModelError("a parameter was created on the meta device by model_fn itself; low_memory "
                             "construction needs parameters created on the host (it moves them to meta)")
        return entry.recipe


def build_recorded(model_fn: Callable[[], torch.nn.Module], *, seed: int,
                   record: bool = True) -> tuple[torch.nn.Module, InitRecorder]:
    """``torch.manual_seed(seed); model_fn()`` with meta parameters and recorded initialisation.
    The random stream is left where an ordinary construction would leave it."""
    recorder = InitRecorder(record=record)
    torch.manual_seed(seed)
    with recorder:
        module = model_fn()
    if isinstance(module, torch.nn.Module):
        meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ModelError(f"buffers {meta_buffers} are computed from parameter values during model_fn(); "
                             "low_memory construction cannot build them: use init='full'")
    return module, recorder
