"""Stage-3 units: which parameters are gathered together, planned from module structure alone.

A unit is a module whose parameters are all-gathered into one flat buffer before its forward
(and again before its backward) and freed after. The root module is always a unit: it holds
every parameter no wrapped module claims. A parameter registered in several modules (tied
embeddings: ``head.weight = wte.weight``) belongs to the deepest unit enclosing all of its
registrations, so it is gathered wherever it is used.

Pure: imports neither ray nor grpc nor torch; the owner describes its module as ``ModuleInfo``
records and the plan comes back as parameter indices (``FlatLayout.build`` lays them out).

A unit is *entered* (gathered for forward) by the outermost of its entry modules that runs: its
own module, or any module below it that registers one of its parameters or holds such a module.
Usually that is the unit's module; but a wrapper's ``forward`` may be bypassed (PEFT's
``PeftModel.forward`` calls ``base_model.model`` directly, never ``LoraModel.forward``), and
then the first module under it that runs still gathers the unit before its parameters are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zero_ray.errors import ConfigError

# Modules that only hold children (their own forward, if any, just chains them): the default
# policy looks through them, so the blocks of a ``ModuleList`` are "direct children" too.
CONTAINERS = frozenset({"torch.nn.modules.container.ModuleList", "torch.nn.modules.container.ModuleDict",
                        "torch.nn.modules.container.Sequential"})

DEFAULT_MIN_UNIT_NUMEL = 2**16


@dataclass(frozen=True, kw_only=True)
class ModuleInfo:
    """One module as the planner sees it.

    path: its name in ``named_modules()`` ("" for the root).
    classes: qualified names of its class and bases, most derived first
        (``"zero_ray.models.Block"``, ..., ``"torch.nn.modules.module.Module"``).
    params: indices (into the distinct ``named_parameters()`` order) registered directly on it.
    numel: elements of the distinct parameters in its whole subtree.
    """

    path: str
    classes: tuple[str, ...]
    params: tuple[int, ...]
    numel: int

    @property
    def class_name(self) -> str:
        return self.classes[0].rsplit(".", 1)[-1] if self.classes else ""

    @property
    def depth(self) -> int:
        return 0 if not self.path else self.path.count(".") + 1

    @property
    def parent(self) -> str | None:
        if not self.path:
            return None
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""

    @property
    def is_container(self) -> bool:
        return bool(self.classes) and self.classes[0] in CONTAINERS


WrapFn = Callable[[ModuleInfo], bool]


@dataclass(frozen=True, kw_only=True)
class WrapPolicy:
    """Which modules become units.

    classes: module classes by name, bare (``"Block"``) or qualified (``"zero_ray.models.Block"``);
        a module is a unit when its class or one of its bases matches.
    fn: a predicate over ``ModuleInfo`` (e.g. ``lambda m: m.class_name == "Block"``).
    Neither given (the default): every direct child of the root holding at least ``min_numel``
    elements, looking through containers (``ModuleList``/``ModuleDict``/``Sequential``), so a
    transformer's blocks and a ``Sequential`` MLP's layers are one unit each.
    """

    classes: tuple[str, ...] = ()
    fn: WrapFn | None = None
    min_numel: int = DEFAULT_MIN_UNIT_NUMEL

    def __post_init__(self) -> None:
        if not all(isinstance(c, str) and c for c in self.classes):
            raise ConfigError(f"WrapPolicy classes={self.classes!r} must be non-empty class names")
        if self.fn is not None and not callable(self.fn):
            raise ConfigError(f"WrapPolicy fn={self.fn!r} must be callable: ModuleInfo -> bool")
        if self.classes and self.fn is not None:
            raise ConfigError("give WrapPolicy either classes or fn, not both")
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or self.min_numel < 0:
            raise ConfigError(f"WrapPolicy min_numel={self.min_numel!r} must be an integer >= 0")

    def wraps(self, info: ModuleInfo, *, transparent_path: bool) -> bool:
        """Whether ``info`` (never the root) is a unit. ``transparent_path``: every module
        between it and the root is a container (what "direct child" means by default)."""
        if self.fn is not None:
            return bool(self.fn(info))
        if self.classes:
            names = set(info.classes) | {c.rsplit(".", 1)[-1] for c in info.classes}
            return any(c in names for c in self.classes)
        return transparent_path and not info.is_container and info.numel >= self.min_numel and info.numel > 0


@dataclass(frozen=True, kw_only=True)
class UnitSpec:
    """One unit: its module, the parameters gathered with it, and the unit that encloses it."""

    index: int
    path: str
    params: tuple[int, ...]
    numel: int
    parent: int | None  # enclosing unit (None for the outermost one)
    depth: int  # units enclosing this one, itself excluded
    # Modules whose forward enters the unit (module paths, its own first, then in module order):
    # those below it that lead to its parameters; () for its own module alone. The root's is
    # itself alone: the loss function calls it, so everything under it runs inside its forward.
    entries: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class UnitPlan:
    """The units (those holding parameters, in module order) and the persistent parameters
    (below the persistence threshold: replicated on every rank, never gathered)."""

    units: tuple[UnitSpec, ...]
    persistent: tuple[int, ...]
    num_params: int

    @property
    def nesting(self) -> int:
        """The most units that can be live at once through nesting alone."""
        return 1 + max((u.depth for u in self.units), default=-1)

    def groups(self) -> list[list[int]]:
        """Parameter groups for ``FlatLayout.build``: one per unit, then the persistent ones."""
        groups = [list(u.params) for u in self.units]
        if self.persistent:
            groups.append(list(self.persistent))
        return groups

    @property
    def persistent_bucket(self) -> int | None:
        """The layout bucket of the persistent parameters, if there are any."""
        return len(self.units) if self.persistent else None


def _common_prefix(paths: Sequence[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def _entries(path: str, params: Sequence[int], sites: Sequence[Sequence[str]],
             order: dict[str, int]) -> tuple[str, ...]:
    """The unit at ``path``'s entry modules: itself, and every module from a registration of one
    of its parameters up to it (each registration lies under it: the unit encloses them all)."""
    if path == "":
        return ("",)
    found = {path}
    for i in params:
        for site in sites[i]:
            while site not in found:
                found.add(site)
                site = site.rsplit(".", 1)[0] if "." in site else ""
    rest = sorted(found - {path}, key=lambda p: (order.get(p, len(order)), p))
    return (path, *rest)


def plan_units(modules: Sequence[ModuleInfo], param_numels: Sequence[int], *, policy: WrapPolicy,
               persistence_threshold: int = 0, sites: Sequence[Sequence[str]] | None = None) -> UnitPlan:
    """Group parameters into units.

    modules: every module in ``named_modules()`` order, the root first.
    param_numels: elements of each distinct parameter, by index.
    sites: for each parameter, the module paths that register it (every alias, so a tied or
        shared parameter lists several); by default the modules whose ``params`` name it.
    persistence_threshold: parameters with fewer elements stay replicated (persistent).
    """
    if not modules or modules[0].path != "":
        raise ConfigError("plan_units needs the module list to start with the root (path '')")
    if isinstance(persistence_threshold, bool) or not isinstance(persistence_threshold, int) \
            or persistence_threshold < 0:
        raise ConfigError(f"{persistence_threshold=} must be an integer >= 0 (elements)")
    by_path = {m.path: m for m in modules}
    if sites is None:
        found: list[list[str]] = [[] for _ in param_numels]
        for m in modules:
            for i in m.params:
                found[i].append(m.path)
        sites = found
    if len(sites) != len(param_numels) or any(not s for s in sites):
        missing = [i for i, s in enumerate(sites) if not s]
        raise ConfigError(f"parameters {missing} are registered on no module")

    # Which modules are units: the root always; others by the policy.
    wrapped: set[str] = {""}
    transparent: dict[str, bool] = {"": True}
    for m in modules[1:]:
        parent = by_path.get(m.parent or "")
        through = transparent.get(m.parent or "", False) and (parent is None or parent.path == "" or parent.is_container)
        transparent[m.path] = through
        if policy.wraps(m, transparent_path=through):
            wrapped.add(m.path)

    def enclosing_unit(path: str) -> str:
        """The deepest wrapped module that is ``path`` or one of its ancestors."""
        while path not in wrapped:
            path = path.rsplit(".", 1)[0] if "." in path else ""
        return path

    members: dict[str, list[int]] = {}
    persistent: list[int] = []
    for i, (numel, where) in enumerate(zip(param_numels, sites)):
        if numel < persistence_threshold:
            persistent.append(i)
            continue
        members.setdefault(enclosing_unit(_common_prefix(list(where))), []).append(i)

    # Keep units that hold parameters, in module order; link each to its enclosing kept unit.
    kept = [m.path for m in modules if m.path in members]
    order = {m.path: k for k, m in enumerate(modules)}
    index = {path: k for k, path in enumerate(kept)}
    units: list[UnitSpec] = []
    for k, path in enumerate(kept):
        parent: int | None = None
        up = path
        while up:
            up = up.rsplit(".", 1)[0] if "." in up else ""
            if up in index:
                parent = index[up]
                break
        depth = 0 if parent is None else units[parent].depth + 1
        params = tuple(sorted(members[path]))
        units.append(UnitSpec(index=k, path=path, params=params, numel=sum(param_numels[i] for i in params),
                              parent=parent, depth=depth, entries=_entries(path, params, sites, order)))
    return UnitPlan(units=tuple(units), persistent=tuple(persistent), num_params=len(param_numels))


def outermost_units(plan: UnitPlan) -> list[str]:
    """The paths of the outermost non-root units: what activation checkpointing wraps and
    compilation compiles (either applied to one covers any unit inside it)."""
    by_index = {u.index: u for u in plan.units}
    out = []
    for u in plan.units:
        if u.path == "":
            continue
        parent = by_index.get(u.parent) if u.parent is not None else None
        if parent is None or parent.path == "":
            out.append(u.path)
    return out


def innermost_units(plan: UnitPlan) -> list[str]:
    """The paths of the non-root units with no unit inside them: the regions stage 3 compiles.
    Their own gather and free hooks run outside the compiled forward; the entries below them
    are unhooked (UnitScheduler.compiled), so no hook is traced into it and identical blocks
    share one compiled graph at stage 3 as at stages 0-2."""
    enclosing = {u.parent for u in plan.units}
    return [u.path for u in plan.units if u.path and u.index not in enclosing]


def repeated_blocks(infos: Sequence[ModuleInfo]) -> tuple[str, ...]:
    """The classes (qualified) of the modules a model repeats: held in a container at least
    twice, with parameters (a transformer's blocks in their ``ModuleList``). What compilation
    compiles at stages 0-2 by default: one compiled graph serves every block."""
    containers = {m.path for m in infos if m.is_container}
    counts: dict[str, int] = {}
    for m in infos:
        if m.numel > 0 and m.parent in containers and m.classes:
            counts[m.classes[0]] = counts.get(m.classes[0], 0) + 1
    return tuple(sorted(c for c, n in counts.items() if n >= 2))
