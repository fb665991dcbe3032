"""A peer restore at T = 2 brings back whole-tensor optimizer state exactly (issue 45), on thread
ranks running the owners' own code: (T, D) = (2, 2) trains the Llama of tp_llama.py with
Adafactor (whole-tensor: factored row/column moments) on the replicated embeddings and head and
AdamW on the rest; every owner takes its peer snapshot (owner/resilience/redundancy.PeerSnapshots:
its copy to a data-parallel owner of its TP shard, core/reshard_plan.backup_peers); owner 3 (TP
rank 1 of DP rank 1, the head's Adafactor assignee) is lost, and the surviving whole TP group
rebuilds at D = 1 from the copies (redundancy.restore_from_peers, what LiveRank.rebuild runs),
its torch.distributed transfers routed between the threads (tests/thread_p2p.py). The restored
owners' state equals the old owners' bit for bit: masters, AdamW's moments, Adafactor's whole
tensors (the lost owner's from its peer's copy) and the step counts; and a step after it
follows the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thread_p2p import P2P, thread_p2p
from thread_ranks import _BUILD_LOCK, ThreadGroup, engine_spec, on_threads, run_tp_ranks
from tp_llama import CLIP, batches, llama, lm_loss
from zero_ray.core.batching import split_batch, split_sizes
from zero_ray.core.optim_state import merge_tables
from zero_ray.core.reshard_plan import backup_peers
from zero_ray.core.restore_plan import PeerRestore, Peers
from zero_ray.core.tensor_parallel_plan import TensorParallel
from zero_ray.owner.resilience.redundancy import PeerSnapshots, restore_from_peers
from zero_ray.owner.resilience.resize import install
from zero_ray.owner.step.engine import OwnerEngine

REPLICATED = ("model.embed_tokens.weight", "lm_head.weight")
SIZE, DP, STAGE, STEPS = 2, 2, 1, 2


def adafactor(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adafactor([model.get_parameter(n) for n in REPLICATED], lr=1e-2)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for n, p in model.named_parameters() if n not in REPLICATED], lr=1e-3)


OPTIMIZERS = [adafactor, adamw]


def _state(engine: OwnerEngine) -> dict[str, torch.Tensor]:
    """An owner's optimizer state by name: each bucket's master and element-wise state over the
    bucket's whole flat range (zeros outside the rank's slice: summed over a shard's DP owners it
    is the shard's) and the whole-tensor state of the parameters it is the assignee of."""
    out: dict[str, torch.Tensor] = {}
    for s in engine.state.optimizer_slices():
        for kind, t in (("master", s.master), *sorted(s.moments.items())):
            whole = torch.zeros(max(s.end, s.bucket.numel))
            whole[s.start:s.end] = t
            out[f"bucket{s.bucket.index}.{kind}"] = whole
    for p, st in engine.state.optimizer.whole_state(saver_only=True).items():
        for k, t in st.items():
            out[f"whole{p}.{k}"] = t.clone()
    return out


def _masters(engines: list[OwnerEngine]) -> dict[str, torch.Tensor]:
    """Flat fp32 masters by parameter name from ``engines`` (the DP owners of one TP shard)."""
    out: dict[str, torch.Tensor] = {}
    for e in engines:
        for name, (lo, hi, values) in e.master_fragments().items():
            out.setdefault(name, torch.zeros(e.layout.param(name).numel))[lo:hi] = values
    return out


