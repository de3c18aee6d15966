"""The manager's clock: wall time for what clients see, monotonic time for every deadline and order.

One object so a test can drive the manager on a logical clock it advances itself (deadlines, queue
aging, heartbeats), with no sleeps; the running manager uses :data:`SYSTEM`.
"""

from __future__ import annotations

import time


class Clock:
    """Reads the system's clocks; subclass it to drive time by hand."""

    def monotonic(self) -> float:
        """Seconds on a clock that never steps back: deadlines, queue order and aging use it."""
        return time.monotonic()

    def time(self) -> float:
        """Unix time, for the timestamps clients read."""
        return time.time()


class _SystemClock(Clock):
    """The system's clocks with no Python call in between: they are read on every placement."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM: Clock = _SystemClock()
