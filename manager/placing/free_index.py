"""The scheduler's index of the map: GPUs by free memory, and nodes ranked for multi-GPU requests.

:class:`FreeIndex` is what :func:`gpumgr.manager.placing.scheduler.place` reads (see that module for how):
schedulable GPUs of ready nodes ordered by free memory, each node's GPUs, and, per ``k`` asked for,
a :class:`Ranking` of the nodes for requests of ``k`` GPUs. The map's owner (the ledger) tells it of
every change; it brings its order and rankings up to date lazily, when they are read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

#: Changes of nodes logged for the rankings before each ranking takes its share (bounds the log's memory).
CHANGES_LOGGED = 4096


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
    #: bytes held for a gang that waited long enough: nothing else may take them (see manager/model/gangs.py)
    gang_hold: int = 0
    #: its node runs MPS: compute shares may be placed here (see :mod:`gpumgr.manager.placing.shares`)
    mps: bool = False
    #: the sum of its live grants' compute shares (percent of its SMs; at most 100)
    compute_shares: int = 0
    #: bytes bursters use above their grants here (their heartbeats say): taken, though no grant reserves them
    burst: int = 0

    @property
    def free(self) -> int:
        """Schedulable free memory: what no grant, burster, stranger, safety margin or waiting gang holds."""
        free = self.total - self.reserved - self.unmanaged - self.headroom - self.gang_hold - self.burst
        return free if free > 0 else 0  # not max(): this runs several times per placement


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
