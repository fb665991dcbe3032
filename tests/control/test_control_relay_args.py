"""A relayed step packs every rank's indices (issue 44: no record per rank on the driver): each
rank's own request read back from the pack, and a child's pack cut from its parent's, equal the
requests the driver sends each owner directly, for contiguous and interleaved ranks alike."""

from __future__ import annotations

import enum
import random

import pytest

from zero_ray.control.handlers import Piece, RankSpan, RelayStepArgs, StepArgs
from zero_ray.driver.batch_staging import IndexedBatch, Outgoing, StepCommand
from zero_ray.errors import ConfigError


def _command(world: int, samples: int, seed: int) -> StepCommand:
    rng = random.Random(seed)
    batch = IndexedBatch(dataset="train", indices=tuple(rng.sample(range(10 * samples), samples)))
    out = batch.split(world_size=world, key="3:7")
    return StepCommand(step=StepArgs(step=7, piece=out.piece, global_samples=samples, generation=3, samples_seen=70,
                                     ahead=True), out=out)


@pytest.mark.parametrize(("world", "samples"), [(1, 1), (4, 4), (5, 13), (64, 200), (1024, 4096)])
def test_each_rank_reads_back_exactly_its_direct_request(world: int, samples: int) -> None:
    command = _command(world, samples, world)
    relayed = command.relayed(timeout_s=5.0)
    assert len(relayed.ranks) == 1 and relayed.rank_list == tuple(range(world))
    assert [relayed.rank_step(r) for r in range(world)] == command.per_rank()


@pytest.mark.parametrize("seed", range(10))
def test_a_child_s_pack_is_its_ranks_requests_wherever_they_sit(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(2, 40)
    command = _command(world, rng.randint(world, 5 * world), seed)
    direct = command.per_rank()
    top = command.relayed(timeout_s=9.0)
    # a node's ranks: contiguous, or interleaved with other nodes' (SPREAD placement)
    ranks = sorted(rng.sample(range(world), rng.randint(1, world)))
    child = top.for_ranks(ranks, timeout_s=8.5, relay=6)
    assert (child.timeout_s, child.relay, child.rank_list) == (8.5, 6, tuple(ranks))
    assert [child.rank_step(r) for r in ranks] == [direct[r] for r in ranks]
    grandchild = child.for_ranks(ranks[len(ranks) // 2:], timeout_s=8.0, relay=9)
    assert [grandchild.rank_step(r) for r in grandchild.rank_list] == [direct[r] for r in grandchild.rank_list]
    with pytest.raises(ConfigError, match="not among"):
        child.rank_step(max(ranks) + 1 if max(ranks) + 1 < world else -1)


def test_a_staged_batch_packs_no_indices_and_every_rank_names_its_key() -> None:
    out = Outgoing(key="2:5", world_size=3, piece=Piece(batch_key="2:5"))
    command = StepCommand(step=StepArgs(step=5, piece=out.piece, global_samples=9, generation=2), out=out)
    relayed = command.relayed(timeout_s=1.0)
    assert relayed.counts == () == relayed.indices
    assert [relayed.rank_step(r) for r in range(3)] == command.per_rank() == [command.step] * 3
    assert relayed.for_ranks([1, 2], timeout_s=0.5, relay=1).rank_list == (1, 2)


def test_a_pack_that_does_not_add_up_is_refused() -> None:
    step = StepArgs(step=0, piece=Piece(dataset="train"), global_samples=3)
    spans = (RankSpan(start=0, stop=2),)
    with pytest.raises(ConfigError, match="2 counts for 2 ranks|counts 3 indices but carries 2"):
        RelayStepArgs(step=step, ranks=spans, counts=(1, 2), indices=(4, 5), timeout_s=1.0)
    with pytest.raises(ConfigError, match="1 counts for 2 ranks"):
        RelayStepArgs(step=step, ranks=spans, counts=(2,), indices=(4, 5), timeout_s=1.0)
    with pytest.raises(ConfigError, match="ascending, non-empty, non-overlapping"):
        RelayStepArgs(step=step, ranks=(RankSpan(start=0, stop=2), RankSpan(start=1, stop=3)), timeout_s=1.0)
    with pytest.raises(ConfigError, match="carries indices"):
        RelayStepArgs(step=StepArgs(step=0, piece=Piece(dataset="train", indices=(1,)), global_samples=1),
                      ranks=spans, timeout_s=1.0)
    with pytest.raises(ConfigError, match="ascending, each once"):
        RelayStepArgs.of(step, ranks=[2, 1], timeout_s=1.0)


def test_spans_are_the_fewest_for_every_shape_of_ranks() -> None:
    # a range and a consecutive run take the fast paths; the rest the loop: all must agree
    from zero_ray.control.handlers import _spans_of

    def spans(ranks: object) -> list[tuple[int, int]]:
        return [(s.start, s.stop) for s in _spans_of(ranks)]  # type: ignore[arg-type]

    assert spans(range(3, 9)) == [(3, 9)] == spans(tuple(range(3, 9))) == spans(list(range(3, 9)))
    assert spans(range(0)) == [] == spans(())
    assert spans((4,)) == [(4, 5)]
    assert spans((0, 1, 2, 5, 6, 9)) == [(0, 3), (5, 7), (9, 10)]
    # first and last a run apart, but out of order or repeated inside: refused, not one span
    with pytest.raises(ConfigError, match="ascending"):
        _spans_of((0, 2, 1, 3))
    with pytest.raises(ConfigError, match="ascending"):
        _spans_of((0, 1, 1, 3))


def test_repeated_scalars_convert_in_one_call_and_enum_members_by_value() -> None:
    from zero_ray.control._generated import relay_pb2
    from zero_ray.control.conversion import to_message

    step = StepArgs(step=0, piece=Piece(dataset="train"), global_samples=3)
    args = RelayStepArgs(step=step, ranks=(RankSpan(start=0, stop=3),), counts=(1, 1, 1), indices=(7, 8, 9),
                         timeout_s=1.0)
    message = to_message(args, relay_pb2.RelayStepRequest)
    assert list(message.counts) == [1, 1, 1] and list(message.indices) == [7, 8, 9]

    class Relay(enum.Enum):  # not an int: protobuf refuses the members, their values go instead
        A = 4
        B = 2

    from zero_ray.control.handlers import HostRelaysResult
    reply = to_message(HostRelaysResult(relays=(Relay.A, Relay.B)), relay_pb2.HostRelaysReply)  # type: ignore[arg-type]
    assert list(reply.relays) == [4, 2]
