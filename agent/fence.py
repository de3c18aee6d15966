"""The agent's fence: the highest leader epoch it has seen, kept across its own restarts.

With several managers on etcd, every frame a leader sends carries its epoch
(:class:`gpumgr.wire.epoch.Epoch`). The agent accepts a frame whose epoch is at least the highest it
has seen, raising that mark first (written to ``fence.json`` in its state directory, fsynced, before
the command runs), and refuses one with a lower epoch: a leader that was paused or cut off past its
lease and comes back can change nothing on this host, and is told ``stale_epoch`` so it steps down.

Once an agent has seen an epoch it also refuses frames that carry none: those come from a manager
that is not part of the replicated control plane (a stray single manager holding the same key). To
move a node back to a single manager, delete ``fence.json`` in its state directory.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpumgr.wire import security
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)
FENCE_FILE = "fence.json"


class StaleEpoch(GpumgrError):
    """A command from a manager that is no longer the leader; it must step down (a newer leader rules)."""

    code = "stale_epoch"
    status = 409


class Fence:
    """The highest epoch seen, persisted in ``folder`` (None: kept in memory only, for tests)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder, FENCE_FILE) if folder is not None else None
        self._lock = threading.Lock()
        self._highest = self._load()

    @property
    def highest(self) -> Epoch | None:
        """The highest epoch accepted so far, or None when no leader of several managers ever spoke."""
        with self._lock:
            return self._highest

    def admit(self, epoch: Epoch | None) -> None:
        """Accept a frame stamped ``epoch`` (raising the mark durably first); raises StaleEpoch to refuse it."""
        with self._lock:
            highest = self._highest
            if epoch is None:
                if highest is not None:
                    raise StaleEpoch(f"refused a command without an epoch: this agent follows the leader of "
                                     f"several managers (epoch {highest}); remove {self.path} to leave them")
                return
            if highest is not None and epoch < highest:
                raise StaleEpoch(f"refused a command of epoch {epoch}: a newer leader (epoch {highest}) rules; "
                                 "the sender must step down")
            if highest is None or epoch > highest:
                if self.path is not None:
                    security.write_private(self.path, {"generation": epoch.generation, "revision": epoch.revision})
                self._highest = epoch
                log.info("following the leader of epoch %s", epoch)

    def _load(self) -> Epoch | None:
        if self.path is None or not self.path.exists():
            return None
        data = security.read_private(self.path)
        try:
            return Epoch.from_wire([data["generation"], data["revision"]])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{self.path} does not hold an epoch: {exc}") from exc
