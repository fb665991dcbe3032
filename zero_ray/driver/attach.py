"""Detached runs: owners that outlive their driver (``ElasticConfig(detached=True)``), found by
name in the ``zero_ray`` namespace and taken over by a new driver (``ZeroTrainer.attach``).

A new driver first reads, through Ray, what it needs before it can speak to the owners over
gRPC: each owner's control address (``node``), the run's credentials and its ``run_spec`` (the
ZeroConfig, TLS settings included, and the optimizer factories: Python objects). Everything
else (each owner's rank, generation, steps, phase and layout) it asks over gRPC (``Status``),
checks that they form one complete pool of one layout, and continues from their memory: no
storage is read.

Owners started ahead of a grow (named ``...-s<n>``, ``driver/replacements.py``) are members only
once a grow took them in; until then their Status says ``standby``. They are asked only when the
other owners do not form a complete pool by themselves; those that are standby, or do not answer
within the bound (still starting, or waiting for room), are not members, and a driver attaching
ends them (their slots go back to the cluster).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from zero_ray.control.client import ClientConfig, OwnerClient
from zero_ray.control.handlers import ModelLayout, OwnerStatus
from zero_ray.core.ray_names import NAMESPACE
from zero_ray.core.run_position import Position
from zero_ray.driver.model_view import ModelView
from zero_ray.errors import ConfigError, ControlError, ModelError, OwnerLostError

if TYPE_CHECKING:  # run_spec imports torch, which `zero-ray status` does without until a run answers
    from zero_ray.owner.step.run_spec import RunSpec

_NAME = re.compile(r"^zero_ray-(?P<run>[0-9a-f]+)-rank(?P<rank>\d+)-g(?P<gen>\d+)(?P<ahead>-s\d+)?$")


def started_ahead(name: str) -> bool:
    """Whether an owner's actor name is that of a replacement started ahead of a grow (a
    member only if the grow took it in: its Status says)."""
    match = _NAME.match(name)
    return bool(match and match["ahead"])


def complete(statuses: list[OwnerStatus]) -> bool:
    """Whether these owners form a whole pool by themselves: ranks 0..n-1, each of n owners."""
    return (bool(statuses) and sorted(s.rank for s in statuses) == list(range(len(statuses)))
            and {s.world_size for s in statuses} == {len(statuses)})


def _owner_names() -> dict[str, list[str]]:
    """The live owners' actor names, by run id."""
    runs: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name, namespace = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, NAMESPACE)
        match = _NAME.match(name)
        if namespace == NAMESPACE and match:
            runs.setdefault(match["run"], []).append(name)
    return runs


def _statuses(names: list[str], *, timeout_s: float) -> tuple[list[tuple[Any, OwnerStatus]], RunSpec | None]:
    """Each named owner's actor handle and Status, and the run spec they hold (read from one)."""
    from zero_ray.driver.pool_spec import client_tls  # imports torch, as the run spec's unpickling does

    try:
        handles = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
        nodes = ray.get([h.node.remote() for h in handles], timeout=timeout_s)
        credentials, run = ray.get([handles[0].credentials.remote(), handles[0].run_spec.remote()],
                                   timeout=timeout_s)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, AssertionError) as err:
        # AssertionError: Ray 2.60's get_actor on a named actor that is being torn down (its class
        # entry already gone from the GCS) fails an internal assert instead of a ValueError.
        raise OwnerLostError(f"an owner of {names} did not answer within {timeout_s:g}s: {err}", rank=None) from err
    tls = client_tls(run.config.control_tls if run is not None else None)

    def status(node: dict[str, Any]) -> OwnerStatus:
        config = ClientConfig(address=node["control_address"], credentials=credentials, timeout_s=timeout_s, **tls)
        with OwnerClient(config) as client:
            return client.status()

    try:
        with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="zero_ray-attach") as pool:
            statuses = list(pool.map(status, nodes))
    except ControlError as err:
        raise OwnerLostError(f"an owner of {names} did not answer its Status call: {err}", rank=None) from err
    return list(zip(handles, statuses)), run


def _members(names: list[str], *, timeout_s: float,
             end_others: bool) -> tuple[list[tuple[Any, OwnerStatus]], RunSpec | None]:
    """The pool members among a run's named owners, with the run spec: every owner started with
    the pool, and those started ahead that a grow took in. Replacements not taken in (standby,
    or not answering ``node`` within ``timeout_s``) are left out, and ended with ``end_others``."""
    plain, ahead = [n for n in names if not started_ahead(n)], [n for n in names if started_ahead(n)]
    owners, spec = _statuses(plain, timeout_s=timeout_s) if plain else ([], None)
    others: list[Any] = []
    if ahead and complete([s for _, s in owners]):  # no rank left that a taken-in one could hold
        others = list(_handles(ahead).values())
    elif ahead and (handles := _handles(ahead)):
        answers = {n: h.node.remote() for n, h in handles.items()}
        done, _ = ray.wait(list(answers.values()), num_returns=len(answers), timeout=timeout_s)
        answered = [n for n, a in answers.items() if a in done and _answered(a)]
        others = [handles[n] for n in handles if n not in answered]
        if answered:
            asked, asked_spec = _statuses(answered, timeout_s=timeout_s)
            spec = spec if spec is not None else asked_spec
            owners += [(h, st) for h, st in asked if not st.standby]
            others += [h for h, st in asked if st.standby]
    if end_others:
        for handle in others:
            ray.kill(handle, no_restart=True)
    return owners, spec


