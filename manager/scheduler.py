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

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from sortedcontainers import SortedList

from gpumgr.wire.constraints import NO_CONSTRAINTS, Constraints
from gpumgr.wire.errors import InvalidRequest, NoAgents, NoFit
from gpumgr.wire.units import format_bytes

#: How a set of GPUs is joined, best first: the weakest link between any two of them. ``groups[i]``
#: of a slot is its group at ``LINKS[i]``; two GPUs sharing none are joined only across sockets.
LINKS = ("nvlink", "pcie_switch", "socket")
ACROSS = "system"
#: Changes of nodes logged for the rankings before each ranking takes its share (bounds the log's memory).
CHANGES_LOGGED = 4096
#: How many more nodes a multi-GPU request looks at for a better-connected set than the first node gives.
TOPOLOGY_LOOKAHEAD = 8


class Placement(StrEnum):
    """How to choose among GPUs that fit."""

    SPREAD = "spread"
    BINPACK = "binpack"


#: Read at every placement: an enum member as a global costs a tenth of ``Placement.SPREAD``.
SPREAD = Placement.SPREAD


@dataclass(eq=False)
class GpuSlot:
    """One GPU as the scheduler sees it: where it is and how much can still be granted on it."""

    uuid: str
    node: str
    index: int
    total: int
    reserved: int = 0
    unmanaged: int = 0
    headroom: int = 0
    #: the model's name as NVML gives it
    name: str = ""
    compute_capability: str = ""
    #: its node's labels (the node's own dict, shared by its GPUs)
    labels: dict[str, str] = field(default_factory=dict)
    #: its NVLink island, PCIe switch and CPU socket ids (see ``LINKS``); None: its node reported no topology
    groups: tuple[int, int, int] | None = None

    @property
    def free(self) -> int:
        """Schedulable free memory: what no grant, no stranger and no safety margin holds."""
        free = self.total - self.reserved - self.unmanaged - self.headroom
        return free if free > 0 else 0  # not max(): this runs several times per placement


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


