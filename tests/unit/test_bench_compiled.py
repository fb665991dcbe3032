"""The benchmark's compiled systems (issue 34): the registry entries, ``--systems compiled``,
each compiled system's speedup over its eager twin and against single-process torch's, the
report's table, and that the hand-compiled torch systems compile the regions zero_ray does."""

from __future__ import annotations

import pytest

from benchmarks.compare import expand_names
from benchmarks.harness.compile_gain import COMPILE_NOTE, compile_gains, compile_table, eager_twin
from benchmarks.harness.report import render_markdown
from benchmarks.harness.results import BenchResults, RunResult, WorkloadInfo
from benchmarks.harness.runner import DEFAULT_SYSTEMS, SYSTEM_GROUPS
from benchmarks.harness.stats import Summary
from benchmarks.harness.systems import COMPILED_SIDE_BY_SIDE, SYSTEMS, make_system
from benchmarks.harness.workloads import compiled_model, gpt_workload, mlp_workload
from zero_ray.core.stage3_units import WrapPolicy, innermost_units, plan_units, repeated_blocks
from zero_ray.errors import ConfigError
from zero_ray.owner.construction.sources import describe_modules

from test_bench_report import fake_results


def _run(system: str, median: float | None, *, first: float | None = None, model: str = "gpt") -> RunResult:
    label = f"label of {system}"
    if median is None:
        return RunResult(model=model, system=system, label=label, status="failed", reason="boom", world_size=2)
    return RunResult(model=model, system=system, label=label, status="ok", world_size=2,
                     step_ms=Summary(median=median, min=median, max=median, n=10), first_step_ms=first)


RUNS = [
    _run("single", 100.0, first=120.0), _run("single+compile", 50.0, first=40_000.0),
    _run("ddp", 150.0), _run("ddp+compile", None),  # a failed compiled run has no gain
    _run("zero2", 200.0, first=300.0), _run("zero2+compile", 125.0, first=60_000.0),
    _run("zero3", None), _run("zero3+compile", 90.0),  # nor one whose eager twin failed
    _run("zero1+compile", 80.0),  # nor one run without its twin
    _run("single", 10.0, model="mlp"), _run("zero1", 10.0, model="mlp"), _run("zero1+compile", 5.0, model="mlp"),
]


def test_speedup_over_the_eager_twin_and_against_single_process_torch() -> None:
    gains = {(g.model, g.system): g for g in compile_gains(RUNS)}
    assert set(gains) == {("gpt", "single+compile"), ("gpt", "zero2+compile"), ("mlp", "zero1+compile")}
    single, zero2 = gains["gpt", "single+compile"], gains["gpt", "zero2+compile"]
    assert single.speedup == pytest.approx(2.0) and single.of_single is None  # the reference itself
    assert (zero2.eager_ms, zero2.compiled_ms) == (200.0, 125.0)
    assert zero2.speedup == pytest.approx(1.6) and zero2.of_single == pytest.approx(0.8)  # 1.6 / 2.0
    assert (zero2.eager_first_step_ms, zero2.first_step_ms) == (300.0, 60_000.0)
    # mlp has no compiled single process: its speedup stands alone, never divided by gpt's
    assert gains["mlp", "zero1+compile"].speedup == pytest.approx(2.0) and gains["mlp", "zero1+compile"].of_single is None


def test_table_and_report() -> None:
    table = compile_table([r for r in RUNS if r.model == "gpt"])
    assert table is not None
    assert "| label of zero2+compile | 200.0 | 125.0 | 1.60 | 0.80 | 0.3 → 60.0 |" in table.splitlines()
    assert "| label of single+compile | 100.0 | 50.0 | 2.00 | — | 0.1 → 40.0 |" in table.splitlines()
    assert compile_table([r for r in RUNS if eager_twin(r.system) is None]) is None
    results = BenchResults(machine={}, settings={"world_size": 2},
                           workloads=(WorkloadInfo(name="gpt", description="d", num_params=1, global_batch=2),),
                           runs=tuple(r for r in RUNS if r.model == "gpt"))
    text = render_markdown(results)
    assert "### gpt: compiled vs eager" in text and COMPILE_NOTE in text
    plain = render_markdown(fake_results())  # no compiled system: no table, no note
    assert "compiled vs eager" not in plain and COMPILE_NOTE not in plain


