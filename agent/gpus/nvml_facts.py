"""What NVML says about GPUs beyond memory: compute capability, how GPUs are linked, and whether each is healthy.

**Topology.** Each pair of GPUs is joined by NVLink when one has an active NVLink whose remote end
is the other (or when both reach NVSwitches: all GPUs behind the switches are joined), else by the
closest PCIe ancestor ``nvmlDeviceGetTopologyCommonAncestor`` names: one board or switch
(``INTERNAL``, ``SINGLE``, ``MULTIPLE``) is ``pcie_switch``, one host bridge or NUMA node is
``socket``, anything further is ``system``.

**Health**, as the NVIDIA device plugin judges it: an Xid critical-error event whose Xid is not one
an application causes (``APPLICATION_XIDS``) makes a GPU unhealthy until the agent restarts (the
GPU needs a reset, after which the agent starts anew); so do retired pages pending, more than
``GPU_ECC_UNCORRECTED_LIMIT`` uncorrected volatile ECC errors, or a temperature at or over
``GPU_TEMPERATURE_LIMIT`` °C, while they last. A query this driver or GPU does not support counts
as healthy.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from gpumgr.wire import defaults

log = logging.getLogger(__name__)

#: Xids an application causes (bad memory access, its own faults): the device plugin ignores them too.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
#: NVML's common-ancestor levels → the link they mean.
ANCESTOR_LINKS = {0: "pcie_switch", 10: "pcie_switch", 20: "pcie_switch", 30: "socket", 40: "socket", 50: "system"}
NVLINK_MAX_LINKS = 36


def compute_capability(nvml: Any, handle: Any) -> str:
    """``"9.0"``, or "" when the driver cannot say."""
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except (AttributeError, nvml.NVMLError):
        return ""
    return f"{int(major)}.{int(minor)}"


def links(nvml: Any, handles: list[Any], uuids: list[str]) -> list[dict[str, str]]:
    """For each GPU (in ``handles``' order), its link to every other GPU by uuid; empty dicts when NVML cannot say."""
    if len(handles) < 2 or not hasattr(nvml, "nvmlDeviceGetTopologyCommonAncestor"):
        return [{} for _ in handles]
    found: list[dict[str, str]] = [{} for _ in handles]
    nvlinked = _nvlink_pairs(nvml, handles)
    for i, first in enumerate(handles):
        for j in range(i + 1, len(handles)):
            if (i, j) in nvlinked:
                link = "nvlink"
            else:
                try:
                    link = ANCESTOR_LINKS.get(int(nvml.nvmlDeviceGetTopologyCommonAncestor(first, handles[j])),
                                              "system")
                except nvml.NVMLError:
                    return [{} for _ in handles]  # no topology rather than a wrong one
            found[i][uuids[j]] = found[j][uuids[i]] = link
    return found


def _nvlink_pairs(nvml: Any, handles: list[Any]) -> set[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, joined by an active NVLink (directly, or both through NVSwitches)."""
    bus_of = {}
    for index, handle in enumerate(handles):
        try:
            bus_of[_bus(nvml.nvmlDeviceGetPciInfo(handle))] = index
        except (AttributeError, nvml.NVMLError):
            return set()
    pairs: set[tuple[int, int]] = set()
    switched: set[int] = set()
    for index, handle in enumerate(handles):
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                    continue
                remote = bus_of.get(_bus(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)))
            except (AttributeError, nvml.NVMLError):
                break  # no more links on this GPU (or no NVLink at all)
            if remote is None:
                switched.add(index)  # its far end is no GPU of ours: an NVSwitch
            elif remote != index:
                pairs.add((min(index, remote), max(index, remote)))
    pairs.update((i, j) for i in switched for j in switched if i < j)
    return pairs


def _bus(pci: Any) -> str:
    bus = pci.busId
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).lower().lstrip("0")


class Health:
    """Each GPU's health through NVML: Xid events waited for without blocking, the rest asked each check."""

    def __init__(self, nvml: Any, handles: dict[str, Any]) -> None:
        self._nvml, self._handles = nvml, handles
        #: uuid → the fatal Xid seen (sticky for this process's life)
        self._xids: dict[str, str] = {}
        self._events = self._register_events()

    def check(self) -> dict[str, str]:
        """uuid → why it is unhealthy now ("" when healthy)."""
        self._drain_events()
        return {uuid: self._xids.get(uuid) or self._state(handle) for uuid, handle in self._handles.items()}

    def close(self) -> None:
        """Free the event set."""
        if self._events is not None:
            with contextlib.suppress(AttributeError, self._nvml.NVMLError):
                self._nvml.nvmlEventSetFree(self._events)
            self._events = None

    def _register_events(self) -> Any:
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except (AttributeError, nvml.NVMLError):
            return None
        mask = getattr(nvml, "nvmlEventTypeXidCriticalError", 8)
        for uuid, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, mask, events)
            except nvml.NVMLError as exc:  # some GPUs (and vGPUs) do not deliver them: only the polled checks then
                log.info("GPU %s delivers no Xid events (%s)", uuid, exc)
        return events

    def _drain_events(self) -> None:
        nvml = self._nvml
        while self._events is not None:
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError:  # a timeout: no event waiting
                return
            xid = int(getattr(event, "eventData", 0))
            if xid in APPLICATION_XIDS:
                continue
            try:
                uuid = nvml.nvmlDeviceGetUUID(event.device)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except nvml.NVMLError:
                uuid = ""
            targets = [uuid] if uuid in self._handles else list(self._handles)  # unknown GPU: all, as the plugin does
            for target in targets:
                self._xids.setdefault(target, f"fatal Xid {xid} reported by the driver")
                log.warning("GPU %s reported fatal Xid %d: no new grants on it", target, xid)

    def _state(self, handle: Any) -> str:
        nvml = self._nvml
        pending = self._ask("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if pending is not None and int(pending) == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            return "retired pages are pending (the GPU needs a reset)"
        ecc = self._ask("nvmlDeviceGetTotalEccErrors", handle, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                        getattr(nvml, "NVML_VOLATILE_ECC", 0))
        if ecc is not None and int(ecc) > defaults.GPU_ECC_UNCORRECTED_LIMIT:
            return f"{int(ecc)} uncorrected ECC errors (limit {defaults.GPU_ECC_UNCORRECTED_LIMIT})"
        temperature = self._ask("nvmlDeviceGetTemperature", handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        if temperature is not None and int(temperature) >= defaults.GPU_TEMPERATURE_LIMIT:
            return f"temperature {int(temperature)}°C at or over the limit of {defaults.GPU_TEMPERATURE_LIMIT}°C"
        return ""

    def _ask(self, name: str, *args: Any) -> Any:
        call = getattr(self._nvml, name, None)
        if call is None:  # an old binding: nothing to judge by
            return None
        try:
            return call(*args)
        except self._nvml.NVMLError:  # not supported here: nothing to judge by
            return None
