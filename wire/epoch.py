"""A leader's epoch: what orders the managers that have led one control plane, on both ends of the link.

An epoch is the pair ``(generation, revision)``, compared in that order. ``revision`` is the etcd create
revision of the leader key the manager holds: a later leader of the same store always has a larger
one. ``generation`` is a counter in the store, never a clock: an etcd restored from a snapshot hands
out revisions again, and one rebuilt from scratch starts both again, so a leader that learns from an
agent of an epoch above its own raises the generation above it in a transaction and stands again
(:mod:`gpumgr.manager.control.leadership`). Every leader after that outranks every leader before, and no
leader of the old store is ever accepted again by an agent that has seen the new one.

A single manager without etcd has no epoch (None) and its commands carry none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class Epoch:
    """``(generation, revision)``, ordered: a larger epoch is a later leader."""

    generation: int
    revision: int

    def to_wire(self) -> list[int]:
        """The two integers as the envelope carries them."""
        return [self.generation, self.revision]

    @classmethod
    def from_wire(cls, value: Any) -> Epoch:
        """An epoch from its wire form; raises ValueError for anything but two non-negative integers."""
        if not isinstance(value, list | tuple) or len(value) != 2 or \
                not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in value):
            raise ValueError(f"an epoch is two non-negative 64-bit integers, not {value!r}")
        return cls(int(value[0]), int(value[1]))

    def __str__(self) -> str:
        return f"{self.generation}.{self.revision}"
