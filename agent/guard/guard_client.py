"""The agent's side of the guard: a single-use ticket registered just before each container it creates.

The engine tells an authorization plugin nothing about who sent a request, so the guard cannot let
gpumgr's own creates through by their sender. Instead the agent, which may talk to the guard's
root-only control socket, registers a fresh random ticket there and puts it in the create's
:data:`~gpumgr.agent.guard.guard.TICKET_LABEL` label; the guard lets that one create (its GPU variables
and device requests) through and forgets the ticket. With no guard on the node (no control socket)
nothing is added, and a guard that does not answer makes the create fail with the guard's refusal.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from pathlib import Path

from gpumgr.agent.guard.guard import TICKET_LABEL

log = logging.getLogger(__name__)
#: Seconds to wait for the guard (it answers from memory).
TIMEOUT = 2.0


def ticket_labels(control_socket: str | None) -> dict[str, str]:
    """``{TICKET_LABEL: ticket}`` once the guard on ``control_socket`` holds it; ``{}`` with no guard there."""
    if not control_socket or not Path(control_socket).exists():
        return {}
    ticket = secrets.token_urlsafe(32)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT)
            sock.connect(control_socket)
            sock.sendall(json.dumps({"ticket": ticket}).encode() + b"\n")
            answer = json.loads(sock.makefile("rb").readline(4096) or b"{}")
    except (OSError, ValueError) as exc:
        log.warning("the guard on %s took no ticket (%s): the create will be refused", control_socket, exc)
        return {}
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        log.warning("the guard refused a ticket: %s", answer)
        return {}
    return {TICKET_LABEL: ticket}
