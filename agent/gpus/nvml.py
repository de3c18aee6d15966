"""Real GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``): devices, memory and compute processes."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pynvml

from gpumgr.agent.gpus import nvml_facts
from gpumgr.agent.gpus.source import Device, GpuProcess, GpuSourceError, NvmlUnavailable
from gpumgr.wire import defaults

NVML_COMPUTE_QUERIES = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2")
NVML_MPS_QUERIES = ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2")
#: NVML's "not available" marker for per-process memory (older bindings pass it through raw).
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


class NvmlSource:
    """Real GPUs through NVML. Raises ``NvmlUnavailable`` when no driver answers or it sees no GPU.

    ``nvml`` is the binding module (``pynvml``); it is a parameter so the logic can be tested
    without a GPU.
    """

    kind = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = pynvml if nvml is None else nvml
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise NvmlUnavailable(f"no NVIDIA driver answers through NVML ({exc}); use --gpus sim:SPEC") from exc
        self._open = True
        self._health: nvml_facts.Health | None = None
        try:
            self._handles, self._devices = self._discover()
            self._health = nvml_facts.Health(self._nvml, self._handles)
        except BaseException:
            self.close()
            raise
        self._checked_at, self._checked = -defaults.GPU_HEALTH_INTERVAL, {d.uuid: "" for d in self._devices}

    def devices(self) -> list[Device]:
        """The GPUs NVML reported when the source was opened."""
        return list(self._devices)

    def memory_used(self, uuid: str) -> int:
        """Device-level used bytes, including memory no listed process accounts for."""
        handle = self._handles[uuid]
        with self._guard(f"a query of GPU {uuid}"):
            return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def processes(self, uuid: str) -> list[GpuProcess]:
        """Compute processes and MPS clients on ``uuid``, merged by PID keeping the larger figure.

        A PID NVML lists twice (e.g. in both lists) is counted once; memory NVML cannot attribute
        (``None``) counts as 0.
        """
        handle = self._handles[uuid]
        merged: dict[int, int] = {}
        for entry in self._query(NVML_COMPUTE_QUERIES, handle, uuid) + self._query_mps(handle, uuid):
            merged[entry.pid] = max(merged.get(entry.pid, 0), _nvml_bytes(entry.usedGpuMemory))
        return [GpuProcess(pid, used) for pid, used in sorted(merged.items())]

    def memory_snapshot(self) -> dict[str, int]:
        """Used bytes of every GPU (one cheap memory query each)."""
        return {d.uuid: self.memory_used(d.uuid) for d in self._devices}

    def memory_poll(self) -> dict[str, int]:
        """The same as ``memory_snapshot``: NVML's memory query already is the cheap one."""
        return self.memory_snapshot()

    def process_snapshot(self) -> dict[str, list[GpuProcess]]:
        """Processes of every GPU (the expensive per-process queries)."""
        return {d.uuid: self.processes(d.uuid) for d in self._devices}

    def health(self) -> dict[str, str]:
        """Why each GPU is unhealthy (see :mod:`gpumgr.agent.gpus.nvml_facts`); asked of NVML once a health interval."""
        now = time.monotonic()
        if self._health is not None and now - self._checked_at >= defaults.GPU_HEALTH_INTERVAL:
            self._checked_at = now
            with self._guard("a health check"):
                self._checked = self._health.check()
        return dict(self._checked)

    def close(self) -> None:
        """Shut NVML down once; later calls do nothing."""
        if self._open:
            self._open = False
            if self._health is not None:
                self._health.close()
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()

    def _discover(self) -> tuple[dict[str, Any], list[Device]]:
        with self._guard("device discovery"):
            count = self._nvml.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("the NVIDIA driver answers but reports no GPU; use --gpus sim:SPEC")
            handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            devices = [self._describe(i, handle) for i, handle in enumerate(handles)]
            joined = nvml_facts.links(self._nvml, handles, [d.uuid for d in devices])
        devices = [replace(d, links=tuple(sorted(j.items()))) for d, j in zip(devices, joined, strict=True)]
        return {d.uuid: h for d, h in zip(devices, handles, strict=True)}, devices

    def _describe(self, index: int, handle: Any) -> Device:
        uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        name = _text(self._nvml.nvmlDeviceGetName(handle))
        return Device(uuid, index, name, int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total),
                      nvml_facts.compute_capability(self._nvml, handle))

    def _query(self, names: tuple[str, ...], handle: Any, uuid: str) -> list[Any]:
        """Call the newest of ``names`` this driver has; older drivers lack the newer entry points."""
        missing = _missing_function_errors(self._nvml)
        for name in names:
            call: Callable[[Any], list[Any]] | None = getattr(self._nvml, name, None)
            if call is None:
                continue
            with self._guard(f"a query of GPU {uuid}"):
                try:
                    return list(call(handle))
                except missing:
                    continue
        return []

    def _query_mps(self, handle: Any, uuid: str) -> list[Any]:
        # Many GPUs and drivers answer "not supported" for MPS; that only means there are no clients.
        try:
            return self._query(NVML_MPS_QUERIES, handle, uuid)
        except GpuSourceError:
            return []

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._nvml.NVMLError as exc:
            raise GpuSourceError(f"NVML failed during {what}: {exc}") from exc


def _missing_function_errors(nvml: Any) -> tuple[type[BaseException], ...]:
    names = ("NVMLError_FunctionNotFound", "NVMLLibraryMismatchError")
    return tuple(error for name in names if isinstance(error := getattr(nvml, name, None), type))


def _nvml_bytes(value: int | None) -> int:
    return 0 if value is None or value >= NVML_VALUE_NOT_AVAILABLE else int(value)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value