@dataclass
class FreeIndex:
    """Schedulable GPUs of ready nodes, ordered by free memory, plus each node's GPUs and rankings.

    The owner (the cluster map) must call :meth:`update` whenever a slot's free memory changes and
    :meth:`add`/:meth:`discard` when a node becomes ready or down; the scheduler only reads it,
    apart from bringing the per-``k`` rankings of the nodes marked stale up to date.

    The order by free memory (:attr:`by_free`) is brought up to date when it is read: :meth:`update`
    only notes the slot. A grant and its release on the same GPUs between two reads (every
    multi-GPU placement, which reads the rankings, not this order) then cost no re-sort at all.
    """

    _by_free: SortedList = field(default_factory=SortedList)
    by_node: dict[str, list[GpuSlot]] = field(default_factory=dict)
    _keys: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: (k, spread) -> the ranking for such requests of k GPUs (kept from the first such request on)
    _ranks: dict[tuple[int, bool], Ranking] = field(default_factory=dict)
    #: slots whose free memory may have changed since :attr:`by_free` last placed them
    _moved: dict[str, GpuSlot] = field(default_factory=dict)
    #: nodes whose GPUs changed, in order, while some ranking exists: each ranking reads on from its own
    #: ``seen`` (one append per change, however many rankings there are)
    _changed: list[str] = field(default_factory=list)
    #: node -> :meth:`sorted_frees`, while no change of it has been noted since
    _frees: dict[str, list[int]] = field(default_factory=dict)

    @property
    def by_free(self) -> SortedList:
        """``((free, uuid), slot)`` of every schedulable GPU, ascending, up to date."""
        if self._moved:
            self._resort()
        return self._by_free

    def add(self, slot: GpuSlot) -> None:
        """Make ``slot`` schedulable."""
        key = (slot.free, slot.uuid)
        self._keys[slot.uuid] = key
        self._moved.pop(slot.uuid, None)  # its key is its free memory now
        self._by_free.add((key, slot))
        self.by_node.setdefault(slot.node, []).append(slot)
        self._touch(slot.node)

    def discard(self, slot: GpuSlot) -> None:
        """Take ``slot`` out (its node went down); a no-op when it is not in."""
        key = self._keys.pop(slot.uuid, None)
        if key is None:
            return
        self._moved.pop(slot.uuid, None)
        self._by_free.remove((key, slot))
        slots = self.by_node.get(slot.node, [])
        slots.remove(slot)
        if not slots:
            self.by_node.pop(slot.node, None)
        self._touch(slot.node)

    def update(self, slot: GpuSlot) -> None:
        """``slot``'s free memory changed: re-sort it at the next read, re-rank its node at the next request."""
        if slot.uuid not in self._keys:
            return
        self._moved[slot.uuid] = slot
        if self._ranks:
            self._touch(slot.node)

    def _resort(self) -> None:
        by_free, keys = self._by_free, self._keys
        for uuid, slot in self._moved.items():
            old = keys[uuid]  # add() and discard() take a slot off this list
            free = slot.free
            if old[0] != free:
                by_free.remove((old, slot))
                key = keys[uuid] = (free, uuid)
                by_free.add((key, slot))
        self._moved.clear()

    def __contains__(self, slot: GpuSlot) -> bool:
        return slot.uuid in self._keys

    def largest_free(self) -> int:
        """The most schedulable free memory on any one ready GPU (0 with none)."""
        return self.by_free[-1][0][0] if self.by_free else 0

    def ranking(self, count: int, spread: bool) -> SortedList:
        """The nodes ranked for ``spread`` (or binpack) requests of ``count`` (≥ 2) GPUs, brought up to date."""
        ranking = self._ranks.get((count, spread))
        changed = self._changed
        if ranking is None:
            ranking = self._ranks[count, spread] = Ranking(count, spread, seen=len(changed))
            ranking.stale.update(self.by_node)
        if ranking.seen < len(changed):
            ranking.stale.update(changed[ranking.seen:])
            ranking.seen = len(changed)
            if all(r.seen == len(changed) for r in self._ranks.values()):  # everyone has read it: start again
                changed.clear()
                for each in self._ranks.values():
                    each.seen = 0
        if ranking.stale:
            ranking.refresh(self.sorted_frees)
        return ranking.keys

    def ranks_of(self, count: int, spread: bool) -> Ranking:
        """The ranking itself (after :meth:`ranking` brought it up to date)."""
        return self._ranks[count, spread]

    def sorted_frees(self, node: str) -> list[int]:
        """``node``'s schedulable GPUs' free memories, ascending (empty: not in the index); do not change it.

        Computed once per change of the node and shared by every ranking that re-ranks it.
        """
        frees = self._frees.get(node)
        if frees is None:
            frees = self._frees[node] = sorted(s.free for s in self.by_node.get(node, ()))
        return frees

    def _touch(self, node: str) -> None:
        if not self._ranks:  # no ranking reads the log or the free memories (they exist once one does)
            return
        self._frees.pop(node, None)
        changed = self._changed
        changed.append(node)
        if len(changed) > CHANGES_LOGGED:  # a ranking nobody asks for lags: hand every one its share now
            for ranking in self._ranks.values():
                ranking.stale.update(changed[ranking.seen:])
                ranking.seen = 0
            changed.clear()


