"""Which agents the manager admits, and which node each one may speak for.

Everything here persists in the manager's state directory, so a restart keeps every admission and
binding: ``manager_key.json`` (the manager's CURVE key pair), ``join_secret.json`` (the secret the
join token carries; ``gpumgr join-token --rotate`` replaces it, and this module re-reads it at each
join, so rotation works while the manager runs) and ``nodes.json`` (node name → the agent's public
key). One lock guards the bindings; each change is written atomically before it takes effect.

A rack of agents joining at once must not wait on one fsync each on the link thread (1,000 joins
took 5-9 s so): :meth:`Admission.admit_later` checks a join at once and leaves new bindings to a
writer thread, which writes every binding that arrived meanwhile with one fsync, then answers them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)

#: Called once a join is settled: with None when the binding is on disk, or with why it was refused.
Settled = Callable[[GpumgrError | None], None]

KEY_FILE = "manager_key.json"
SECRET_FILE = "join_secret.json"
NODES_FILE = "nodes.json"


class JoinRefused(GpumgrError):
    """An agent's join was refused: a wrong or rotated-out token, or a name bound to another key."""

    code = "join_refused"
    status = 403


class Admission:
    """The manager's keys, its join secret and the node ⇄ key bindings in ``folder``."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = security.state_dir(folder)
        self.keys = security.load_keys(self.folder / KEY_FILE)
        self._lock = threading.Lock()
        self._nodes = self._load_nodes()
        self._keys = {v: k for k, v in self._nodes.items()}
        #: bindings checked but not yet on disk: node -> (key, who waits for it), and key -> node
        self._pending: dict[str, tuple[str, list[Settled]]] = {}
        self._pending_keys: dict[str, str] = {}
        self._writer: threading.Thread | None = None
        #: held across every write of nodes.json (taken before ``_lock``): writes never interleave
        self._disk = threading.Lock()

    # --- the join token ----------------------------------------------------------------------
    def join_secret(self) -> str:
        """The current join secret, created on first use."""
        path = self.folder / SECRET_FILE
        if not path.exists():
            security.create_private(path, {"secret": security.new_join_secret()})
        return str(security.read_private(path)["secret"])

    def rotate(self) -> None:
        """Replace the join secret: the old token admits no one from now on; admitted agents stay."""
        security.write_private(self.folder / SECRET_FILE, {"secret": security.new_join_secret()})

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
                self._save({**self._nodes, node: key})
                log.info("admitted node %s (key %s…)", node, key[:8])

    def admit_later(self, key: str, node: str, proof: str, settled: Settled) -> None:
        """As :meth:`admit`, for a caller that must not wait on the disk; ``settled`` gets the outcome.

        A refusal, or a key already bound to ``node``, is settled at once, on the calling thread. A
        new binding is settled by the writer thread once it is on disk, written with every other
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
        """Write the pending bindings in batches, one fsync each, settling their joins; ends when none wait."""
        while True:
            with self._disk:
                with self._lock:
                    batch = dict(self._pending)
                    if not batch:
                        self._writer = None
                        return
                    nodes = {**self._nodes, **{node: key for node, (key, _) in batch.items()}}
                error: GpumgrError | None = None
                try:  # the link thread goes on meanwhile: it needs only _lock
                    security.write_private(self.folder / NODES_FILE, {"nodes": nodes})
                except OSError as exc:
                    error = GpumgrError(f"the manager could not save this node's binding ({exc}); join again later")
                    log.error("could not save %d node bindings: %s", len(batch), exc)
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
        """Take ``batch`` out of the pending bindings and, written, into the bindings. Locked."""
        for node, (key, _) in batch.items():
            del self._pending[node]
            self._pending_keys.pop(key, None)
        if error is None:
            self._nodes = {**self._nodes, **{node: key for node, (key, _) in batch.items()}}
            self._keys = {v: k for k, v in self._nodes.items()}

    def forget(self, node: str) -> bool:
        """Drop ``node``'s binding (its agent must join again); False if it had none."""
        with self._disk, self._lock:
            if node not in self._nodes:
                return False
            self._save({k: v for k, v in self._nodes.items() if k != node})
            return True

    def nodes(self) -> dict[str, str]:
        """Every binding, node → key."""
        with self._lock:
            return dict(self._nodes)

    def _load_nodes(self) -> dict[str, str]:
        path = self.folder / NODES_FILE
        if not path.exists():
            return {}
        data = security.read_private(path)
        return {str(k): str(v) for k, v in data.get("nodes", {}).items()}

    def _save(self, nodes: dict[str, str]) -> None:
        security.write_private(self.folder / NODES_FILE, {"nodes": nodes})
        self._nodes = nodes
        self._keys = {v: k for k, v in nodes.items()}
