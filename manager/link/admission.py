"""Which agents the manager admits, and which node each one may speak for.

Everything here persists, so a restart keeps every admission and binding. The manager's CURVE key
pair is ``manager_key.json`` in its state directory (one identity, given as files to every manager of
a replicated control plane). The join secret (what the join token carries; ``gpumgr join-token
--rotate`` replaces it, and this module re-reads it at each join, so rotation works while the manager
runs) and the bindings (node name → the agent's public key) live in the manager's
:class:`~gpumgr.manager.control.store.Store`: by default the same state directory (``join_secret.json``,
``nodes.json``), or etcd shared by several managers. One lock guards the bindings; each change is
written durably before it takes effect.

A rack of agents joining at once must not wait on one durable write each on the link thread (1,000
joins took 5-9 s so): :meth:`Admission.admit_later` checks a join at once and leaves new bindings to
a writer thread, which stores every binding that arrived meanwhile at once (one fsync with the
file store), then answers them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpumgr.manager.control.store import FileStore, Store
from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)

#: Called once a join is settled: with None when the binding is stored, or with why it was refused.
Settled = Callable[[GpumgrError | None], None]

KEY_FILE = "manager_key.json"


class JoinRefused(GpumgrError):
    """An agent's join was refused: a wrong or rotated-out token, or a name bound to another key."""

    code = "join_refused"
    status = 403


class Admission:
    """The manager's keys in ``folder``; its join secret and node ⇄ key bindings in ``store`` (default ``folder``)."""

    def __init__(self, folder: str | Path | None, store: Store | None = None) -> None:
        self.folder = security.state_dir(folder)
        self.keys = security.load_keys(self.folder / KEY_FILE)
        self.store = store or FileStore(self.folder)
        self._lock = threading.Lock()
        self._nodes: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        #: bindings checked but not yet stored: node -> (key, who waits for it), and key -> node
        self._pending: dict[str, tuple[str, list[Settled]]] = {}
        self._pending_keys: dict[str, str] = {}
        self._writer: threading.Thread | None = None
        #: held across every write of the bindings (taken before ``_lock``): writes never interleave
        self._disk = threading.Lock()
        self.reload()

    def reload(self) -> None:
        """Read the bindings from the store again (a manager that has just become leader sees its predecessor's)."""
        nodes = self.store.nodes()
        with self._lock:
            self._nodes, self._keys = nodes, {v: k for k, v in nodes.items()}

    # --- the join token ----------------------------------------------------------------------
    def join_secret(self) -> str:
        """The current join secret, created on first use."""
        return self.store.join_secret()

    def rotate(self) -> None:
        """Replace the join secret: the old token admits no one from now on; admitted agents stay."""
        self.store.rotate_secret()

    def token(self) -> str:
        """The join token agents pass to ``gpumgr agent --join``."""
        return security.make_token(self.keys.public, self.join_secret())

    # --- bindings ----------------------------------------------------------------------------
    def node_of(self, key: str) -> str | None:
        """The node ``key`` may speak for, or None if it was never admitted."""
        with self._lock:
            return self._keys.get(key)

    def key_of(self, node: str) -> str | None:
        """The key bound to ``node``, or None."""
        with self._lock:
            return self._nodes.get(node)

    def admit(self, key: str, node: str, proof: str) -> None:
        """Admit ``key`` as ``node`` if ``proof`` shows the current join secret; raises JoinRefused."""
        self._check_proof(key, node, proof)
        with self._disk, self._lock:
            if self._check_binding(key, node):
                self.store.bind(node, key)
                self._nodes[node], self._keys[key] = key, node
                log.info("admitted node %s (key %s…)", node, key[:8])

    def admit_later(self, key: str, node: str, proof: str, settled: Settled) -> None:
        """As :meth:`admit`, for a caller that must not wait on the disk; ``settled`` gets the outcome.

        A refusal, or a key already bound to ``node``, is settled at once, on the calling thread. A
        new binding is settled by the writer thread once it is stored, written with every other
        binding that arrived meanwhile; until then it admits nobody, yet a join naming the same node
        with another key, or the same key with another node, is refused already.
        """
        try:
            self._check_proof(key, node, proof)
            with self._lock:
                if self._check_binding(key, node):
                    self._pending.setdefault(node, (key, []))[1].append(settled)
                    self._pending_keys[key] = node
                    self._start_writer()
                    return
        except GpumgrError as exc:
            settled(exc)
            return
        settled(None)

    def _check_proof(self, key: str, node: str, proof: str) -> None:
        if not key:
            raise JoinRefused("the link did not authenticate this peer")
        if not security.proof_matches(self.join_secret(), key, node, proof):
            raise JoinRefused("the join token is wrong or was rotated out: ask for a new one (gpumgr join-token)")

    def _check_binding(self, key: str, node: str) -> bool:
        """Whether ``key`` as ``node`` is a new binding (False: it exists); raises JoinRefused on a clash. Locked."""
        bound = self._nodes.get(node) or self._pending.get(node, ("", []))[0] or None
        spoken = self._keys.get(key) or self._pending_keys.get(key)
        if bound is not None and bound != key:
            raise JoinRefused(f"node name {node!r} is bound to another agent's key: stop that agent and run "
                              f"'gpumgr node rm {node}', or start this one with another --node")
        if spoken is not None and spoken != node:
            raise JoinRefused(f"this agent's key is already bound to node {spoken!r}; it may speak for no other")
        return node not in self._nodes

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_pending, name="admission-writer", daemon=True)
            self._writer.start()

    def _write_pending(self) -> None:
        """Store the pending bindings in batches, settling their joins; ends when none wait."""
        while True:
            with self._disk:
                with self._lock:
                    batch = dict(self._pending)
                    if not batch:
                        self._writer = None
                        return
                error: GpumgrError | None = None
                try:  # the link thread goes on meanwhile: it needs only _lock
                    self.store.bind_many({node: key for node, (key, _) in batch.items()})
                except GpumgrError as exc:  # the store is fenced off (another manager leads)
                    error = exc
                except OSError as exc:
                    error = GpumgrError(f"the manager could not save this node's binding ({exc}); join again later")
                if error is not None:
                    log.error("could not save %d node bindings: %s", len(batch), error.message)
                with self._lock:
                    self._settle(batch, error)
            if error is None:
                log.info("admitted %d node(s) with one write: %s", len(batch), ", ".join(sorted(batch)[:5]))
            for _, waiting in batch.values():
                for settled in waiting:
                    try:
                        settled(error)
                    except Exception:  # one caller's failure must not leave the others unanswered
                        log.exception("answering a join failed")

    def _settle(self, batch: dict[str, tuple[str, list[Settled]]], error: GpumgrError | None) -> None:
        """Take ``batch`` out of the pending bindings and, stored, into the bindings. Locked."""
        for node, (key, _) in batch.items():
            del self._pending[node]
            self._pending_keys.pop(key, None)
            if error is None:
                self._nodes[node], self._keys[key] = key, node

    def forget(self, node: str) -> bool:
        """Drop ``node``'s binding (its agent must join again); False if it had none."""
        with self._disk, self._lock:
            if node not in self._nodes:
                return False
            self.store.forget(node)
            self._keys.pop(self._nodes.pop(node), None)
            return True

    def nodes(self) -> dict[str, str]:
        """Every binding, node → key."""
        with self._lock:
            return dict(self._nodes)
