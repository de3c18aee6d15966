"""Placing a gang: every member's GPUs chosen in one decision, or none (pure, like the scheduler).

A gang is ``replicas`` members, each asking for ``count`` GPUs of one node with ``memory`` bytes
free. With ``one_per_node`` (the default) every member is on its own node: each node's best set (its
``count`` GPUs with the most free memory, or the best-connected set where its topology is known, as
:func:`~gpumgr.manager.placing.scheduler.place` chooses for one request) is scored once, and the
``replicas`` best nodes are taken, by the placement's rule (``spread``: the most free memory;
``binpack``: the least that fits). Without it members may share a node, and a GPU, as room allows:
members are placed one after another on a scratch copy of the free memory, each where the rule
says, so the plan never grants a byte twice. Nothing on the map changes; the caller grants the plan.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpumgr.manager.placing.free_index import FreeIndex, GpuSlot
from gpumgr.manager.placing.scheduler import SPREAD, Request
from gpumgr.wire.errors import NO_AGENTS, NoAgents, NoFit
from gpumgr.wire.units import format_bytes


def plan_gang(index: FreeIndex, request: Request, replicas: int, one_per_node: bool = True,
              more: Mapping[str, int] | None = None) -> list[list[GpuSlot]]:
    """The GPUs of each of ``replicas`` members, rank order; NoFit when the gang does not fit whole now.

    ``more`` adds bytes to some GPUs' free memory: what would free there (a preemption being weighed).
    """
    if not index.by_node:
        raise NoAgents(NO_AGENTS)
    allows = request.constraints.allows if request.constraints.items else None
    spread = request.placement is SPREAD
    free = {s.uuid: s.free + (more.get(s.uuid, 0) if more else 0) for slots in index.by_node.values() for s in slots}
    nodes = [request.node] if request.node is not None else list(index.by_node)

    def best_set(node: str) -> list[GpuSlot] | None:
        fitting = [s for s in index.by_node.get(node, ()) if free[s.uuid] >= request.memory
                   and (allows is None or allows(s))]
        if len(fitting) < request.count:
            return None
        fitting.sort(key=lambda s: free[s.uuid], reverse=spread)
        return fitting[:request.count]

    plan: list[list[GpuSlot]] = []
    if one_per_node:
        scored = []
        for node in nodes:
            chosen = best_set(node)
            if chosen is not None:
                scored.append((sum(free[s.uuid] for s in chosen), node, chosen))
        if len(scored) < replicas:
            raise NoFit(f"the gang needs {replicas} nodes with {request.count} GPU(s) of "
                        f"{format_bytes(request.memory)} free each; {len(scored)} have that room now")
        scored.sort(key=lambda entry: (entry[0], entry[1]), reverse=spread)
        return [chosen for _, _, chosen in scored[:replicas]]
    for rank in range(replicas):
        options = [(sum(free[s.uuid] for s in chosen), node, chosen) for node in nodes
                   if (chosen := best_set(node)) is not None]
        if not options:
            raise NoFit(f"the gang's member {rank} of {replicas} finds no node with {request.count} GPU(s) of "
                        f"{format_bytes(request.memory)} free once the members before it are placed")
        _, _, chosen = (max if spread else min)(options, key=lambda entry: (entry[0], entry[1]))
        for slot in chosen:
            free[slot.uuid] -= request.memory
        plan.append(chosen)
    return plan


def could_ever_fit(sizes_by_node: dict[str, list[int]], memory: int, count: int, replicas: int,
                   one_per_node: bool) -> bool:
    """Whether the gang fits nodes whose GPUs can grant ``sizes_by_node`` bytes each, all empty."""
    if one_per_node:
        return sum(1 for sizes in sizes_by_node.values() if sum(1 for s in sizes if s >= memory) >= count) >= replicas
    members = 0
    for sizes in sizes_by_node.values():
        per_gpu = sorted((s // memory for s in sizes if s >= memory), reverse=True)
        # each member takes one slot on each of `count` distinct GPUs: as many as the count-th largest allows,
        # counted greedily (a bound that is exact for count 1 and safe-side for more)
        while len(per_gpu) >= count and per_gpu[count - 1] > 0:
            members += 1
            per_gpu = sorted([n - 1 for n in per_gpu[:count]] + per_gpu[count:], reverse=True)
            if members >= replicas:
                return True
    return members >= replicas


def hold_targets(index: FreeIndex, request: Request, replicas: int,
                 one_per_node: bool = True) -> list[tuple[GpuSlot, int]]:
    """Where to hold room for a waiting gang, and how much: ``(gpu, bytes)`` on the GPUs it fits best.

    The nodes that could hold a member were they empty are ranked by the free memory of their best
    ``count`` GPUs; the first ``replicas`` of them (each taken ``count`` GPUs at a time, by free memory, and
    again while it has GPUs left when members may share nodes) are to hold a member's ``memory`` per GPU:
    what is free there now, and what frees there from now on, until the whole gang fits.
    """
    allows = request.constraints.allows if request.constraints.items else None
    nodes = [request.node] if request.node is not None else list(index.by_node)
    ranked = []
    for node in nodes:
        able = [s for s in index.by_node.get(node, ()) if s.total - s.headroom >= request.memory
                and (allows is None or allows(s))]
        if len(able) < request.count:
            continue
        able.sort(key=lambda s: s.free, reverse=True)
        groups = [able[i:i + request.count] for i in range(0, len(able) - request.count + 1, request.count)]
        for group in groups[:1] if one_per_node else groups:
            ranked.append((sum(s.free for s in group), node, group))
    ranked.sort(key=lambda entry: (entry[0], entry[1]), reverse=True)
    return [(slot, request.memory) for _, _, group in ranked[:replicas] for slot in group]
