"""``python -m benchmarks.tensor_parallel``: the case tensor parallelism exists for, a global batch
of ONE long sequence (which data parallelism cannot split), on this machine (issue 45).

    python -m benchmarks.tensor_parallel                 # the table in docs/tensor_parallel.md
    python -m benchmarks.tensor_parallel --budget-mib 256 --layers 16
    python -m benchmarks.tensor_parallel --kinds 6080 --cases "T=4 + P_a"   # the peak by kind

Cases: T=1 (one owner) without and with activation checkpointing, T=4 with checkpointing (each TP
rank keeps every block's whole input) and T=4 with P_a (each keeps 1/4 and all-gathers it before
the recomputation). A Hugging Face Llama (grouped-query attention, SDPA, byte vocabulary) from a
small config under its own plan, fp32 SGD (so the update's temporaries, AdamW's, do not set
the peak at short lengths), data-parallel size 1 (one sequence: nothing for DP
to split). Owners are OwnerEngines on threads of this process over the in-memory group of
tests/thread_ranks.py (the same engine and collectives' protocol as Ray owners, bytes counted
as a ring sends them).

Memory budget per owner, enforced by measurement: an owner's peak is its held model state and
buffers (``memory_report()["total"]``) plus the most bytes the tensors its own thread allocated
during a step held at once (a TorchDispatchMode per rank thread counting each new storage until
it is freed; a kernel's internal scratch is not counted). A sequence "trains" for a case when a
step at that length completes on every owner with every owner's peak within the budget. The
peak is affine in the sequence length here (SDPA's CPU kernel keeps no S x S matrix; asserted
from a third point), so two short measured steps fit it, the longest length is solved from the
fit (a multiple of ``--granule``) and then trained and measured to confirm it (where the measured
peak is a little above the line, the length steps down by the excess once and is measured again).

The budget: issue 45 asks for a quarter of this machine's memory per owner. At that size the
longest sequences run to hundreds of thousands of tokens, whose attention alone (quadratic)
takes hours on this machine's 2 cores, so the trained budget is ``--budget-mib`` (default 64
MiB, a stand-in as benchmarks.stage3_capacity's cap is) and the quarter-machine lengths are
printed from the same measured fits, labelled as solved, not trained.

Writes benchmarks/results/tensor_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zero_ray as zr
from zero_ray.compat.torch_private import in_backward
from zero_ray.core.stage3_units import WrapPolicy
from zero_ray.owner.construction.group_ops import BODIES
from zero_ray.owner.step.engine import OwnerEngine

# The in-memory thread group lives with the tests (the library has none); the benchmark borrows it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from thread_ranks import engine_spec, on_threads  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Case:
    """One row: TP size, checkpointing, P_a, sequence parallelism."""

    name: str
    size: int
    checkpointing: bool
    partition: bool
    sequence_parallel: bool = False


CASES = (Case(name="T=1", size=1, checkpointing=False, partition=False),
         Case(name="T=1 + checkpointing", size=1, checkpointing=True, partition=False),
         Case(name="T=4 + checkpointing", size=4, checkpointing=True, partition=False),
         Case(name="T=4 + P_a", size=4, checkpointing=True, partition=True),
         # sequence parallelism: the norms and residuals on 1/4 of the sequence; a block's input is
         # then 1/4 already, kept as it is (P_a has nothing left to split)
         Case(name="T=4 + P_a + SP", size=4, checkpointing=True, partition=True, sequence_parallel=True))


@dataclass(frozen=True, kw_only=True)
class Step:
    """One measured step of one case at one sequence length (the slowest / largest owner)."""

    seq: int
    step_s: float
    peak_bytes: int  # held + step_peak, the largest over the owners
    held_bytes: int  # model state and buffers (memory_report total)
    tp_bytes: int  # sent per owner in the step, TP group (tp_*, P_a's gathers included)
    tp_activation_bytes: int  # of which P_a's all-gathers
    dp_bytes: int  # sent per owner, ZeRO's data-parallel collectives
    activation_bytes: int  # the checkpointed inputs an owner kept in the step
    loss: float


class RankBytes(TorchDispatchMode):
    """Live and peak bytes of the CPU storages the ops under it (on this thread) allocate.

    A storage an op's output shares with one of its inputs is not new (a view, an in-place op):
    counted, a parameter first seen through ``weight.t()`` in ``F.linear`` was a step allocation.
    zero_ray's TP collectives are custom ops, one call to a mode: their eager bodies run under
    the mode instead (``group_ops.BODIES``), so their buffers are counted as when they were plain
    calls."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._lock = threading.Lock()  # a storage can be freed on another rank's thread
        self.collective: str | None = None  # the TP collective whose body is running, if one is

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._seen.discard(key)
            self.live -= nbytes

    def _add(self, key: int, nbytes: int, t: torch.Tensor) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        body = BODIES.get(func.name()) if func.namespace == "zero_ray" else None
        if body is None:
            out = func(*args, **(kwargs or {}))
        else:
            self.collective = func.name().partition("::")[2]
            try:
                with self:  # the mode is off inside its own dispatch; the body's ops come back to it
                    out = body(*args, **(kwargs or {}))
            finally:
                self.collective = None
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                with self._lock:
                    if not nbytes or key in self._seen or key in inputs:
                        continue
                    self._seen.add(key)
                    self._add(key, nbytes, t)
                weakref.finalize(storage, self._free, key, nbytes)
        return out