def _handles(names: list[str]) -> dict[str, Any]:
    """Actor handles of the named owners that Ray still has (an ended one's name is freed)."""
    handles = {}
    for name in names:
        try:
            handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        except (ValueError, AssertionError):  # AssertionError: one being torn down (see _statuses)
            continue
    return handles


def _answered(ref: ray.ObjectRef) -> bool:
    """Whether a finished ``node`` call returned (not the error of an actor that died)."""
    try:
        ray.get(ref, timeout=0)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


def detached_runs(*, timeout_s: float = 10.0) -> dict[str, list[OwnerStatus]]:
    """Every run whose owners are alive and detached, by run id: each owner's status (rank,
    node, generation, position (``step``, ``samples_seen``), phase), in rank order. Needs
    ``ray.init()``."""
    out: dict[str, list[OwnerStatus]] = {}
    for run, names in _owner_names().items():
        try:
            statuses = [s for _, s in _members(names, timeout_s=timeout_s, end_others=False)[0]]
        except OwnerLostError:
            continue  # a run whose owners are ending: not attachable
        if any(s.detached for s in statuses):
            out[run] = sorted(statuses, key=lambda s: s.rank)
    return out


@dataclass(frozen=True, kw_only=True)
class FoundRun:
    """A detached run's owners in rank order, what they report, and the run spec they hold."""

    run_id: str
    actors: list[Any]
    statuses: list[OwnerStatus]
    spec: RunSpec | None

    @property
    def run(self) -> RunSpec:
        if self.spec is None:  # find_run refuses a run that is not detached, and every detached one has a spec
            raise ConfigError(f"the owners of run {self.run_id!r} hold no run spec; the run cannot be attached")
        return self.spec

    @property
    def layout(self) -> ModelLayout | None:
        """The model as the owners laid it out (the same on every owner)."""
        return self.statuses[0].layout

    @property
    def generation(self) -> int:
        return max(s.generation for s in self.statuses)

    @property
    def position(self) -> Position:
        """The run's position: that of the owner with the fewest steps completed (one caught in
        the middle of a step has not completed it; settling the pool brings the others back)."""
        least = min(self.statuses, key=lambda s: s.step)
        return Position(step=least.step, samples_seen=least.samples_seen)

    @property
    def settled(self) -> bool:
        """Every owner idle at the same step, in the same generation: nothing to re-form."""
        return (len({s.step for s in self.statuses}) == 1
                and len({s.generation for s in self.statuses}) == 1
                and all(s.phase == "idle" and not s.busy for s in self.statuses))


def find_run(run_id: str, *, timeout_s: float) -> FoundRun:
    """The owners of detached run ``run_id``, checked to form one complete pool."""
    names = _owner_names().get(run_id)
    if not names:
        known = sorted(_owner_names())
        raise ConfigError(f"no owners of run {run_id!r} are alive in namespace {NAMESPACE!r} (runs with live owners: "
                          f"{known}); a run's owners outlive its driver only with ElasticConfig(detached=True), for "
                          "orphan_timeout_s")
    owners, spec = _members(names, timeout_s=timeout_s, end_others=True)
    found = sorted(owners, key=lambda hs: hs[1].rank)
    statuses = [s for _, s in found]
    sizes = {s.world_size for s in statuses}
    ranks = [s.rank for s in statuses]
    if len(sizes) != 1 or ranks != list(range(len(statuses))) or sizes != {len(statuses)}:
        raise ConfigError(f"the owners of run {run_id!r} do not form one pool: ranks {ranks}, world sizes "
                          f"{sorted(sizes)}; the run cannot be attached (restore it from a checkpoint)")
    if not statuses[0].detached:
        raise ConfigError(f"run {run_id!r} is not detached; only ElasticConfig(detached=True) runs can be attached")
    return FoundRun(run_id=run_id, actors=[h for h, _ in found], statuses=statuses, spec=spec)


def check_layout(found: FoundRun, model_fn: Any, *, seed: int) -> None:
    """``model_fn`` builds the model the owners hold (names and shapes), on the meta device."""
    from zero_ray.owner.construction.materialize import build_recorded
    from zero_ray.owner.construction.sources import build_module, param_specs

    try:
        module, _ = build_recorded(model_fn, seed=seed, record=False)
    except ModelError:  # buffers computed from parameters need a real build
        module = build_module(model_fn, seed)
    mine = {name: tuple(shape) for name, shape, _ in param_specs(module)}
    theirs = dict(ModelView.of(found.layout).shapes)
    if mine != theirs:
        only = sorted(set(mine) ^ set(theirs))[:10]
        shapes = [(n, list(mine[n]), list(theirs[n])) for n in mine if n in theirs and mine[n] != theirs[n]][:10]
        raise ConfigError(f"model_fn does not build the model run {found.run_id!r} holds: names on one side only "
                          f"{only}, shapes (name, model_fn, owners) {shapes}")
