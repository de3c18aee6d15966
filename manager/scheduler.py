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
one set insertion per ranking for them.

Ties between nodes go to the node with the most free memory in all (spread) or the least (binpack),
so 200 two-GPU requests on empty nodes land on 200 nodes, not four to a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sortedcontainers import SortedList

from gpumgr.wire.errors import InvalidRequest, NoAgents, NoFit
from gpumgr.wire.units import format_bytes


class Placement(StrEnum):
    """How to choose among GPUs that fit."""

    SPREAD = "spread"
    BINPACK = "binpack"


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

    @property
    def free(self) -> int:
        """Schedulable free memory: what no grant, no stranger and no safety margin holds."""
        return max(0, self.total - self.reserved - self.unmanaged - self.headroom)


@dataclass(frozen=True)
class Request:
    """What a placement needs: ``count`` GPUs on one node, each with ``memory`` schedulable bytes."""

    memory: int
    count: int = 1
    node: str | None = None
    placement: Placement = Placement.SPREAD


@dataclass
class FreeIndex:
    """Schedulable GPUs of ready nodes, ordered by free memory, plus each node's GPUs and rankings.

    The owner (the cluster map) must call :meth:`update` whenever a slot's free memory changes and
    :meth:`add`/:meth:`discard` when a node becomes ready or down; the scheduler only reads it,
    apart from bringing the per-``k`` rankings of the nodes marked stale up to date.
    """

    by_free: SortedList = field(default_factory=SortedList)
    by_node: dict[str, list[GpuSlot]] = field(default_factory=dict)
    _keys: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: (k, spread) -> the ranking for such requests of k GPUs (kept from the first such request on)
    _ranks: dict[tuple[int, bool], Ranking] = field(default_factory=dict)

    def add(self, slot: GpuSlot) -> None:
        """Make ``slot`` schedulable."""
        key = (slot.free, slot.uuid)
        self._keys[slot.uuid] = key
        self.by_free.add((key, slot))
        self.by_node.setdefault(slot.node, []).append(slot)
        self._touch(slot.node)

    def discard(self, slot: GpuSlot) -> None:
        """Take ``slot`` out (its node went down); a no-op when it is not in."""
        key = self._keys.pop(slot.uuid, None)
        if key is None:
            return
        self.by_free.remove((key, slot))
        slots = self.by_node.get(slot.node, [])
        slots.remove(slot)
        if not slots:
            self.by_node.pop(slot.node, None)
        self._touch(slot.node)

    def update(self, slot: GpuSlot) -> None:
        """Re-sort ``slot`` after its free memory changed."""
        old = self._keys.get(slot.uuid)
        if old is None or old[0] == slot.free:
            return
        self.by_free.remove((old, slot))
        key = (slot.free, slot.uuid)
        self._keys[slot.uuid] = key
        self.by_free.add((key, slot))
        self._touch(slot.node)

    def __contains__(self, slot: GpuSlot) -> bool:
        return slot.uuid in self._keys

    def largest_free(self) -> int:
        """The most schedulable free memory on any one ready GPU (0 with none)."""
        return self.by_free[-1][0][0] if self.by_free else 0

    def ranking(self, count: int, spread: bool) -> SortedList:
        """The nodes ranked for ``spread`` (or binpack) requests of ``count`` (≥ 2) GPUs, brought up to date."""
        ranking = self._ranks.get((count, spread))
        if ranking is None:
            ranking = self._ranks[count, spread] = Ranking(count, spread)
            ranking.stale.update(self.by_node)
        if ranking.stale:
            ranking.refresh(self.by_node)
        return ranking.keys

    def _touch(self, node: str) -> None:
        for ranking in self._ranks.values():
            ranking.stale.add(node)


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

    def refresh(self, by_node: dict[str, list[GpuSlot]]) -> None:
        """Recompute the keys of every stale node."""
        for node in self.stale:
            before = self.of_node.pop(node, set())
            after = self._keys_of(node, by_node.get(node, []))
            for key in before - after:
                self.keys.remove(key)
            for key in after - before:
                self.keys.add(key)
            if after:
                self.of_node[node] = after
        self.stale.clear()

    def _keys_of(self, node: str, slots: list[GpuSlot]) -> set[tuple[Any, ...]]:
        k = self.count
        if len(slots) < k:
            return set()
        frees = sorted(s.free for s in slots)
        whole = sum(frees)
        if self.spread:
            return {(sum(frees[-k:]), whole, node)}
        windows, running = set(), sum(frees[:k])
        for p in range(len(frees) - k + 1):
            if p:
                running += frees[p + k - 1] - frees[p - 1]
            windows.add((running, whole, frees[p], node))
        return windows


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
        return _place_one(index, request)
    many = _spread_many if request.placement is Placement.SPREAD else _binpack_many
    chosen = many(index, request)
    if chosen is None:
        raise _no_fit(request, index.largest_free())
    return chosen


def _place_one(index: FreeIndex, request: Request) -> list[GpuSlot]:
    entries = index.by_free
    if request.placement is Placement.SPREAD:
        (free, _), slot = entries[-1]
        if free >= request.memory:
            return [slot]
    else:
        # irange, not bisect + indexing: indexing makes SortedList keep a position index that
        # every later add and remove then pays to update
        for _, slot in entries.irange(minimum=((request.memory, ""),)):
            return [slot]
    raise _no_fit(request, index.largest_free())


def _place_on_node(index: FreeIndex, request: Request) -> list[GpuSlot]:
    slots = index.by_node.get(request.node or "")
    if slots is None:
        raise NoFit(f"node {request.node!r} is not ready or has no GPUs", code="no_fit")
    chosen = _best_on_node(slots, request, request.placement is Placement.SPREAD)
    if chosen is None:
        raise _no_fit(request, max(s.free for s in slots))
    return chosen


def _spread_many(index: FreeIndex, request: Request) -> list[GpuSlot] | None:
    """The node with the largest sum of ``count`` largest free memories among those where they all fit."""
    k, memory = request.count, request.memory
    floor = k * memory  # a node whose k GPUs all fit has at least this much on them
    for total, _, node in reversed(index.ranking(k, True)):
        if total < floor:
            return None
        chosen = _best_on_node(index.by_node[node], request, True)
        if chosen is not None:
            return chosen
    return None


def _binpack_many(index: FreeIndex, request: Request) -> list[GpuSlot] | None:
    """The node whose ``count`` smallest fitting GPUs have the least free memory in all."""
    k, memory = request.count, request.memory
    for _, _, smallest, node in index.ranking(k, False).irange(minimum=(k * memory,)):
        if smallest >= memory:
            return _best_on_node(index.by_node[node], request, False)
    return None


def _best_on_node(slots: list[GpuSlot], request: Request, spread: bool) -> list[GpuSlot] | None:
    fitting = [(free, s.uuid, s) for s in slots if (free := s.free) >= request.memory]
    if len(fitting) < request.count:
        return None
    fitting.sort(key=lambda item: item[:2], reverse=spread)
    return [slot for _, _, slot in fitting[: request.count]]


def _no_fit(request: Request, largest: int) -> NoFit:
    where = f" on node {request.node!r}" if request.node else ""
    many = f" on each of {request.count} GPUs of one node" if request.count > 1 else ""
    return NoFit(
        f"no GPU{where} can hold {format_bytes(request.memory)}{many}; "
        f"the largest schedulable free memory on one GPU is {format_bytes(largest)} ({largest} bytes)"
    )
