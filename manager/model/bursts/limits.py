"""A grant's limit: checked against its request, and changed in place (``PATCH``).

``gpu_memory`` is what the map reserves; ``gpu_memory_limit`` is what the container may use while its GPU
has room, never below the request. Quotas and fair share count the request alone: nothing here reaches them.
"""

from __future__ import annotations

from dataclasses import replace

from gpumgr.manager.model.records import Container
from gpumgr.wire.errors import InvalidRequest
from gpumgr.wire.units import format_bytes


def is_burster(record: Container) -> bool:
    """Whether ``record``'s grant is burstable: its limit is above its grant."""
    return record.gpu_memory_limit > record.gpu_memory


def limit_of(memory: int, limit: int | None) -> int:
    """The limit to keep for a grant of ``memory`` asked with ``limit``: 0 (no burst) unless it is above ``memory``.

    Raises InvalidRequest (400) for a limit below the request.
    """
    if limit is None or limit == 0:
        return 0
    if limit < memory:
        raise InvalidRequest(f"gpu_memory_limit ({format_bytes(limit)}) is below gpu_memory ({format_bytes(memory)}): "
                             "the limit is what the container may use beyond its guaranteed request",
                             code="limit_below_request")
    return limit if limit > memory else 0


def change_limit(record: Container, memory: int, limit: int | None) -> int:
    """Give ``record`` the limit a resize to ``memory`` asks (``limit``; None keeps its own); return the one before.

    Raises InvalidRequest, changing nothing, when the limit would end below ``memory``.
    """
    before = record.gpu_memory_limit
    kept = limit_of(memory, before if limit is None else limit)
    if kept != before:
        record.spec = replace(record.spec, memory_limit=kept)
    return before


def restore_limit(record: Container, limit: int) -> None:
    """Put back the limit ``record`` had before a resize its node refused (or that was not accepted)."""
    if record.gpu_memory_limit != limit:
        record.spec = replace(record.spec, memory_limit=limit)
