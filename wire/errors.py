"""The exceptions gpumgr raises; each carries a short machine code and says how to recover."""

from __future__ import annotations


class GpumgrError(Exception):
    """Root of every gpumgr error. ``code`` is the stable name clients match on."""

    code = "error"
    status = 500

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, str]:
        """The JSON error body ``{"code", "message"}`` used on REST and on the link."""
        return {"code": self.code, "message": self.message}


class ProtocolError(GpumgrError):
    """A message on the agent link was malformed, oversized or of an unknown type.

    The receiver logs it, drops the message and keeps serving; the sender is never trusted again
    for that message only, not for the whole connection.
    """

    code = "protocol_error"


class InvalidRequest(GpumgrError):
    """The client sent a request that cannot be served as written; fix the request and retry."""

    code = "invalid_request"
    status = 400


class NotFound(GpumgrError):
    """No such container (or node); the id may be mistyped or the record aged out."""

    code = "not_found"
    status = 404


class Forbidden(GpumgrError):
    """The caller may not do this (a tenant acting for another, or asking above its priority)."""

    code = "forbidden"
    status = 403


class QuotaExceeded(GpumgrError):
    """The tenant's quota (GPU memory or containers) cannot take the request; the message says which and how much."""

    code = "quota_exceeded"
    status = 403


class NoFit(GpumgrError):
    """No ready GPU has enough schedulable free memory; free some or ask for less."""

    code = "no_fit"
    status = 409


class Conflict(GpumgrError):
    """The request conflicts with the cluster's current state (e.g. removing a node that is up); see the message."""

    code = "conflict"
    status = 409


class GpuConflict(GpumgrError):
    """A registering node reports a GPU that another live node already holds; one of the two agents must go."""

    code = "gpu_conflict"
    status = 409


NO_AGENTS = "no agent is ready to take containers; start one with 'gpumgr agent'"


class NoAgents(GpumgrError):
    """No agent is registered and ready; start one with ``gpumgr agent``."""

    code = "no_agents"
    status = 503


class AgentFailed(GpumgrError):
    """The agent answered but could not do it (e.g. Docker could not find the image)."""

    code = "agent_failed"
    status = 502


class AgentTimeout(GpumgrError):
    """The link's own timeout: a peer did not answer a request in time.

    It never reaches a REST client: what it means there is :class:`OutcomeUnknown` (the request went out
    and nobody knows whether it ran).
    """

    code = "agent_timeout"
    status = 504


class OutcomeUnknown(GpumgrError):
    """Nobody knows whether the request took effect: it was sent, and no answer came (a timeout, leadership
    lost, a forwarded call whose leader went away).

    Never retry blindly: look first (``GET /containers/<name>``), or resend with the same ``Idempotency-Key``,
    which runs it at most once.
    """

    code = "outcome_unknown"
    status = 502


class StoreUnavailable(GpumgrError):
    """The store (etcd, or the state directory's disk) could not take a write: nothing of the request was kept."""

    code = "store_unavailable"
    status = 503
    retry_after = 1


class RuntimeFailure(GpumgrError):
    """The agent's runtime (Docker or host processes) refused an operation."""

    code = "runtime_failed"


class PolicyDenied(GpumgrError):
    """The operator's policy does not allow what the request asks for; ``rule`` names the policy entry to change."""

    code = "policy_denied"
    status = 403
    #: how the agent writes the rule into its reply's message, so the manager can read it back
    MARK = " (rule {rule})"

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message)
        self.rule = rule

    def to_dict(self) -> dict[str, str]:
        """The JSON error body, with the policy rule that refused the request."""
        return {**super().to_dict(), "rule": self.rule}

    def wire_message(self) -> str:
        """The message with its rule, for the link's error shape (``code`` and ``message`` only)."""
        return self.message + self.MARK.format(rule=self.rule)

    @classmethod
    def from_wire(cls, message: str) -> PolicyDenied:
        """Read back what :meth:`wire_message` wrote (from an agent's reply)."""
        text, sep, rule = message.rpartition(" (rule ")
        if sep and rule.endswith(")"):
            return cls(text, rule=rule[:-1])
        return cls(message, rule="unknown")


class InProgress(GpumgrError):
    """A request with this ``Idempotency-Key`` is still being carried out; ask again in a moment for its answer."""

    code = "in_progress"
    status = 409
    retry_after = 1


class IdempotencyMismatch(GpumgrError):
    """This ``Idempotency-Key`` was used before with another request (body or route): use a new key for a new
    request."""

    code = "idempotency_mismatch"
    status = 422
