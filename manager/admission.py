"""Which agents the manager admits, and which node each one may speak for.

Everything here persists in the manager's state directory, so a restart keeps every admission and
binding: ``manager_key.json`` (the manager's CURVE key pair), ``join_secret.json`` (the secret the
join token carries; ``gpumgr join-token --rotate`` replaces it, and this module re-reads it at each
join, so rotation works while the manager runs) and ``nodes.json`` (node name → the agent's public
key). One lock guards the bindings; each change is written atomically before it takes effect.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpumgr.wire import security
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger(__name__)

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
                self._save({**self._nodes, node: key})
                log.info("admitted node %s (key %s…)", node, key[:8])

    def forget(self, node: str) -> bool:
        """Drop ``node``'s binding (its agent must join again); False if it had none."""
        with self._lock:
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
