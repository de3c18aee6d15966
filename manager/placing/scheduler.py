"""Choosing GPUs for a request: a pure function of the map, with no I/O and no mutation of the map.

GPUs on ready nodes sit in a :class:`FreeIndex` sorted by schedulable free memory, so the common
request (one GPU, any node) is a binary search: ``spread`` takes the GPU with the most free memory,
``binpack`` the one with the least free memory that still fits.

A request for ``k`` GPUs on any node must not scan every node (a map of 1,000 nodes held the lock
for 12 ms doing so). The index also keeps, per ``k``, the nodes sorted by the sum of their ``k``
largest free memories: ``spread`` walks it from the top and the first node whose ``k``-th largest
GPU fits is the best (a node's best spread choice is its ``k`` largest GPUs or nothing), stopping
once a sum is below ``k × memory``. ``binpack`` looks up windows of ``k`` GPUs (see
:class:`Ranking`). Rankings exist only for the ``k`` that requests have asked for, and nodes whose
GPUs changed are re-ranked lazily, on the next request for ``k`` GPUs, so a single-GPU grant pays
one append to a log of changed nodes that every ranking reads on from its own mark; a changed node's
sorted free memories are computed once for all the rankings that re-rank it.

Ties between nodes go to the node with the most free memory in all (spread) or the least (binpack),
so 200 two-GPU requests on empty nodes land on 200 nodes, not four to a node.

**Constraints** (:mod:`gpumgr.wire.constraints`) filter only when a request has some: a constrained
single-GPU request walks the GPUs that fit by memory, best first, and takes the first allowed one; a
constrained multi-GPU request walks the spread ranking (an upper bound of what the allowed GPUs of a
node can give) until no later node can beat the best found, or, for binpack, looks at every node.

**Topology**: GPUs whose agent reported their links carry ``groups``, the ids of their NVLink island,
PCIe switch and CPU socket. On such a node a request for ``k`` ≥ 2 GPUs takes, among the GPUs that
fit, the best-connected ``k`` (all in one NVLink island, else under one switch, else on one socket),
and among equally connected sets the best by the placement's rule. When the first node's best set is
not all NVLink, up to ``TOPOLOGY_LOOKAHEAD`` further nodes that fit are looked at for a better-connected
set, so a request is not given a set across sockets while the next node has an island free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from gpumgr.manager.placing.free_index import FreeIndex as FreeIndex
from gpumgr.manager.placing.free_index import GpuSlot as GpuSlot
from gpumgr.manager.placing.free_index import first_at_least
from gpumgr.wire.constraints import NO_CONSTRAINTS, Constraints
from gpumgr.wire.errors import NO_AGENTS, InvalidRequest, NoAgents, NoFit
from gpumgr.wire.units import format_bytes

#: How a set of GPUs is joined, best first: the weakest link between any two of them. ``groups[i]``
#: of a slot is its group at ``LINKS[i]``; two GPUs sharing none are joined only across sockets.
LINKS = ("nvlink", "pcie_switch", "socket")
ACROSS = "system"
#: How many more nodes a multi-GPU request looks at for a better-connected set than the first node gives.
TOPOLOGY_LOOKAHEAD = 8


class Placement(StrEnum):
    """How to choose among GPUs that fit."""

    SPREAD = "spread"
    BINPACK = "binpack"


#: Read at every placement: an enum member as a global costs a tenth of ``Placement.SPREAD``.
SPREAD = Placement.SPREAD


class Request(NamedTuple):
    """What a placement needs: ``count`` GPUs on one node, each with ``memory`` schedulable bytes.

    A tuple, not a frozen dataclass: one is made per placement, and a frozen dataclass's ``__init__``
    costs a Python call per field.
    """

    memory: int
    count: int = 1  # type: ignore[assignment]  # shadows tuple.count, as a field of a NamedTuple may
    node: str | None = None
    placement: Placement = Placement.SPREAD
    constraints: Constraints = NO_CONSTRAINTS
    #: choose the best-connected set on nodes that reported their topology (off: by free memory alone)
    topology: bool = True


def place(index: FreeIndex, request: Request) -> list[GpuSlot]:
    """Return the GPUs that should hold ``request``, best first; raise NoFit, NoAgents or InvalidRequest.

    Pure: reads ``index`` only (bringing its node rankings up to date). The caller reserves the
    memory on the returned slots.
    """
    if not index.by_node:
        raise NoAgents(NO_AGENTS)
    if request.count < 1:
        raise InvalidRequest("gpus must be at least 1")
    if request.node is not None:
        return _place_on_node(index, request)
    if request.count == 1:
        if request.constraints.items:
            return _place_one_allowed(index, request)
        return _place_one(index, request)
    if request.constraints.items:
        chosen = _many_allowed(index, request)
    else:
        many = _spread_many if request.placement is SPREAD else _binpack_many
        chosen = many(index, request)
    if chosen is None:
        raise _no_fit(request, index.largest_free())
    return chosen


def link_of(slots: list[GpuSlot]) -> str | None:
    """The weakest link joining ``slots`` (a name of ``LINKS`` or ``ACROSS``); None for one GPU or no topology."""
    if len(slots) < 2 or any(s.groups is None for s in slots):
        return None
    for level, name in enumerate(LINKS):
        if len({s.groups[level] for s in slots if s.groups is not None}) == 1:
            return name
    return ACROSS


def _place_one(index: FreeIndex, request: Request) -> list[GpuSlot]:
    if index._moved:  # what the by_free property does, without its call on every placement
        index._resort()
    entries = index._by_free
    if request.placement is SPREAD:
        (free, _), slot = entries[-1]
        if free >= request.memory:
            return [slot]
    else:
        found = first_at_least(entries, ((request.memory, ""),))
        if found is not None:
            return [found[1]]
    raise _no_fit(request, index.largest_free())


def _place_one_allowed(index: FreeIndex, request: Request) -> list[GpuSlot]:
    """The best GPU that fits and that the constraints allow: only GPUs that fit by memory are looked at."""
    fitting = index.by_free.irange(minimum=((request.memory, ""),), reverse=request.placement is SPREAD)
    allows = request.constraints.allows
    for _, slot in fitting:
        if allows(slot):
            return [slot]
    raise _no_fit(request, index.largest_free())


def _place_on_node(index: FreeIndex, request: Request) -> list[GpuSlot]:
    slots = index.by_node.get(request.node or "")
    if slots is None:
        raise NoFit(f"node {request.node!r} is not ready or has no GPUs", code="no_fit")
    chosen = _best_on_node(slots, request, request.placement is SPREAD)
    if chosen is None:
        raise _no_fit(request, max(s.free for s in slots))
    return chosen[0]


def _spread_many(index: FreeIndex, request: Request) -> list[GpuSlot] | None:
    """The node with the largest sum of ``count`` largest free memories among those where they all fit."""
    k, memory = request.count, request.memory
    floor = k * memory  # a node whose k GPUs all fit has at least this much on them
    best = _Best(request)
    for total, _, node in reversed(index.ranking(k, True)):
        if total < floor:
            break
        if best.offer(_best_on_node(index.by_node[node], request, True)):
            break
    return best.slots


def _binpack_many(index: FreeIndex, request: Request) -> list[GpuSlot] | None:
    """The node whose ``count`` smallest fitting GPUs have the least free memory in all.

    When that node's set is not joined by NVLink, the best nodes of the other classes of smallest
    free memory (``Ranking.lowest_fitting``), in order, are looked at for one that is.
    """
    index.ranking(request.count, False)
    candidates = index.ranks_of(request.count, False).lowest_fitting(request.memory)
    best, seen = _Best(request), set()
    for key in candidates:
        node = key[3]
        if node not in seen:
            seen.add(node)
            if best.offer(_best_on_node(index.by_node[node], request, False)):
                break
    return best.slots


def _many_allowed(index: FreeIndex, request: Request) -> list[GpuSlot] | None:
    """A constrained multi-GPU request: its node among those whose allowed GPUs fit.

    The best is the best-connected set, then the policy's sum. The nodes are walked in the order of
    the unconstrained ranking, whose sums bound what a node's allowed GPUs can give (from above for
    spread, from below for binpack), until no further node can beat the best found; a set not joined
    by NVLink is kept only while ``TOPOLOGY_LOOKAHEAD`` further nodes offer nothing better joined.
    """
    spread, k = request.placement is SPREAD, request.count
    if spread:
        floor = k * request.memory
        bounds: Iterable[tuple[int, str]] = ((total, node) for total, _, node in reversed(index.ranking(k, True))
                                             if total >= floor)
    else:
        bounds = ((total, node) for total, _, smallest, node in index.ranking(k, False).irange(
            minimum=(k * request.memory,)) if smallest >= request.memory)
    best: tuple[tuple[int, int], list[GpuSlot]] | None = None
    seen: set[str] = set()
    after = 0  # nodes looked at since the first set was found
    for bound, node in bounds:
        if node in seen:  # binpack: a later window of a node already looked at
            continue
        seen.add(node)
        if best is not None:
            after += 1
            beaten = bound <= -best[0][1] if spread else bound >= best[0][1]
            settled = best[0][0] == 0 or best[1][0].groups is None or not request.topology
            if beaten and (settled or after > TOPOLOGY_LOOKAHEAD):
                break
        option = _best_on_node(index.by_node[node], request, spread)
        if option is not None:
            total = sum(s.free for s in option[0])
            key = (option[1], -total if spread else total)
            if best is None or key < best[0]:
                best = (key, option[0])
    return best[1] if best is not None else None


@dataclass
class _Best:
    """The best set seen over nodes in the ranking's order: the first node's, unless a node within
    ``TOPOLOGY_LOOKAHEAD`` of it gives a better-connected set (then the first such)."""

    request: Request
    slots: list[GpuSlot] | None = None
    level: int = len(LINKS)
    looked: int = 0

    def offer(self, option: tuple[list[GpuSlot], int] | None) -> bool:
        """Take ``option`` if better connected than what is held; True when no further node need be looked at."""
        if option is None:
            return False
        slots, level = option
        if self.slots is None or level < self.level:
            self.slots, self.level = slots, level
        self.looked += 1
        return self.level == 0 or not self.request.topology or slots[0].groups is None \
            or self.looked > TOPOLOGY_LOOKAHEAD


def _best_on_node(slots: list[GpuSlot], request: Request, spread: bool) -> tuple[list[GpuSlot], int] | None:
    """The node's best ``count`` GPUs that fit (and that the constraints allow), with the link level joining them.

    Level 0 is NVLink (``LINKS``); ``len(LINKS)`` means across sockets, or no topology known.
    """
    memory, allows = request.memory, request.constraints.allows if request.constraints.items else None
    fitting = [(free, s.uuid, s) for s in slots if (free := s.free) >= memory and (allows is None or allows(s))]
    if len(fitting) < request.count:
        return None
    if request.count > 1 and request.topology and slots[0].groups is not None:
        return _best_connected(fitting, request.count, spread)
    fitting.sort(reverse=spread)  # by (free, uuid): uuids are unique, so the slots are never compared
    return [slot for _, _, slot in fitting[: request.count]], len(LINKS)


def _best_connected(fitting: list[tuple[int, str, GpuSlot]], count: int,
                    spread: bool) -> tuple[list[GpuSlot], int]:
    """Among ``fitting``, ``count`` GPUs in the tightest group that holds as many, best by the policy within."""
    fitting.sort(reverse=spread)  # by (free, uuid): uuids are unique, so the slots are never compared
    for level in range(len(LINKS)):
        groups: dict[int, list[tuple[int, str, GpuSlot]]] = {}
        for item in fitting:
            groups.setdefault(item[2].groups[level], []).append(item)  # type: ignore[index]
        best: list[tuple[int, str, GpuSlot]] | None = None
        for members in groups.values():
            if len(members) >= count:
                pick = members[:count]
                if best is None or _better(pick, best, spread):
                    best = pick
        if best is not None:
            return [slot for _, _, slot in best], level
    return [slot for _, _, slot in fitting[:count]], len(LINKS)


def _better(pick: list[tuple[int, str, GpuSlot]], than: list[tuple[int, str, GpuSlot]], spread: bool) -> bool:
    mine, theirs = sum(i[0] for i in pick), sum(i[0] for i in than)
    if mine != theirs:
        return mine > theirs if spread else mine < theirs
    return [i[1] for i in pick] < [i[1] for i in than]


def _no_fit(request: Request, largest: int) -> NoFit:
    where = f" on node {request.node!r}" if request.node else ""
    many = f" on each of {request.count} GPUs of one node" if request.count > 1 else ""
    return NoFit(
        f"no GPU{where} can hold {format_bytes(request.memory)}{many}; "
        f"the largest schedulable free memory on one GPU is {format_bytes(largest)} ({largest} bytes)"
    )
