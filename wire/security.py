"""Who may speak on the agent link: CURVE keys, the join token, and the files that keep them.

Every frame between the manager and an agent is encrypted and authenticated with ZeroMQ CURVE;
there is no plaintext mode. The manager has a long-lived key pair. An agent has its own, and joins
once with a *join token* (like ``docker swarm join``): the token carries the manager's public key, so
the agent cannot be talked to by anyone posing as the manager, and a secret the agent proves it
knows by an HMAC over its own public key and node name (the secret itself never crosses the wire).
The manager then binds the node name to the agent's key; from then on a frame's key, proven by the
CURVE handshake and named by the ZAP handler, says which node it may speak for.

Files live in a state directory (mode 0700), each written atomically with mode 0600. Keys are created
by whichever process needs them first; two processes racing to create them end up with the same
ones (the loser reads the winner's file).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

#: The ZAP domain the manager's socket authenticates in.
ZAP_DOMAIN = "gpumgr"
TOKEN_PREFIX = "GPUMGR-1"
_TOKEN = re.compile(rf"^{TOKEN_PREFIX}-([0-9a-f]{{64}})-([0-9a-f]{{64}})$")
_JOIN_CONTEXT = b"gpumgr-join-v1"


class TokenError(ValueError):
    """A join token that cannot be read; ask the manager's operator for ``gpumgr join-token``."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves Z85-encoded as ZeroMQ takes them."""

    public: str
    secret: str

    @classmethod
    def generate(cls) -> KeyPair:
        """A fresh key pair."""
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))


def default_state_dir() -> Path:
    """``/var/lib/gpumgr`` for root, else ``~/.local/state/gpumgr`` (the XDG state home)."""
    if os.geteuid() == 0:
        return Path("/var/lib/gpumgr")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpumgr"


def state_dir(path: str | Path | None) -> Path:
    """The state directory ``path`` (or the default), created with mode 0700 if missing."""
    folder = Path(path) if path else default_state_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def write_private(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically (write, fsync, rename), readable by its owner only."""
    with _private_copy(path, json.dumps(data, indent=2, sort_keys=True)) as tmp:
        os.replace(tmp, path)


def write_private_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, atomically (write, fsync, rename), readable by its owner only."""
    with _private_copy(path, text) as tmp:
        os.replace(tmp, path)


def create_private(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Write ``data`` to ``path`` unless it exists; return what the file holds afterwards (ours or the winner's)."""
    with _private_copy(path, json.dumps(data, indent=2, sort_keys=True)) as tmp, \
            contextlib.suppress(FileExistsError):
        os.link(tmp, path)  # atomic and never replaces: the first creator wins
    return read_private(path)


@contextlib.contextmanager
def _private_copy(path: Path, text: str) -> Iterator[str]:
    """``text`` in a 0600 temporary file beside ``path``, synced to disk; gone afterwards unless renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o600)
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_private(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; raises ValueError naming the file if it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def load_keys(path: Path) -> KeyPair:
    """The key pair in ``path``, created there first if missing."""
    fresh = KeyPair.generate()
    data = create_private(path, {"public": fresh.public, "secret": fresh.secret})
    try:
        keys = KeyPair(str(data["public"]), str(data["secret"]))
        z85.decode(keys.public), z85.decode(keys.secret)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path} does not hold a CURVE key pair") from exc
    return keys


def new_join_secret() -> str:
    """A fresh join secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def make_token(server_public: str, join_secret: str) -> str:
    """The join token for a manager whose public key is ``server_public``."""
    return f"{TOKEN_PREFIX}-{z85.decode(server_public.encode('ascii')).hex()}-{join_secret}"


def parse_token(token: str) -> tuple[str, str]:
    """``(manager public key, join secret)`` from a token; raises TokenError for anything else."""
    match = _TOKEN.match(token.strip())
    if match is None:
        raise TokenError(f"not a gpumgr join token (expected {TOKEN_PREFIX}-<64 hex>-<64 hex>); "
                         "print one on the manager with: gpumgr join-token")
    return z85.encode(bytes.fromhex(match[1])).decode("ascii"), match[2]


def join_proof(join_secret: str, agent_public: str, node: str) -> str:
    """What an agent sends to prove it holds the join secret, bound to its key and node name."""
    message = b"\0".join((_JOIN_CONTEXT, agent_public.encode("ascii"), node.encode()))
    return hmac.new(bytes.fromhex(join_secret), message, hashlib.sha256).hexdigest()


def proof_matches(join_secret: str, agent_public: str, node: str, proof: str) -> bool:
    """Constant-time check of a join proof."""
    return hmac.compare_digest(join_proof(join_secret, agent_public, node), proof)


def serve_curve(sock: zmq.Socket[bytes], keys: KeyPair) -> None:
    """Make ``sock`` a CURVE server with ``keys``; the context's ZAP handler vets each client."""
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True


def connect_curve(sock: zmq.Socket[bytes], keys: KeyPair, server_public: str) -> None:
    """Make ``sock`` a CURVE client that talks only to the server holding ``server_public``'s secret."""
    sock.curve_secretkey = keys.secret.encode("ascii")
    sock.curve_publickey = keys.public.encode("ascii")
    sock.curve_serverkey = server_public.encode("ascii")


def start_authenticator(context: zmq.Context[zmq.Socket[bytes]]) -> ThreadAuthenticator:
    """The ZAP handler of ``context``: any CURVE client completes the handshake and is named by its key.

    The handshake proves the client holds its key's secret; which keys may do what is the manager's
    decision per message (an unadmitted key may only ask to join), so the ZAP layer admits every
    well-formed CURVE client and names it, and refuses every other mechanism.
    """
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
    return auth


def trusted_peer(sock: socket.socket) -> bool:
    """Whether the connecting process runs as root or as this agent's user (the socket's mode says the same).

    The mode 0600 already keeps others out; the kernel's word on the peer is checked as well, so a
    socket file whose mode was loosened by hand still admits no one else.
    """
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return False
    return uid in (0, os.geteuid())
