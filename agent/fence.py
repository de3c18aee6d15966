"""The agent's fence: the highest leader epoch it has seen, kept across its own restarts.

With several managers on etcd, every frame a leader sends carries its epoch
(:class:`gpumgr.wire.epoch.Epoch`). The agent accepts a frame whose epoch is at least the highest it
has seen and refuses one with a lower epoch: a leader that was paused or cut off past its lease and
comes back can change nothing on this host, and is told ``stale_epoch`` so it steps down.

A higher epoch raises the mark in memory at once (the link's thread screens frames and never waits
on a disk), and the fence's own writer thread writes it to ``fence.json`` in the state directory
(fsynced). A command acts only once the epoch it carries is on disk (:meth:`Fence.durable`). When
the file cannot be written (a full or read-only disk) the failure is logged, the agent keeps running
and enforcing, and the new leader's commands are refused with ``fence_unwritable``
(:class:`FenceUnwritable`), which never deposes anyone; each such command tries the write again, and
so does every heartbeat, which tells the manager why (:meth:`Fence.unwritable`) until the write succeeds.

Once an agent has seen an epoch it also refuses frames that carry none: those come from a manager
that is not part of the replicated control plane (a stray single manager holding the same key). To
move a node back to a single manager, delete ``fence.json`` in its state directory.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from gpumgr.wire import security
from gpumgr.wire.epoch import Epoch
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)
FENCE_FILE = "fence.json"
#: How long a command waits for its epoch to reach the disk before it is refused (a disk that hangs).
WRITE_WAIT = 10.0
#: The longest reason the agent reports (the wire's bound on ``fence_unwritable``).
MAX_REASON = 512


class StaleEpoch(GpumgrError):
    """A command from a manager that is no longer the leader; it must step down (a newer leader rules)."""

    code = "stale_epoch"
    status = 409


class FenceUnwritable(GpumgrError):
    """This agent cannot write its fence file, so it runs no command of a leader it has not recorded.

    The node is unusable until its state directory can be written again (free the disk, or make it
    writable); no leader is deposed by it. Running containers and their enforcement go on.
    """

    code = "fence_unwritable"
    status = 503


class Fence:
    """The highest epoch seen, persisted in ``folder`` by a writer thread (None: kept in memory only)."""

    def __init__(self, folder: str | Path | None, *, write_wait: float = WRITE_WAIT) -> None:
        self.path = Path(folder, FENCE_FILE) if folder is not None else None
        self.write_wait = write_wait
        self._cond = threading.Condition()
        self._highest = self._load()
        #: what the file holds (as far as this process wrote or read it)
        self._durable = self._highest
        #: writes asked for and writes finished, counted: a waiter's write is done once ``_written`` reaches it
        self._asked = self._written = 0
        #: why the last write failed ("" when it succeeded)
        self._error = ""
        self._closed = False
        self._writer: threading.Thread | None = None

    @property
    def highest(self) -> Epoch | None:
        """The highest epoch accepted so far, or None when no leader of several managers ever spoke."""
        with self._cond:
            return self._highest

    def admit(self, epoch: Epoch | None) -> None:
        """Accept a frame stamped ``epoch`` or raise StaleEpoch; never waits on the disk.

        A higher epoch becomes the mark at once and is written in the background.
        """
        with self._cond:
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
                self._highest = epoch
                if self.path is None:
                    self._durable = epoch
                else:
                    self._ask()
                log.info("following the leader of epoch %s", epoch)

    def durable(self, epoch: Epoch | None) -> None:
        """Return once ``epoch`` (admitted before) is on disk; raises FenceUnwritable if it cannot be written."""
        if epoch is None or self.path is None:
            return
        deadline = time.monotonic() + self.write_wait
        with self._cond:
            if self._holds(epoch):
                return
            # a write still to finish was asked after this epoch was admitted, so it covers it; none: try again
            ticket = self._asked if self._asked > self._written else self._ask()
            while self._written < ticket and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FenceUnwritable(f"writing {self.path} has not finished in {self.write_wait:g}s (is its "
                                          f"disk hung?): this node runs no command of leader epoch {epoch} until "
                                          "it is written")
                self._cond.wait(left)
            if not self._holds(epoch):
                raise FenceUnwritable(f"cannot write {self.path} ({self._error or 'the agent is stopping'}): this "
                                      f"node runs no command of leader epoch {epoch} until it can; free its disk "
                                      "or make its state directory writable")

    def unwritable(self) -> str:
        """Why the highest epoch is not on disk ("" when it is, or while its first write is under way).

        Asked with every registration and heartbeat, so the manager places nothing on this node meanwhile; a
        failed write is tried again each time it is asked, so the node recovers once its disk does.
        """
        with self._cond:
            if self.path is None or self._highest is None or self._holds(self._highest) or not self._error:
                return ""
            if self._written >= self._asked:
                self._ask()
            return f"cannot write {self.path}: {self._error}"[:MAX_REASON]

    def close(self) -> None:
        """Stop the writer thread (what it writes now is finished); waiting commands are refused."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _holds(self, epoch: Epoch) -> bool:
        return self._durable is not None and self._durable >= epoch

    def _ask(self) -> int:
        """Ask the writer for one more write of the mark (with the lock held); returns its ticket."""
        self._asked += 1
        if self._writer is None and not self._closed:
            self._writer = threading.Thread(target=self._write_loop, name="fence-writer", daemon=True)
            self._writer.start()
        self._cond.notify_all()
        return self._asked

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while self._written >= self._asked and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                ticket, epoch, durable = self._asked, self._highest, self._durable
            error = "" if epoch is None or (durable is not None and epoch <= durable) else self._write(epoch)
            with self._cond:
                self._written, self._error = ticket, error
                if not error and epoch is not None and not self._holds(epoch):
                    self._durable = epoch
                self._cond.notify_all()

    def _write(self, epoch: Epoch) -> str:
        """Write ``epoch`` to the file; returns "" once it is on disk, else why not (logged, never raised)."""
        assert self.path is not None
        try:
            security.write_private(self.path, {"generation": epoch.generation, "revision": epoch.revision})
        except Exception as exc:  # a full or read-only disk, a path that is no file: the agent must live on
            log.error("cannot write the fence %s for leader epoch %s: %s; that leader's commands are refused "
                      "with %s until it can be written", self.path, epoch, exc, FenceUnwritable.code)
            return str(exc) or type(exc).__name__
        return ""

    def _load(self) -> Epoch | None:
        if self.path is None or not self.path.exists():
            return None
        data = security.read_private(self.path)
        try:
            return Epoch.from_wire([data["generation"], data["revision"]])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{self.path} does not hold an epoch: {exc}") from exc