def test_a_peer_restore_at_t2_brings_back_whole_tensor_state_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    thread_p2p(monkeypatch)
    world = SIZE * DP
    steps = batches(STEPS + 1)
    _, _, old, _ = run_tp_ranks(SIZE, DP, llama, lm_loss, OPTIMIZERS, steps[:STEPS], stage=STAGE, clip=CLIP)
    # the head's Adafactor state is on DP rank 1: owner 3 holds it, and loses it
    head = next(i for i, p in enumerate(old[0].layout.params) if p.name == "lm_head.weight")
    assert old[0].state.optimizer.whole_plan.assignee[head] == 1
    assert head in old[3].state.optimizer.whole_state(saver_only=True)
    backup = backup_peers(["n"] * world, tensor_parallel=SIZE)
    peers = Peers.of(backup)
    snaps = [PeerSnapshots() for _ in range(world)]

    def take(group: ThreadGroup) -> None:
        r = group.rank
        snaps[r].take(old[r], P2P(group), step=STEPS - 1, backup=backup[r], ward=peers.ward[r], timeout_s=60)
        snaps[r].commit_upto(STEPS - 1)

    on_threads(world, take)
    assert backup[3] == 1 and 3 in snaps[1].sources()  # owner 3's copy is with owner 1
    # the survivors 0, 1 (a whole TP group) go on at D = 1; holders[i]: the position with old rank i's copy
    kept = [0, 1]
    holders = tuple(next(p for p, k in enumerate(kept) if i in snaps[k].sources()) for i in range(world))
    assert holders == (0, 1, 0, 1)
    restore = PeerRestore(old_world=world, holders=holders, description=snaps[0].own.description)
    spec = engine_spec(llama, lm_loss, OPTIMIZERS, stage=STAGE, clip=CLIP, tensor_parallel=TensorParallel(size=SIZE))
    new: list[OwnerEngine | None] = [None] * len(kept)

    def rebuild(group: ThreadGroup) -> None:
        p = group.rank
        sources = {r: s.state for r, s in snaps[kept[p]].sources().items()}
        plan, staged, _ = restore_from_peers(restore, position=p, world_size=len(kept), tensor_parallel=SIZE,
                                             sources=sources, group=P2P(group), timeout_s=60)
        with _BUILD_LOCK:
            engine = OwnerEngine(spec, rank=p, group=group)
        install(staged, engine.state, plan.table)
        engine.set_counters(restore.description.counters)
        engine.state.publish_masters()
        new[p] = engine

    on_threads(len(kept), rebuild)
    for t in range(SIZE):
        engine = new[t]
        assert engine is not None
        got = _state(engine)
        # TP shard t's state was split over its DP owners t and t + T: summed, it is whole
        want: dict[str, torch.Tensor] = {}
        for o in (old[t], old[t + SIZE]):
            for k, v in _state(o).items():
                if k.startswith("bucket"):
                    want[k] = want[k] + v if k in want else v.clone()
                else:
                    want.setdefault(k, v)  # whole-tensor state: its assignee's; scalars: merged
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), k
        # scalars (step counts, Adafactor's too) as the shard's DP owners had them
        assert engine.state.optimizer.table() == merge_tables([old[t].state.optimizer.table(),
                                                               old[t + SIZE].state.optimizer.table()])
    # the lost owner's Adafactor state of the head (row and column moments), exactly, on TP rank 1
    lost = old[3].state.optimizer.whole_state(saver_only=True)[head]
    restored = new[1].state.optimizer.whole_state(saver_only=True)[head]
    assert lost.keys() == restored.keys() and len(lost) >= 2
    assert all(torch.equal(restored[k], v) for k, v in lost.items())
    # and the restored owners step on as the uninterrupted ones do (D = 1 against D = 2: the
    # pieces' sums grouped otherwise, the resize bound)
    batch = steps[STEPS]

    def step(engines: list[OwnerEngine]) -> None:
        def run(group: ThreadGroup) -> None:
            e = engines[group.rank]
            piece = split_batch(batch, split_sizes(batch.shape[0], e.data_world_size))[e.data_rank]
            e.step(piece, global_samples=batch.shape[0])
        on_threads(len(engines), run)

    step(old)
    step([e for e in new if e is not None])
    for t in range(SIZE):
        want, got = _masters(old[t::SIZE]), _masters([new[t]])
        assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-6
