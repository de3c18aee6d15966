"""Where the agent learns about its GPUs: NVML on a real machine, or a simulator anywhere else.

Both sources answer the same three questions (which GPUs, how full, which processes), so the rest
of the agent cannot tell a real GPU from a simulated one and the whole system runs in CI. This
module holds what both share; :mod:`gpumgr.agent.gpus.nvml` and :mod:`gpumgr.agent.gpus.simgpu` hold each source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SIM_PREFIX = "sim:"


class GpuSourceError(RuntimeError):
    """A GPU source could not answer, e.g. NVML lost a GPU; the caller should retry or report it."""


class NvmlUnavailable(GpuSourceError):
    """NVML was asked for but no NVIDIA driver answers, or it reports no GPU; use ``sim:SPEC`` instead."""


@dataclass(frozen=True)
class Device:
    """One GPU as the agent reports it; ``memory_total`` is in bytes."""

    uuid: str
    index: int
    name: str
    memory_total: int
    #: ``"9.0"``; "" when the source cannot tell
    compute_capability: str = ""
    #: how it is joined to each other GPU of the host: ``(uuid, link)`` pairs (``protocol.LINK_NAMES``)
    links: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class GpuProcess:
    """A host PID and the bytes it uses on one GPU."""

    pid: int
    used: int


class GpuSource(Protocol):
    """What the agent needs from GPUs. ``kind`` is ``"nvml"`` or ``"sim"``.

    ``memory_used`` is cheap and polled often; ``processes`` may be expensive and is polled less.
    Both raise ``KeyError`` for a uuid the source does not have; NVML failures raise
    ``GpuSourceError``.
    """

    kind: str

    def devices(self) -> list[Device]:
        """The GPUs of this source, fixed when it was opened, in index order."""
        ...

    def memory_used(self, uuid: str) -> int:
        """Bytes in use on GPU ``uuid`` right now."""
        ...

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Processes using GPU ``uuid`` right now, by host PID."""
        ...

    def memory_snapshot(self) -> dict[str, int]:
        """``memory_used`` of every GPU in one go, exact as of now."""
        ...

    def memory_poll(self) -> dict[str, int]:
        """Like ``memory_snapshot`` but as cheap as the source can make it: the enforcer's frequent poll.

        It may miss processes that started since the last ``process_snapshot`` and count ones that
        ended since; the enforcer only uses it to decide when to take the next full sample.
        """
        ...

    def process_snapshot(self) -> dict[str, list[GpuProcess]]:
        """``processes`` of every GPU in one go: the full sample."""
        ...

    def health(self) -> dict[str, str]:
        """Why each GPU is unhealthy now, by uuid ("" when healthy); see :mod:`gpumgr.agent.gpus.nvml_facts`."""
        ...

    def close(self) -> None:
        """Release what the source holds; it must not be used afterwards."""
        ...