@dataclass
class Ranking:
    """The nodes with at least ``count`` GPUs, ranked for spread or for binpack requests of that many.

    For spread, one key per node: ``(sum of its count largest free, its whole free, node)``. For
    binpack, one key per window of ``count`` consecutive GPUs of a node sorted by free memory:
    ``(sum of the window, whole free, smallest free in the window, node)``. For a request of ``m``
    bytes a node's best binpack choice is its first window whose smallest GPU holds ``m``, and any
    later window of it sums to at least as much, so the lowest key whose smallest free is at least
    ``m`` names the best node.
    """

    count: int
    spread: bool
    keys: SortedList = field(default_factory=SortedList)
    #: node -> its keys in ``keys``
    of_node: dict[str, set[tuple[Any, ...]]] = field(default_factory=dict)
    #: nodes whose GPUs changed since their keys were computed
    stale: set[str] = field(default_factory=set)
    #: how much of the index's log of changed nodes this ranking has taken into :attr:`stale`
    seen: int = 0
    #: binpack: the same keys by the class of their smallest free memory (``size_class``), so a lookup
    #: skips only windows of its own class whose smallest GPU is too small, not every one below the answer
    by_class: dict[int, SortedList] = field(default_factory=dict)
    #: node -> its GPUs' free memories, sorted, when its keys were computed
    frees_of: dict[str, list[int]] = field(default_factory=dict)

    def refresh(self, sorted_frees: Callable[[str], list[int]]) -> None:
        """Recompute the keys of every stale node, from its GPUs' free memories (``FreeIndex.sorted_frees``)."""
        for node in self.stale:
            frees = sorted_frees(node)
            if frees == self.frees_of.get(node):  # back as it was (a grant and its release): same keys
                continue
            self.frees_of[node] = frees
            before = self.of_node.pop(node, set())
            after = self._keys_of(node, frees)
            for key in before - after:
                self.keys.remove(key)
                if not self.spread:
                    self._unclass(key)
            for key in after - before:
                self.keys.add(key)
                if not self.spread:
                    self.by_class.setdefault(size_class(key[2]), SortedList()).add(key)
            if after:
                self.of_node[node] = after
        self.stale.clear()

    def lowest_fitting(self, memory: int) -> list[tuple[Any, ...]]:
        """Binpack: per class of smallest free memory, the lowest key whose window holds ``memory``, lowest first.

        The first is the lowest key of all that fits; the others are the best of their classes.
        """
        own, found = size_class(memory), []
        for cls, keys in self.by_class.items():
            if cls > own:  # every window here holds memory: its lowest key is its first (a class is never empty)
                found.append(keys._lists[0][0])  # keys[0] without SortedList's indexing call (a dozen a request)
            elif cls == own:
                first = next((key for key in keys.irange(minimum=(self.count * memory,)) if key[2] >= memory), None)
                if first is not None:
                    found.append(first)
        found.sort()
        return found

    def _unclass(self, key: tuple[Any, ...]) -> None:
        cls = size_class(key[2])
        keys = self.by_class[cls]
        keys.remove(key)
        if not keys:
            del self.by_class[cls]

    def _keys_of(self, node: str, frees: list[int]) -> set[tuple[Any, ...]]:
        """The keys of a node whose GPUs' free memories, sorted, are ``frees``."""
        k = self.count
        if len(frees) < k:
            return set()
        whole = sum(frees)
        if self.spread:
            return {(sum(frees[-k:]), whole, node)}
        windows, running = set(), sum(frees[:k])
        for p in range(len(frees) - k + 1):
            if p:
                running += frees[p + k - 1] - frees[p - 1]
            windows.add((running, whole, frees[p], node))
        return windows


def size_class(size: int) -> int:
    """A class of sizes, monotone in ``size``: four per power of two (its leading three bits)."""
    bits = size.bit_length()
    return bits * 4 + ((size >> (bits - 3)) & 3) if bits >= 3 else size


def place(index: FreeIndex, request: Request) -> list[GpuSlot]:
    """Return the GPUs that should hold ``request``, best first; raise NoFit, NoAgents or InvalidRequest.

    Pure: reads ``index`` only (bringing its node rankings up to date). The caller reserves the
    memory on the returned slots.
    """
    if not index.by_node:
        raise NoAgents("no agent is ready to take containers; start one with 'gpumgr agent'")
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


def first_at_least(entries: SortedList, key: Any) -> Any:
    """The first of ``entries`` not below ``key`` (None: there is none), as ``next(entries.irange(key))``.

    Two bisections on the list's own sorted sublists: ``irange`` builds an iterator and a chain of
    generators for the same answer (three quarters of a binpack placement's time), and ``bisect``
    with indexing makes SortedList keep a position index that every later add and remove pays for.
    ``_maxes`` and ``_lists`` are SortedList's documented implementation (its "Implementation Details").
    """
    maxes = entries._maxes
    pos = bisect_left(maxes, key)
    if pos == len(maxes):
        return None
    sublist = entries._lists[pos]
    return sublist[bisect_left(sublist, key)]


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
