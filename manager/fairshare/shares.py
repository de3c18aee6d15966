"""Each account's fair share of the cluster, computed as NVIDIA's KAI Scheduler computes its queues'.

Working top-down over the tree, a parent's share (the capacity of the ready nodes, at the top) is
divided among its children in two steps:

1. **Quota.** Each child first gets ``min(quota, requested)``, where ``requested`` is what its
   containers hold plus what its requests wait for. When the children's quotas add up to more than
   the parent has (quotas past the capacity, or nodes down), the quotas are first scaled down in
   proportion, so that they add up to exactly what there is.
2. **Surplus.** What is left goes to the children of the highest ``priority`` first. Within one
   priority it is split by ``over_quota_weight`` (water-filling: a child whose cap is reached drops
   out, and its part goes to the others by weight), each capped at what it requested and at its
   ``limit``. A child of weight 0 gets no surplus.

A child's share is then divided among its own children the same way. Shares are in bytes (GPU
memory × GPUs) and are real numbers: a share of 1.75 GPUs is a target, not a grant.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpumgr.manager.tenancy.accounts import AccountTree

#: Below this many bytes, a remainder is rounding, not room.
EPSILON = 1e-6


@dataclass
class Shares:
    """One cycle's figures for every account: ``fair`` share, ``allocated`` (live grants) and ``requested``."""

    fair: dict[str, float] = field(default_factory=dict)
    allocated: dict[str, float] = field(default_factory=dict)
    requested: dict[str, float] = field(default_factory=dict)
    capacity: float = 0.0

    def ratio(self, name: str, more: float = 0.0) -> float:
        """``name``'s allocated (plus ``more``) over its fair share: below 1 it is owed room."""
        return share_ratio(self.allocated.get(name, 0.0) + more, self.fair.get(name, 0.0))


def share_ratio(allocated: float, fair: float) -> float:
    """``allocated / fair``; with no fair share, 0 for nothing allocated and infinity for anything."""
    if fair > EPSILON:
        return allocated / fair
    return 0.0 if allocated <= EPSILON else math.inf


def rolled_up(tree: AccountTree, per_leaf: Mapping[str, float]) -> dict[str, float]:
    """Each account's figure: its own (a leaf's) or the sum of its children's."""
    totals: dict[str, float] = {}

    def total(name: str) -> float:
        account = tree[name]
        value = float(per_leaf.get(name, 0.0)) if account.leaf else sum(total(c) for c in account.children)
        totals[name] = value
        return value

    for top in tree.tops:
        total(top)
    return totals


def compute(tree: AccountTree, allocated: Mapping[str, float], waiting: Mapping[str, float],
            capacity: float) -> Shares:
    """Every account's fair share of ``capacity`` bytes; ``allocated`` and ``waiting`` are per leaf."""
    shares = Shares(capacity=float(capacity))
    shares.allocated = rolled_up(tree, allocated)
    waits = rolled_up(tree, waiting)
    shares.requested = {name: shares.allocated[name] + waits[name] for name in shares.allocated}
    _divide(tree, None, float(capacity), shares)
    return shares


def _divide(tree: AccountTree, parent: str | None, amount: float, shares: Shares) -> None:
    """Split ``amount`` among ``parent``'s children into ``shares.fair``, then recurse into each."""
    kids = tree.children_of(parent)
    if not kids:
        return
    given = divide(amount, [(k, tree[k].quota, shares.requested.get(k, 0.0), tree[k].limit,
                            tree[k].over_quota_weight, tree[k].priority) for k in kids])
    for kid in kids:
        shares.fair[kid] = given[kid]
        _divide(tree, kid, given[kid], shares)


def divide(amount: float, children: list[tuple[str, float, float, float | None, float, int]]) -> dict[str, float]:
    """One level: ``children`` are ``(name, quota, requested, limit, weight, priority)``; see the module docstring."""
    amount = max(0.0, amount)
    quotas = {name: float(quota) for name, quota, *_ in children}
    total_quota = sum(quotas.values())
    if total_quota > amount > 0 or (total_quota > 0 and amount <= 0):
        scale = amount / total_quota
        quotas = {name: q * scale for name, q in quotas.items()}
    caps = {name: min(float(requested), math.inf if limit is None else float(limit))
            for name, _, requested, limit, _, _ in children}
    given = {name: min(quotas[name], caps[name]) for name in quotas}
    left = amount - sum(given.values())
    for priority in sorted({c[5] for c in children}, reverse=True):
        if left <= EPSILON:
            break
        group = {name: weight for name, _, _, _, weight, p in children
                 if p == priority and weight > 0 and caps[name] - given[name] > EPSILON}
        while left > EPSILON and group:
            weights = sum(group.values())
            full = [n for n, w in group.items() if caps[n] - given[n] <= left * w / weights + EPSILON]
            if not full:
                for name, weight in group.items():
                    given[name] += left * weight / weights
                left = 0.0
                break
            for name in full:
                left -= caps[name] - given[name]
                given[name] = caps[name]
                del group[name]
    return given
