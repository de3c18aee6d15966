"""Which agents the manager admits, and which node each one may speak for.

Everything here persists, so a restart keeps every admission and binding. The manager's CURVE key
pair is ``manager_key.json`` in its state directory (one identity, given as files to every manager of
a replicated control plane). The join secret (what the join token carries; ``gpumgr join-token
--rotate`` replaces it, and this module re-reads it at each join, so rotation works while the manager
runs) and the bindings (node name → the agent's public key) live in the manager's
:class:`~gpumgr.manager.store.Store`: by default the same state directory (``join_secret.json``,
``nodes.json``), or etcd shared by several managers. One lock guards the bindings; each change is
written durably before it takes effect.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpumgr.manager.store import FileStore, Store
from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)

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
        if not key:
            raise JoinRefused("the link did not authenticate this peer")
        if not security.proof_matches(self.join_secret(), key, node, proof):
            raise JoinRefused("the join token is wrong or was rotated out: ask for a new one (gpumgr join-token)")
        with self._lock:
            bound, spoken = self._nodes.get(node), self._keys.get(key)
            if bound is not None and bound != key:
                raise JoinRefused(f"node name {node!r} is bound to another agent's key: stop that agent and run "
                                  f"'gpumgr node rm {node}', or start this one with another --node")
            if spoken is not None and spoken != node:
                raise JoinRefused(f"this agent's key is already bound to node {spoken!r}; it may speak for no other")
            if bound is None:
                self.store.bind(node, key)
                self._nodes[node], self._keys[key] = key, node
                log.info("admitted node %s (key %s…)", node, key[:8])

    def forget(self, node: str) -> bool:
        """Drop ``node``'s binding (its agent must join again); False if it had none."""
        with self._lock:
            if node not in self._nodes:
                return False
            self.store.forget(node)
            self._keys.pop(self._nodes.pop(node), None)
            return True

    def nodes(self) -> dict[str, str]:
        """Every binding, node → key."""
        with self._lock:
            return dict(self._nodes)
