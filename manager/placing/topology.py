"""A node's GPU topology as the scheduler uses it: which NVLink island, PCIe switch and socket each GPU is in.

The agent reports, per GPU, how it is joined to each other GPU of its node (``GpuInfo.links``:
``nvlink``, ``pcie_switch``, ``socket`` or ``system``). Here those pairwise links become groups:
at each level the GPUs joined at that level or better, transitively, share one group id (the
smallest index among them). A GPU's ``groups`` is its id at each level of
:data:`gpumgr.manager.placing.scheduler.LINKS`, so the scheduler finds the tightest group holding ``k``
fitting GPUs by bucketing, without looking at pairs. Real topologies nest (an NVLink island sits
under one switch or socket, or spans them: then the island is what counts), so the transitive
closure loses nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpumgr.manager.placing.scheduler import LINKS


class Gpu(Protocol):
    """What grouping reads and sets on one of the map's GPUs (the model's ``records.Gpu`` is one)."""

    uuid: str
    index: int
    links: dict[str, str]
    groups: tuple[int, int, int] | None

#: Link name → its rank, best first (``system``, across sockets, ranks after every level).
RANK = {name: rank for rank, name in enumerate((*LINKS, "system"))}


def assign_groups(gpus: Sequence[Gpu]) -> None:
    """Set each GPU's ``groups`` from the links reported; None on every GPU when none reported any."""
    if not any(g.links for g in gpus):
        for gpu in gpus:
            gpu.groups = None
        return
    by_uuid = {g.uuid: g for g in gpus}
    levels = [_components(gpus, by_uuid, level) for level in range(len(LINKS))]
    for gpu in gpus:
        gpu.groups = (levels[0][gpu.uuid], levels[1][gpu.uuid], levels[2][gpu.uuid])


def _components(gpus: Sequence[Gpu], by_uuid: dict[str, Gpu], level: int) -> dict[str, int]:
    """Each GPU's group at ``level``: GPUs joined at that rank or better, transitively, keyed by their lowest index."""
    parent = {g.uuid: g.uuid for g in gpus}

    def root(uuid: str) -> str:
        while parent[uuid] != uuid:
            parent[uuid] = parent[parent[uuid]]
            uuid = parent[uuid]
        return uuid

    for gpu in gpus:
        for other, link in gpu.links.items():
            # links are read as either end reported them; a link to a GPU not on this node is ignored
            if other in by_uuid and RANK.get(link, len(LINKS)) <= level:
                parent[root(gpu.uuid)] = root(other)
    lowest: dict[str, int] = {}
    for gpu in gpus:
        top = root(gpu.uuid)
        lowest[top] = min(lowest.get(top, gpu.index), gpu.index)
    return {g.uuid: lowest[root(g.uuid)] for g in gpus}