class _ModuleStack(threading.local):
    """The modules whose forward is running on this thread (global hooks push and pop them)."""

    def __init__(self) -> None:
        self.modules: list[torch.nn.Module] = []


class KindBytes(RankBytes):
    """RankBytes, each new storage counted under a kind (what made it: the module running, the
    phase, the last dimension's meaning), and every kind's live bytes kept at the peak.
    ``partition``: P_a is on (checkpointing, T > 1, no sequence parallelism), so a flat slice of
    a block's input is P_a's; without it such a tensor is something else's (SP's collectives')."""

    def __init__(self, stack: _ModuleStack, *, hidden: int, vocab: int, intermediate: int, size: int,
                 seq: int, partition: bool = True) -> None:
        super().__init__()
        self.stack, self.size, self.seq, self.partition = stack, size, seq, partition
        self.hidden, self.vocab = hidden, vocab
        # the whole sizes last, so that at T = 1 they name the dimension
        self.dims = {vocab // size: "vocabulary / T", intermediate // size: "intermediate / T", hidden: "hidden",
                     vocab: "vocabulary", intermediate: "intermediate"}
        self.live_by: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self._kind: dict[int, str] = {}

    def kind(self, t: torch.Tensor) -> str:
        backward = in_backward()
        phase = "recomputation: " if backward and self.stack.modules else "gradients: " if backward else "forward: "
        if self.collective is not None and t.dim() == 1:
            return f"{phase}{self.collective}'s flat buffers"
        slice_numel = -(-self.seq * self.hidden // self.size)
        if self.partition and t.dim() == 1 and self.size > 1 and t.numel() == slice_numel and not backward:
            return "P_a: kept slices of the blocks' inputs"
        if self.partition and t.dim() == 1 and self.size > 1 and t.numel() == self.size * slice_numel and backward:
            return "P_a: a block's input gathered for its recomputation"
        if self.stack.modules:
            module = self.stack.modules[-1]
            name = type(module).__name__
            if isinstance(module, torch.nn.Linear) and module.weight.shape[0] in (self.vocab, self.vocab // self.size):
                name = "lm_head: logits"
            elif name.endswith("ForCausalLM"):
                name = "loss over the vocabulary"
            elif name.endswith("DecoderLayer"):
                name = "block outputs: residuals (the next block's checkpointed input)"
            elif isinstance(module, torch.nn.Linear) and len(self.stack.modules) > 1:
                name = f"{type(self.stack.modules[-2]).__name__}'s linear outputs"
            return phase + name
        if t.dim() <= 1:
            return "flat buffers (gradients, staging) and scalars: fixed"
        return ("gradients: " if backward else "outside modules: ") + self.dims.get(t.shape[-1], "other")

    def _add(self, key: int, nbytes: int, t: torch.Tensor) -> None:
        kind = self._kind[key] = self.kind(t)
        self.live += nbytes
        self.live_by[kind] = self.live_by.get(kind, 0) + nbytes
        if self.live > self.peak:
            self.peak, self.at_peak = self.live, dict(self.live_by)

    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._seen.discard(key)
            self.live -= nbytes
            kind = self._kind.pop(key)
            self.live_by[kind] -= nbytes


def kinds_at(case: Case, seq: int, args: argparse.Namespace) -> str:
    """``--kinds``: one rank's bytes at its step's peak, by kind, at ``seq`` tokens."""
    stack = _ModuleStack()

    def push(module: torch.nn.Module, inputs: Any) -> None:
        stack.modules.append(module)

    def pop(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if stack.modules:
            stack.modules.pop()

    hooks = (torch.nn.modules.module.register_module_forward_pre_hook(push),
             torch.nn.modules.module.register_module_forward_hook(pop, always_call=True))
    try:
        modes = {}

        def mode_for(rank: int) -> KindBytes:
            modes[rank] = KindBytes(stack, hidden=args.hidden, vocab=args.vocab, intermediate=args.intermediate,
                                    size=case.size, seq=seq,
                                    partition=case.checkpointing and case.partition and not case.sequence_parallel)
            return modes[rank]

        step = measure(case, seq, args, mode_for=mode_for)
    finally:
        for h in hooks:
            h.remove()
    mode = modes[0]
    lines = [f"{case.name} at {seq} tokens, rank 0: held {step.held_bytes / MIB:,.2f} MiB (memory_report: "
             f"parameters, gradients, optimizer state) + step peak {mode.peak / MIB:,.2f} MiB, of which:"]
    for kind, nbytes in sorted(mode.at_peak.items(), key=lambda kv: -kv[1]):
        if nbytes > 0:
            lines.append(f"  {kind:64s} {nbytes / MIB:8.2f} MiB {nbytes / seq:8,.0f} B/token")
    return "\n".join(lines)


def llama(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 20,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def measure(case: Case, seq: int, args: argparse.Namespace, mode_for: Any = None) -> Step:
    """Two steps on one sequence of ``seq`` tokens; the second measured."""
    ckpt = (zr.ActivationCheckpointing(wrap_policy=WrapPolicy(classes=("LlamaDecoderLayer",)),
                                       partition=case.partition) if case.checkpointing else None)
    spec = engine_spec(functools.partial(llama, args), lm_loss, zr.SGD(lr=1e-3), stage=2, checkpointing=ckpt,
                       bucket_bytes=4 * MIB,
                       tensor_parallel=zr.TensorParallel(size=case.size, sequence_parallel=case.sequence_parallel))
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    build = threading.Lock()

    def rank_main(group: Any) -> dict[str, Any]:
        with build:  # every rank builds the same seeded whole module from the process-wide RNG
            engine = OwnerEngine(spec, rank=group.rank, group=group)
        group.barrier()
        engine.step(ids, global_samples=1)
        mode = mode_for(group.rank) if mode_for is not None else RankBytes()
        kept = engine.state.saved_inputs.kept_bytes
        group.barrier()
        start = time.perf_counter()
        with mode:
            result = engine.step(ids, global_samples=1)
        group.barrier()
        sent = dict(engine.last_bytes)
        return {"s": time.perf_counter() - start, "held": engine.memory_report()["total"], "peak": mode.peak,
                "tp": sum(n for op, n in sent.items() if op.startswith("tp_")),
                "tp_act": sent.get("tp_activation", 0),
                "dp": sum(n for op, n in sent.items() if not op.startswith("tp_") and op != "scalars"),
                "act": engine.state.saved_inputs.kept_bytes - kept, "loss": result.totals.loss_sum}

    ranks = on_threads(case.size, rank_main, timeout_s=3600)
    return Step(seq=seq, step_s=max(r["s"] for r in ranks), peak_bytes=max(r["held"] + r["peak"] for r in ranks),
                held_bytes=max(r["held"] for r in ranks), tp_bytes=max(r["tp"] for r in ranks),
                tp_activation_bytes=max(r["tp_act"] for r in ranks), dp_bytes=max(r["dp"] for r in ranks),
                activation_bytes=max(r["act"] for r in ranks), loss=ranks[0]["loss"])


def solve(a: Step, b: Step, budget: int, granule: int) -> int:
    """The longest multiple of ``granule`` whose peak, on the line through a and b, fits ``budget``."""
    per_token = (b.peak_bytes - a.peak_bytes) / (b.seq - a.seq)
    fixed = a.peak_bytes - per_token * a.seq
    return max(0, int((budget - fixed) / per_token) // granule * granule)


def longest(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    budget = args.budget_mib * MIB
    lo, hi = (measure(case, s, args) for s in (args.probe, 2 * args.probe))
    third = measure(case, 3 * args.probe, args)
    predicted = 2 * hi.peak_bytes - lo.peak_bytes  # the line through the first two, at 3x
    if abs(third.peak_bytes - predicted) > 0.01 * third.peak_bytes:
        raise RuntimeError(f"{case.name}: peak not affine in the length ({lo.peak_bytes}, {hi.peak_bytes}, "
                           f"{third.peak_bytes} at {args.probe}, 2x, 3x)")
    per_token = (hi.peak_bytes - lo.peak_bytes) / (hi.seq - lo.seq)
    seq = solve(lo, hi, budget, args.granule)
    trained = measure(case, seq, args) if seq else None
    if trained is not None and trained.peak_bytes > budget:  # a little above the line: step down once, by the excess
        seq -= (int((trained.peak_bytes - budget) / per_token) // args.granule + 1) * args.granule
        trained = measure(case, seq, args) if seq > 0 else None
    fits = trained is not None and trained.peak_bytes <= budget
    quarter = solve(lo, hi, args.quarter_mib * MIB, args.granule)
    row = {"case": case.name, "longest_trained": seq if fits else 0, "peak_at_longest": trained and trained.peak_bytes,
           "bytes_per_token": per_token, "fixed_bytes": lo.peak_bytes - per_token * lo.seq,
           "solved_at_quarter_machine": quarter, "probe": asdict(hi), "at_longest": trained and asdict(trained)}
    print(f"  {case.name}: {per_token:,.0f} B/token + {row['fixed_bytes'] / MIB:,.1f} MiB; longest {seq} "
          f"(peak {trained.peak_bytes / MIB if trained else 0:,.1f} MiB of {args.budget_mib}), "
          f"step {trained.step_s if trained else 0:.1f} s; solved at a quarter of the machine: {quarter}", flush=True)
    return row


def machine_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB


def render(out: dict[str, Any]) -> str:
    cfg = out["config"]
    base = next(r for r in out["rows"] if r["case"] == "T=1 + checkpointing")["longest_trained"]
    plain = next(r for r in out["rows"] if r["case"] == "T=1")["longest_trained"]
    lines = [f"Llama {cfg['layers']} layers, hidden {cfg['hidden']}, intermediate {cfg['intermediate']}, "
             f"{cfg['heads']} query / {cfg['kv_heads']} key-value heads, vocabulary {cfg['vocab']}; fp32 SGD, "
             f"one sequence, D = 1; budget {cfg['budget_mib']} MiB per owner ({out['machine']}). "
             f"Step, bytes and activations at the probe length {2 * cfg['probe']} (the slowest / largest owner).",
             "",
             "| case | longest trained | x T=1 (ckpt) | x T=1 | peak there MiB | B/token | step s | TP bytes | "
             "P_a gathers | DP bytes | activations kept | solved at 1/4 machine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        p, n = r["probe"], r["longest_trained"]
        ratio = f"{n / base:.2f}" if base else "-"
        lines.append(f"| {r['case']} | {n:,} | {ratio} | {n / plain:.2f} | "
                     f"{(r['peak_at_longest'] or 0) / MIB:,.1f} | {r['bytes_per_token']:,.0f} | {p['step_s']:.2f} | "
                     f"{p['tp_bytes']:,} | {p['tp_activation_bytes']:,} | {p['dp_bytes']:,} | "
                     f"{p['activation_bytes']:,} | {r['solved_at_quarter_machine']:,} |")
    pa = next(r for r in out["rows"] if r["case"] == "T=4 + P_a")["probe"]
    share = pa["tp_activation_bytes"] / max(1, pa["tp_bytes"] - pa["tp_activation_bytes"])
    lines += ["", f"P_a's all-gathers: {share:.1%} of the TP all-reduces they ride on (paper: under 10%)."]
    quarter = next(r for r in out["rows"] if r["case"] == "T=1 + checkpointing")["solved_at_quarter_machine"]
    if quarter:
        lines += ["", "At a quarter of the machine (solved): " + ", ".join(
            f"{r['case']} {r['solved_at_quarter_machine'] / quarter:.2f}x" for r in out["rows"] if r["case"].startswith("T=4"))
            + " T=1 + checkpointing's length (issue 45's goal: T=4 at least 2.5x)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=344)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256, help="bytes: a large vocabulary's logits are replicated")
    ap.add_argument("--budget-mib", type=int, default=64, help="per owner, the trained budget")
    ap.add_argument("--quarter-mib", type=int, default=machine_mib() // 4, help="a quarter of this machine")
    ap.add_argument("--probe", type=int, default=256, help="the fit's lengths: this, 2x and 3x")
    ap.add_argument("--granule", type=int, default=64)
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--results-dir", default=str(RESULTS))
    ap.add_argument("--kinds", type=int, default=0, metavar="SEQ",
                    help="instead of the table: rank 0's peak bytes by kind at SEQ tokens, per case")
    args = ap.parse_args()
    torch.manual_seed(0)
    wanted = set(args.cases.split(","))
    if args.kinds:
        for case in CASES:
            if case.name in wanted:
                print(kinds_at(case, args.kinds, args), flush=True)
        return
    rows = [longest(c, args) for c in CASES if c.name in wanted]
    out = {"config": vars(args) | {"time": time.strftime("%Y-%m-%d %H:%M:%S")},
           "machine": f"{os.cpu_count()} cores, {machine_mib():,} MiB, torch {torch.__version__}", "rows": rows}
    table = render(out)
    print(table)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "tensor_parallel.json").write_text(json.dumps(out, indent=1, default=str))
    (results / "tensor_parallel.md").write_text("# python -m benchmarks.tensor_parallel\n\n" + table)


if __name__ == "__main__":
    main()
