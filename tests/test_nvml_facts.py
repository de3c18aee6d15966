"""NVML's topology, compute capability and health as the agent reads them, through a fake binding.

No GPU is needed: the fake answers the calls ``agent.nvml_facts`` makes as a DGX-like machine would
(two NVLink islands of two GPUs, sockets of two, an NVSwitch box), and health events as the driver
delivers them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gpumgr.agent.gpus.nvml import NvmlSource
from gpumgr.wire import defaults
from tests.test_gpus import FakeNvml


class TopologyNvml(FakeNvml):
    """Four GPUs: NVLink joins 0-1 and 2-3 (links 0 and 1 of each), 0-1 and 2-3 are on two sockets."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, nvswitch: bool = False) -> None:
        super().__init__(count=4)
        self.compute = {i: [] for i in range(4)}
        self.mps = {i: [] for i in range(4)}
        self.nvswitch = nvswitch
        self.events: list[Any] = []
        self.pending = {i: 0 for i in range(4)}
        self.ecc = {i: 0 for i in range(4)}
        self.temperature = {i: 40 for i in range(4)}

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return 9, 0

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{0x10 + handle:02X}:00.0".encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, first: int, second: int) -> int:
        return 40 if first // 2 == second // 2 else 50  # NUMA node, else across sockets

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        return 1 if link < 2 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> SimpleNamespace:
        if self.nvswitch:
            return SimpleNamespace(busId=f"00000000:{0xA0 + link:02X}:00.0")
        partner = handle ^ 1
        return SimpleNamespace(busId=f"00000000:{0x10 + partner:02X}:00.0")

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: int, mask: int, events: str) -> None:
        assert mask == 8

    def nvmlEventSetWait(self, events: str, timeout: int) -> Any:
        if not self.events:
            raise self.NVMLError("Timeout")
        return self.events.pop(0)

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return self.pending[handle]

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        return self.ecc[handle]

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        if handle == 3:
            raise self.NVMLError("Not Supported")
        return self.temperature[handle]


def test_links_and_compute_capability_come_from_nvml() -> None:
    source = NvmlSource(TopologyNvml())
    devices = source.devices()
    assert [d.compute_capability for d in devices] == ["9.0"] * 4
    links = [dict(d.links) for d in devices]
    assert links[0] == {"GPU-real-1": "nvlink", "GPU-real-2": "system", "GPU-real-3": "system"}
    assert links[2] == {"GPU-real-0": "system", "GPU-real-1": "system", "GPU-real-3": "nvlink"}


def test_gpus_behind_nvswitches_are_all_joined_by_nvlink() -> None:
    devices = NvmlSource(TopologyNvml(nvswitch=True)).devices()
    assert all(set(dict(d.links).values()) == {"nvlink"} for d in devices)


def test_a_driver_without_topology_queries_reports_none() -> None:
    devices = NvmlSource(FakeNvml()).devices()
    assert [d.links for d in devices] == [(), ()] and [d.compute_capability for d in devices] == ["", ""]
    assert NvmlSource(FakeNvml()).health() == {"GPU-real-0": "", "GPU-real-1": ""}


def test_health_follows_xids_pages_ecc_and_heat(monkeypatch) -> None:
    monkeypatch.setattr(defaults, "GPU_HEALTH_INTERVAL", 0.0)
    fake = TopologyNvml()
    source = NvmlSource(fake)
    assert set(source.health().values()) == {""}
    fake.events = [SimpleNamespace(device=1, eventData=13),   # an application's fault: not the GPU's
                   SimpleNamespace(device=1, eventData=79)]   # fallen off the bus: fatal
    fake.pending[2], fake.ecc[3], fake.temperature[0] = 1, defaults.GPU_ECC_UNCORRECTED_LIMIT + 1, 95
    health = source.health()
    assert health["GPU-real-1"] == "fatal Xid 79 reported by the driver"
    assert "retired pages" in health["GPU-real-2"] and "uncorrected ECC" in health["GPU-real-3"]
    assert health["GPU-real-0"].startswith("temperature 95")
    fake.pending[2], fake.ecc[3], fake.temperature[0] = 0, 0, 50
    health = source.health()
    assert health["GPU-real-1"] and not health["GPU-real-0"] and not health["GPU-real-2"] \
        and not health["GPU-real-3"]  # an Xid holds until the agent restarts (after the GPU's reset)


def test_health_is_asked_once_an_interval() -> None:
    fake = TopologyNvml()
    source = NvmlSource(fake)
    source.health()
    fake.temperature[0] = 99
    assert source.health()["GPU-real-0"] == ""  # within GPU_HEALTH_INTERVAL: the last answer
