"""A create that runs at most once: sent with an ``Idempotency-Key`` and resent while its outcome is unknown.

``POST /v1/containers`` is not idempotent on its own: a create whose connection broke after it was
sent, or that was answered 502 ``outcome_unknown`` (the manager sent it and nobody knows whether it
ran: a node that did not answer, a leader that went away), may have run. With a key the manager runs
it at most once per key and gives a repeat the first answer, so the client resends it with the same
key (backing off, with jitter) until it has an answer; 409 ``in_progress`` (the first is still being
carried out) is waited out the same way. Only if no answer comes within :data:`RESEND_FOR` seconds
is :class:`~gpumgr.wire.errors.OutcomeUnknown` raised, naming the key: look before creating it again.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from gpumgr.client_http import API, ManagerUnreachable
from gpumgr.wire import defaults
from gpumgr.wire.errors import InProgress, OutcomeUnknown

HEADER = "Idempotency-Key"
#: How long a create is resent while its outcome is unknown: a create's whole timeout and margin, and the
#: time a new leader takes to hear from its nodes again, after which the manager knows.
RESEND_FOR = defaults.CREATE_TIMEOUT + defaults.CREATE_MARGIN + 4 * defaults.NODE_DOWN_AFTER
#: The first pause before a resend; it doubles up to :data:`BACKOFF_MAX` (each with up to half again of jitter).
BACKOFF = 0.5
BACKOFF_MAX = 8.0
#: What makes a resend worth it: the outcome is unknown, or the first is still being carried out.
RESENDABLE = (ManagerUnreachable, OutcomeUnknown, InProgress)


def new_key() -> str:
    """A fresh key for one create (a random UUID)."""
    return str(uuid.uuid4())


def create(api: API, body: dict[str, Any], key: str | None = None, *, resend_for: float | None = None,
           backoff: float | None = None, sleep: Callable[[float], None] = time.sleep) -> Any:
    """``POST /v1/containers`` with ``body`` under ``key`` (a new one if None); its JSON answer.

    Resent with the same key on a connection error, 502 ``outcome_unknown`` or 409 ``in_progress`` until
    :data:`RESEND_FOR` (``resend_for``) seconds have passed; then OutcomeUnknown says so and names the key.
    Every other answer, error or not, is the manager's and is returned or raised as it is.
    """
    key = key or new_key()
    deadline = time.monotonic() + (RESEND_FOR if resend_for is None else resend_for)
    pause, sends = BACKOFF if backoff is None else backoff, 0
    while True:
        sends += 1
        try:
            return api.call("POST", "/v1/containers", body=body, headers={HEADER: key})
        except RESENDABLE as exc:
            last: Exception = exc
        wait = min(pause, BACKOFF_MAX) * (1 + random.random() / 2)
        if time.monotonic() + wait > deadline:
            break
        sleep(wait)
        pause *= 2
    raise OutcomeUnknown(f"whether the container was created is still unknown after {sends} sends with "
                         f"Idempotency-Key {key} (last: {last}); look before creating it again (GET "
                         "/v1/containers, or send it again with the same key)")
