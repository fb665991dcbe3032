"""The relay tree a call to every owner travels (issue 44): the driver calls a few relays, each
relay calls at most ``fan_out`` children (relays, or the owners of its node), and replies are
combined on the way back up (:mod:`zero_ray.core.reply_combine`).

Shape, from the ranks' nodes alone (rank order, as ``OwnerPool.nodes`` holds them):

- every node has one relay, its *node relay*, whose subtree is exactly that node's ranks; a
  node with more ranks than ``fan_out`` gets relays of its own below it, so no relay calls more
  than ``fan_out`` children;
- above the nodes, relays group node relays (and each other) until the driver has at most
  ``fan_out`` children. Grouping always takes the shallowest subtrees first, which makes the
  depth the least any tree of that fan-out can have (``plan_relays`` says why);
- a relay runs in the process of the lowest live rank under it. Lowest, because every party
  can work it out from the node list without asking anyone, and because a shrink removes the
  highest ranks first (``OwnerPool`` drops ranks from the end), so the relay is the last of its
  node's processes to go.

Pure: imports neither ray nor grpc nor torch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from zero_ray.errors import ConfigError, RelayError

DEFAULT_FAN_OUT = 8  # Monarch's: its casts reach 1,024 actors on 128 hosts at 2.8 ms p50
MAX_FAN_OUT = 1024
# Below this many owners a step goes to every owner directly: one hop of the tree costs the
# step about a millisecond (benchmarks/relay_hop.py), which calling a few owners directly
# does not (docs/performance.md has the crossover measured with benchmarks/control_scale.py).
DEFAULT_MIN_OWNERS = 32


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """The control tree a step travels (``ZeroConfig(relays=...)``): ``fan_out`` is the most
    children any relay, and the driver, calls; pools of at least ``min_owners`` owners step
    through the tree, smaller ones call every owner directly (1 puts every pool on the tree)."""

    fan_out: int = DEFAULT_FAN_OUT
    min_owners: int = DEFAULT_MIN_OWNERS

    def __post_init__(self) -> None:
        f = self.fan_out
        if isinstance(f, bool) or not isinstance(f, int) or not 2 <= f <= MAX_FAN_OUT:
            raise ConfigError(f"RelayConfig(fan_out={f!r}) must be an integer from 2 to {MAX_FAN_OUT}: a relay "
                              f"with one child is a chain, not a tree; the default is {DEFAULT_FAN_OUT}")
        m = self.min_owners
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"RelayConfig(min_owners={m!r}) must be an integer >= 1: the pool size from which steps "
                              f"take the relay tree (1: always; the default is {DEFAULT_MIN_OWNERS})")


@dataclass(frozen=True, kw_only=True)
class Relay:
    """One relay: what it calls and where it runs. ``id`` stays the relay's across
    :meth:`RelayTree.reparent`; ``level`` is its height (1: it calls ranks; otherwise one more
    than its highest child relay); ``node`` is the node all its ranks are on (None above the
    node level)."""

    id: int
    level: int
    host: int
    node: str | None
    relays: tuple[int, ...] = ()  # the ids of the relays it calls
    ranks: tuple[int, ...] = ()  # the ranks it calls (a relay calls relays or ranks, never both)

    def __post_init__(self) -> None:
        if bool(self.relays) == bool(self.ranks):
            raise RelayError(f"relay {self.id} calls relays {self.relays} and ranks {self.ranks}: a relay calls "
                             "one kind of child, and at least one; build trees with plan_relays")
        if (self.level == 1) != bool(self.ranks) or self.level < 1:
            raise RelayError(f"relay {self.id} has level {self.level}: level 1 calls ranks, higher levels relays")

    @property
    def children(self) -> int:
        """How many children it calls."""
        return len(self.relays) + len(self.ranks)


@dataclass(frozen=True, kw_only=True)
class RelayTree:
    """The relays between the driver and every live rank. Built by :func:`plan_relays`,
    changed by :meth:`reparent`; checked whole on construction (every live rank under exactly
    one relay, no relay or driver over ``fan_out`` children, each relay on the lowest rank
    under it, a node relay's ranks all on its node)."""

    fan_out: int
    nodes: tuple[str, ...]  # rank -> its node, as planned (lost ranks included)
    relays: tuple[Relay, ...]  # by id; a relay that lost every rank under it is gone
    top: tuple[int, ...]  # the ids of the relays the driver calls
    lost: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _check(self)

    # -- lookups ---------------------------------------------------------------------------------------------
    @cached_property
    def _by_id(self) -> dict[int, Relay]:
        return {r.id: r for r in self.relays}

    @cached_property
    def _parent(self) -> dict[int, int | None]:
        out: dict[int, int | None] = dict.fromkeys(self.top)
        for r in self.relays:
            out.update(dict.fromkeys(r.relays, r.id))
        return out

    @cached_property
    def _caller(self) -> dict[int, int]:
        return {rank: r.id for r in self.relays for rank in r.ranks}

    def relay(self, relay_id: int) -> Relay:
        """The relay with this id."""
        try:
            return self._by_id[relay_id]
        except KeyError:
            raise RelayError(f"no relay {relay_id} in this tree (its ids: {sorted(self._by_id)})") from None

    @property
    def driver_children(self) -> tuple[Relay, ...]:
        """The relays the driver calls."""
        return tuple(self._by_id[i] for i in self.top)

    def children(self, relay_id: int) -> tuple[Relay, ...]:
        """The relays ``relay_id`` calls (none for a level-1 relay: its ``ranks`` are its children)."""
        return tuple(self._by_id[i] for i in self.relay(relay_id).relays)

    def parent(self, relay_id: int) -> Relay | None:
        """The relay that calls ``relay_id``; None when the driver does."""
        self.relay(relay_id)
        up = self._parent[relay_id]
        return None if up is None else self._by_id[up]

    def ranks_under(self, relay_id: int) -> tuple[int, ...]:
        """Every rank ``relay_id``'s subtree reaches, ascending (what a call to it covers)."""
        relay = self.relay(relay_id)
        return tuple(sorted(relay.ranks + tuple(r for c in relay.relays for r in self.ranks_under(c))))

    @property
    def live_ranks(self) -> tuple[int, ...]:
        """Every rank the tree reaches, ascending."""
        return tuple(sorted(self._caller))

    def path(self, rank: int) -> tuple[Relay, ...]:
        """The relays a call from the driver to ``rank`` goes through, the driver's child first
        and the relay that calls ``rank`` last."""
        if rank not in self._caller:
            raise RelayError(f"rank {rank} is not in the relay tree ({self._whereabouts(rank)}); "
                             f"its live ranks are {_spans(self.live_ranks)}")
        out = [self._by_id[self._caller[rank]]]
        while (up := self._parent[out[-1].id]) is not None:
            out.append(self._by_id[up])
        return tuple(reversed(out))

    @property
    def depth(self) -> int:
        """The most relays between the driver and a rank."""
        return max(r.level for r in self.driver_children)

    @cached_property
    def _node_relays(self) -> dict[str, Relay]:
        out = {}
        for r in self.relays:
            up = self._parent[r.id]
            if r.node is not None and (up is None or self._by_id[up].node is None):
                out[r.node] = r
        return out

    def node_relay(self, node: str) -> Relay:
        """The relay whose subtree is exactly ``node``'s live ranks."""
        try:
            return self._node_relays[node]
        except KeyError:
            raise RelayError(f"node {node!r} has no live rank in the relay tree; its nodes: "
                             f"{sorted(self._node_relays)}") from None

    def hosted_by(self, rank: int) -> tuple[Relay, ...]:
        """The relays that run in ``rank``'s process (lowest level first)."""
        return tuple(sorted((r for r in self.relays if r.host == rank), key=lambda r: (r.level, r.id)))

    def around(self, lost: Collection[int]) -> tuple[tuple[Relay, ...], tuple[int, ...]]:
        """How a call reaches every live rank not in ``lost`` without passing through a lost
        rank's relays: the relays whose subtrees hold no rank of ``lost`` (each called whole), and
        the ranks left to call directly (those a relay on a lost rank's path calls itself). A lost
        rank's process runs only relays on its own path (a relay runs on a rank under it), so no
        relay returned is a lost one; a call of ``fan_out`` x ``depth`` relays at most per loss
        (the abort of the survivors: ``RelayPlane.abort``)."""
        known = set(lost)
        tainted = {relay.id for r in known if r in self._caller for relay in self.path(r)}
        relays: list[Relay] = []
        direct: list[int] = []

        def visit(relay: Relay) -> None:
            if relay.id not in tainted:
                relays.append(relay)
                return
            for child in relay.relays:
                visit(self._by_id[child])
            direct.extend(r for r in relay.ranks if r not in known)

        for top in self.driver_children:
            visit(top)
        return tuple(relays), tuple(sorted(direct))

    def _whereabouts(self, rank: int) -> str:
        if rank in self.lost:
            return "it was lost"
        return f"the tree was planned for ranks 0..{len(self.nodes) - 1}"

    # -- losses ----------------------------------------------------------------------------------------------
    def reparent(self, lost_rank: int) -> RelayTree:
        """This tree once ``lost_rank``'s process is gone (a relay runs in its rank's process, so
        losing a relay is losing its rank). Nothing else moves that need not: every relay it ran
        passes to the lowest live rank under that relay (the node's next-lowest rank; for a relay
        above the nodes, when its whole node is gone, another node's under it); a relay left with
        nothing under it goes; a relay above the nodes left with one child is replaced by that
        child, which moves up (inside a node, the node relay takes its one child's children
        instead, so that the node keeps its relay). No relay gains children, so none exceeds
        ``fan_out``; depth never grows, though only a fresh :func:`plan_relays` over the
        survivors makes it the least again."""
        if lost_rank not in self._caller:
            raise RelayError(f"rank {lost_rank} cannot be lost from the relay tree ({self._whereabouts(lost_rank)}); "
                             f"pass one of its live ranks {_spans(self.live_ranks)}")
        if len(self._caller) == 1:
            raise RelayError(f"rank {lost_rank} is the relay tree's last live rank: no relay is left to reach; "
                             "plan a new tree (plan_relays) over the owners that replace it")
        shape = {r.id: _Shape(node=r.node, relays=list(r.relays), ranks=list(r.ranks)) for r in self.relays}
        top = list(self.top)
        parent = dict(self._parent)
        at: int | None = self._caller[lost_rank]
        shape[at].ranks.remove(lost_rank)
        # a relay with nothing under it goes, and so on up
        while at is not None and not shape[at].relays and not shape[at].ranks:
            up = parent.pop(at)
            (top if up is None else shape[up].relays).remove(at)
            del shape[at]
            at = up
        if at is not None and len(shape[at].relays) == 1 and not shape[at].ranks:
            (only,) = shape[at].relays
            if shape[at].node is None:  # above the nodes: the one child moves up in its place
                up = parent[at]
                siblings = top if up is None else shape[up].relays
                siblings[siblings.index(at)] = only
                parent[only] = up
                del shape[at]
            else:  # inside a node: the node's relay stays and takes its child's children
                child = shape.pop(only)
                shape[at].relays, shape[at].ranks = child.relays, child.ranks
                for grandchild in child.relays:
                    parent[grandchild] = at
        if len(top) == 1 and shape[top[0]].node is None:  # the driver calls the children of its one relay
            top = shape.pop(top[0]).relays
        return _finish(self.fan_out, self.nodes, self.lost | {lost_rank}, shape, top)


@dataclass(kw_only=True)
class _Shape:
    """A relay while a tree is built: its node and children, before levels and hosts."""

    node: str | None
    relays: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Subtree:
    """A relay waiting for a parent: its height (the ranks below it) and lowest rank."""

    height: int
    lowest: int
    relay: int


def plan_relays(nodes: Sequence[str], config: RelayConfig | None = None) -> RelayTree:
    """The relay tree over ``len(nodes)`` ranks, rank r on ``nodes[r]``.

    Depth is the least possible: with subtree heights h_i under the driver and fan-out f, a
    tree of depth D exists only if sum(f ** h_i) <= f ** (D + 1) (Kraft's inequality: the
    driver has room for f ** (D + 1) ranks at depth D + 1 and a subtree of height h takes
    f ** h of it). Grouping the shallowest subtrees into ceil(n / f) relays rounds that sum up
    to a multiple of f ** (h + 1), which f ** (D + 1) is too, so the inequality still holds
    after every grouping, and no subtree ever grows past height D."""
    config = config or RelayConfig()
    if not nodes:
        raise ConfigError("a relay tree needs at least one rank; pass every rank's node id in rank order")
    f = config.fan_out
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if not isinstance(node, str):
            raise ConfigError(f"rank {rank}'s node is {node!r}: pass node ids as strings (OwnerPool's node_id)")
        by_node.setdefault(node, []).append(rank)
    shape: dict[int, _Shape] = {}
    heads = []
    for node, ranks in by_node.items():  # in order of each node's lowest rank
        leaves = [_Subtree(1, g[0], _add(shape, _Shape(node=node, ranks=g))) for g in _even_groups(ranks, f)]
        inside = _group(shape, leaves, f, node)
        if len(inside) == 1:  # at most fan_out ranks: their one relay is the node's
            heads.append(inside[0])
        else:  # the node's own relay over its relays
            head = _Shape(node=node, relays=[s.relay for s in inside])
            heads.append(_Subtree(max(s.height for s in inside) + 1, ranks[0], _add(shape, head)))
    top = [s.relay for s in _group(shape, heads, f, None)]
    return _finish(f, tuple(nodes), frozenset(), shape, top)


def _add(shape: dict[int, _Shape], relay: _Shape) -> int:
    shape[len(shape)] = relay
    return len(shape) - 1


def _group(shape: dict[int, _Shape], items: list[_Subtree], f: int, node: str | None) -> list[_Subtree]:
    """Relays over ``items`` until at most ``f`` are left, the shallowest grouped first; a
    group of one is no relay (its subtree only counts one level higher)."""
    while len(items) > f:
        low = min(s.height for s in items)
        shallow = [s for s in items if s.height == low]
        rest = [s for s in items if s.height != low]
        for g in _even_groups(shallow, f):
            if len(g) == 1:
                rest.append(_Subtree(low + 1, g[0].lowest, g[0].relay))
            else:
                rest.append(_Subtree(low + 1, g[0].lowest, _add(shape, _Shape(node=node, relays=[s.relay for s in g]))))
        items = sorted(rest, key=lambda s: s.lowest)
    return items


def _even_groups(items: list, f: int) -> list[list]:
    """``items`` in order, cut into the fewest groups of at most ``f``, as even as possible."""
    count = -(-len(items) // f)
    size, extra = divmod(len(items), count)
    out, at = [], 0
    for i in range(count):
        n = size + (i < extra)
        out.append(items[at:at + n])
        at += n
    return out


def _finish(fan_out: int, nodes: tuple[str, ...], lost: frozenset[int], shape: dict[int, _Shape],
            top: list[int]) -> RelayTree:
    """The tree of ``shape``: each relay's level and host worked out from its children."""
    done: dict[int, tuple[int, int]] = {}  # id -> (level, lowest rank)

    def visit(i: int) -> tuple[int, int]:
        s = shape[i]
        if s.ranks:
            done[i] = (1, min(s.ranks))
        else:
            below = [visit(c) for c in s.relays]
            done[i] = (max(lv for lv, _ in below) + 1, min(low for _, low in below))
        return done[i]

    for i in top:
        visit(i)
    relays = tuple(Relay(id=i, level=done[i][0], host=done[i][1], node=shape[i].node, relays=tuple(shape[i].relays),
                         ranks=tuple(sorted(shape[i].ranks))) for i in sorted(done))
    return RelayTree(fan_out=fan_out, nodes=nodes, relays=relays, top=tuple(top), lost=lost)


def _check(tree: RelayTree) -> None:
    """Every invariant of a relay tree, or RelayError naming the one broken."""
    if len(tree.top) > tree.fan_out:
        raise RelayError(f"the driver calls {len(tree.top)} relays, over fan_out={tree.fan_out}")
    by_id = {r.id: r for r in tree.relays}
    seen: set[int] = set()
    ranks: list[int] = []

    def walk(i: int) -> list[int]:
        if i in seen or i not in by_id:
            raise RelayError(f"relay {i} is {'called twice' if i in seen else 'missing'} in the relay tree")
        seen.add(i)
        r = by_id[i]
        if r.children > tree.fan_out:
            raise RelayError(f"relay {i} calls {r.children} children, over fan_out={tree.fan_out}")
        under = list(r.ranks) + [x for c in r.relays for x in walk(c)]
        if r.relays and r.level != 1 + max(by_id[c].level for c in r.relays):
            raise RelayError(f"relay {i} has level {r.level}, not one above its highest child")
        if r.host != min(under):
            raise RelayError(f"relay {i} runs on rank {r.host}, not the lowest rank under it ({min(under)})")
        if r.node is not None and any(tree.nodes[x] != r.node for x in under):
            raise RelayError(f"relay {i} of node {r.node!r} reaches ranks of other nodes")
        ranks.extend(r.ranks)
        return under

    for i in tree.top:
        walk(i)
    if len(seen) != len(tree.relays):
        raise RelayError(f"relays {sorted(set(by_id) - seen)} are not reached from the driver")
    expected = [r for r in range(len(tree.nodes)) if r not in tree.lost]
    if sorted(ranks) != expected:
        raise RelayError(f"the relays reach ranks {_spans(sorted(ranks))}, not the live ranks {_spans(expected)}: "
                         "every live rank is called by exactly one relay")


def _spans(ranks: Sequence[int]) -> str:
    """Ranks as short text: ``0-7, 9, 12-15``."""
    parts: list[list[int]] = []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"

