"""Choosing GPUs for a request: a pure function of the map, with no I/O and no mutation.

GPUs on ready nodes sit in a :class:`FreeIndex` sorted by schedulable free memory, so the common
request (one GPU, any node) is a binary search: ``spread`` takes the GPU with the most free memory,
``binpack`` the one with the least free memory that still fits. Requests for several GPUs or for
one node look at each candidate node's GPUs in turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

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
    """Schedulable GPUs of ready nodes, ordered by free memory, plus each node's GPUs.

    The owner (the cluster map) must call :meth:`update` whenever a slot's free memory changes and
    :meth:`add`/:meth:`discard` when a node becomes ready or down; the scheduler only reads it.
    """

    by_free: SortedList = field(default_factory=SortedList)
    by_node: dict[str, list[GpuSlot]] = field(default_factory=dict)
    _keys: dict[str, tuple[int, str]] = field(default_factory=dict)

    def add(self, slot: GpuSlot) -> None:
        """Make ``slot`` schedulable."""
        key = (slot.free, slot.uuid)
        self._keys[slot.uuid] = key
        self.by_free.add((key, slot))
        self.by_node.setdefault(slot.node, []).append(slot)

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

    def update(self, slot: GpuSlot) -> None:
        """Re-sort ``slot`` after its free memory changed."""
        old = self._keys.get(slot.uuid)
        if old is None or old[0] == slot.free:
            return
        self.by_free.remove((old, slot))
        key = (slot.free, slot.uuid)
        self._keys[slot.uuid] = key
        self.by_free.add((key, slot))

    def __contains__(self, slot: GpuSlot) -> bool:
        return slot.uuid in self._keys

    def largest_free(self) -> int:
        """The most schedulable free memory on any one ready GPU (0 with none)."""
        return self.by_free[-1][0][0] if self.by_free else 0


def place(index: FreeIndex, request: Request) -> list[GpuSlot]:
    """Return the GPUs that should hold ``request``, best first; raise NoFit, NoAgents or InvalidRequest.

    Pure: reads ``index`` only. The caller reserves the memory on the returned slots.
    """
    if not index.by_node:
        raise NoAgents("no agent is ready to take containers; start one with 'gpumgr agent'")
    if request.count < 1:
        raise InvalidRequest("gpus must be at least 1")
    if request.node is None and request.count == 1:
        return _place_one(index, request)
    return _place_on_nodes(index, request)


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


def _place_on_nodes(index: FreeIndex, request: Request) -> list[GpuSlot]:
    if request.node is not None:
        if request.node not in index.by_node:
            raise NoFit(f"node {request.node!r} is not ready or has no GPUs", code="no_fit")
        nodes: Iterable[list[GpuSlot]] = [index.by_node[request.node]]
    else:
        nodes = index.by_node.values()
    spread = request.placement is Placement.SPREAD
    best: list[tuple[int, str, GpuSlot]] | None = None
    best_score = 0
    for slots in nodes:
        chosen = _best_on_node(slots, request, spread)
        if chosen is None:
            continue
        score = sum(free for free, _, _ in chosen)
        if best is None or (score > best_score if spread else score < best_score):
            best, best_score = chosen, score
    if best is None:
        largest = max((s.free for s in nodes_of(index, request.node)), default=0)
        raise _no_fit(request, largest)
    return [slot for _, _, slot in best]


def nodes_of(index: FreeIndex, node: str | None) -> list[GpuSlot]:
    """The schedulable GPUs of ``node``, or of every node."""
    if node is not None:
        return list(index.by_node.get(node, []))
    return [slot for slots in index.by_node.values() for slot in slots]


def _best_on_node(slots: list[GpuSlot], request: Request, spread: bool) -> list[tuple[int, str, GpuSlot]] | None:
    fitting = [(free, s.uuid, s) for s in slots if (free := s.free) >= request.memory]
    if len(fitting) < request.count:
        return None
    fitting.sort(key=lambda item: item[:2], reverse=spread)
    return fitting[: request.count]


def _no_fit(request: Request, largest: int) -> NoFit:
    where = f" on node {request.node!r}" if request.node else ""
    many = f" on each of {request.count} GPUs of one node" if request.count > 1 else ""
    return NoFit(
        f"no GPU{where} can hold {format_bytes(request.memory)}{many}; "
        f"the largest schedulable free memory on one GPU is {format_bytes(largest)} ({largest} bytes)"
    )