def test_first_step_survives_json() -> None:
    r = _run("zero2+compile", 125.0, first=60_000.0)
    assert RunResult.from_dict(r.to_dict()).first_step_ms == 60_000.0
    assert RunResult.from_dict({k: v for k, v in r.to_dict().items() if k != "first_step_ms"}).first_step_ms is None


def test_registry_and_groups() -> None:
    compiled = {n for n in SYSTEMS if eager_twin(n) is not None}
    assert compiled == {"single+compile", "ddp+compile"} | {f"zero{s}+compile" for s in range(4)}
    assert all(eager_twin(n) in SYSTEMS for n in compiled)
    assert not compiled & set(DEFAULT_SYSTEMS)  # compiling doubles a run: never by default
    assert COMPILED_SIDE_BY_SIDE == ("single", "single+compile", "ddp", "ddp+compile", "zero1", "zero1+compile",
                                     "zero2", "zero2+compile", "zero3", "zero3+compile")
    z3 = make_system("zero3+compile")
    assert (z3.name, z3.label, z3.stage, z3.compiled, z3.paper_stage) == \
        ("zero3+compile", "zero_ray stage 3 + compile", 3, True, 3)
    assert make_system("zero3").compiled is False and make_system("single").compiled is False
    single, ddp = make_system("single+compile"), make_system("ddp+compile")
    assert (single.name, single.compiled, single.world_size(4)) == ("single+compile", True, 1)
    assert (ddp.name, ddp.label, ddp.compiled) == ("ddp+compile", "PyTorch DDP + compile", True)


def test_system_list_expands_groups_in_place() -> None:
    names = tuple(SYSTEMS)
    assert expand_names("compiled", names, SYSTEM_GROUPS) == COMPILED_SIDE_BY_SIDE
    assert expand_names("fsdp2, compiled", names, SYSTEM_GROUPS) == ("fsdp2",) + COMPILED_SIDE_BY_SIDE
    # ddp once, where it came first
    assert expand_names("ddp,all", names, SYSTEM_GROUPS) == ("ddp",) + tuple(n for n in DEFAULT_SYSTEMS if n != "ddp")
    with pytest.raises(ValueError, match="zero9"):
        expand_names("compiled,zero9", names, SYSTEM_GROUPS)


@pytest.mark.parametrize("workload", [gpt_workload(), mlp_workload(depth=3)], ids=lambda w: w.name)
def test_hand_compiled_blocks_are_the_regions_zero_ray_compiles(workload) -> None:  # type: ignore[no-untyped-def]
    model = workload.model_fn()
    infos, sites, _ = describe_modules(model)
    # Stages 0-2: ZeroConfig(compile=True) compiles the repeated blocks.
    assert {c.rsplit(".", 1)[-1] for c in repeated_blocks(infos)} == set(workload.blocks)
    blocks = sorted(p for p, m in model.named_modules() if type(m).__name__ in workload.blocks)
    # Stage 3: the innermost default units, so zero3+compile needs no wrap_policy of its own.
    units = plan_units(infos, [p.numel() for p in model.parameters()], policy=WrapPolicy(), sites=sites)
    assert sorted(innermost_units(units)) == blocks
    compiled = workload.compiled_by_hand().model_fn()
    assert sorted(p for p, m in compiled.named_modules() if "forward" in vars(m)) == blocks
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_compiling_no_block_is_refused() -> None:
    with pytest.raises(ConfigError, match="no module of Sequential"):
        compiled_model(mlp_workload(width=8, depth=2).model_fn, ("Block",))
    with pytest.raises(ConfigError, match="names no blocks"):
        gpt_workload().__class__(**{**vars(gpt_workload()), "blocks": ()}).compiled_by_hand()
