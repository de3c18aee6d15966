"""The agent's identity on the link: its CURVE key pair, the manager it trusts, and whether it must join.

Kept in the agent's state directory: ``agent_key.json`` (its key pair, created on first start) and
``manager.json`` (the manager's public key and this node's name, written once the manager admitted
it). A first start needs a join token; later starts need none, and a token for the manager already
joined is not used again (so a rotated token left in the environment does not lock an agent out).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpumgr.wire import protocol, security

AGENT_KEY_FILE = "agent_key.json"
MANAGER_FILE = "manager.json"


class NotJoined(ValueError):
    """This agent cannot speak to a manager yet: it needs a join token (``gpumgr join-token`` prints one)."""


@dataclass(frozen=True)
class Identity:
    """Who this agent is on the link and whom it trusts; ``join`` is set when this start must join first."""

    folder: Path
    keys: security.KeyPair
    server_public: str
    join: protocol.Join | None

    def remember(self, node: str) -> None:
        """Record that the manager admitted this agent as ``node``, so later starts need no token."""
        security.write_private(self.folder / MANAGER_FILE, {"manager_public": self.server_public, "node": node})


def load_identity(folder: str | Path | None, node: str, token: str | None) -> Identity:
    """The identity kept in ``folder`` (created if new), joining with ``token`` when it must.

    Raises NotJoined when there is neither a token nor a past join, or the past join was as another
    node; TokenError for a token that cannot be read.
    """
    where = security.state_dir(folder)
    keys = security.load_keys(where / AGENT_KEY_FILE)
    joined = _joined(where)
    if token:
        server_public, secret = security.parse_token(token)
        if joined == (server_public, node):
            return Identity(where, keys, server_public, None)
        proof = security.join_proof(secret, keys.public, node)
        return Identity(where, keys, server_public, protocol.Join(node=node, proof=proof))
    if joined is None:
        raise NotJoined(f"this agent has not joined a manager (state in {where}): start it once with "
                        "--join TOKEN or GPUMGR_JOIN_TOKEN; 'gpumgr join-token' on the manager prints the token")
    if joined[1] != node:
        raise NotJoined(f"this agent joined as node {joined[1]!r}, not {node!r}: keep that name, or give "
                        "another --state-dir and join again")
    return Identity(where, keys, joined[0], None)


def _joined(folder: Path) -> tuple[str, str] | None:
    path = folder / MANAGER_FILE
    if not path.exists():
        return None
    data = security.read_private(path)
    return str(data["manager_public"]), str(data["node"])
