"""GPU sources: spec parsing, simulated usage declared by real processes and containers, NVML logic."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumgr.agent import procmap
from gpumgr.agent.gpus import nvml, simgpu
from gpumgr.agent.gpus import select as gpus
from gpumgr.agent.gpus.nvml import NvmlSource
from gpumgr.agent.gpus.simgpu import SimSource
from gpumgr.agent.gpus.source import Device, GpuProcess, GpuSourceError, NvmlUnavailable
from gpumgr.wire import defaults
from tests.procs import wait_for

GIB = 1024**3
FOREIGN_UUID = "GPU-00000000-0000-0000-0000-000000000000"

Spawn = Callable[..., subprocess.Popen]


# --- spec parsing ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "expected"), [
    ("2x24GiB", [(24 * GIB, "Simulated GPU")] * 2),
    ("sim:2x24GiB", [(24 * GIB, "Simulated GPU")] * 2),
    ("1x8GiB,1x24GiB", [(8 * GIB, "Simulated GPU"), (24 * GIB, "Simulated GPU")]),
    ("4x80GiB:H100", [(80 * GIB, "H100")] * 4),
    ("1x8G:NVIDIA A10, 2 x 512MiB", [(8 * 1000**3, "NVIDIA A10")] + [(512 * 1024**2, "Simulated GPU")] * 2),
    ("1X1024", [(1024, "Simulated GPU")]),
])
def test_good_specs(spec: str, expected: list[tuple[int, str]]) -> None:
    devices = simgpu.parse_sim_spec(spec, "node-a")
    assert [(d.memory_total, d.name) for d in devices] == expected
    assert [d.index for d in devices] == list(range(len(expected)))


@pytest.mark.parametrize("spec", [
    "", "sim:", "  ", "x24GiB", "0x8GiB", "2x", "2x0", "2x-1GiB", "2xlots", "2x24GiB,", ",2x24GiB",
    "2x24GiB:", "2x24GiB:  ", "twox8GiB", "2x1.5B", "2*24GiB", "2x24GiB;1x8GiB", f"{defaults.MAX_SIM_DEVICES + 1}x1GiB",
])
def test_bad_specs_raise_value_error(spec: str) -> None:
    with pytest.raises(ValueError, match=r"\S"):
        simgpu.parse_sim_spec(spec, "node-a")


NAMES = st.text(st.characters(blacklist_characters=",:;@", blacklist_categories=("Cs",)), min_size=1,
               max_size=12)  # issue 23: ";" and "@" separate options and compute capability
ITEMS = st.tuples(st.integers(1, 4), st.integers(1, 1 << 42), st.none() | NAMES.filter(str.strip))


@given(st.lists(ITEMS, min_size=1, max_size=5), st.text(max_size=20))
def test_generated_specs_round_trip(items: list[tuple[int, int, str | None]], seed: str) -> None:
    spec = ",".join(f"{count}x{size}" + (f":{name}" if name else "") for count, size, name in items)
    devices = simgpu.parse_sim_spec(spec, seed)
    expected = [(size, name.strip() if name else "Simulated GPU") for count, size, name in items for _ in range(count)]
    assert [(d.memory_total, d.name) for d in devices] == expected
    assert [d.index for d in devices] == list(range(len(devices)))
    assert len({d.uuid for d in devices}) == len(devices)


@given(st.text(max_size=40))
def test_any_text_parses_or_raises_value_error(spec: str) -> None:
    try:
        devices = simgpu.parse_sim_spec(spec, "seed")
    except ValueError:
        return
    assert devices and all(d.memory_total > 0 for d in devices)


def test_uuids_are_stable_per_seed_and_unique_across_seeds() -> None:
    first = simgpu.parse_sim_spec("3x8GiB", "node-a")
    assert [d.uuid for d in first] == [d.uuid for d in simgpu.parse_sim_spec("1x1GiB,2x80GiB:H100", "node-a")]
    other = simgpu.parse_sim_spec("3x8GiB", "node-b")
    assert not {d.uuid for d in first} & {d.uuid for d in other}
    for device in first:
        assert device.uuid.startswith("GPU-")
        assert str(uuidlib.UUID(device.uuid[4:])) == device.uuid[4:]
    assert first[0].uuid == "GPU-" + str(uuidlib.uuid5(simgpu.SIM_UUID_NAMESPACE, "node-a/0"))


def test_open_source_choices() -> None:
    source = gpus.open_source("sim:1x8GiB", "node-a")
    assert source.kind == "sim"
    assert source.devices() == simgpu.parse_sim_spec("1x8GiB", "node-a")
    source.close()
    for bad in ("", "gpu", "sim", "simulated:2x8GiB", "sim:2x"):
        with pytest.raises(ValueError):
            gpus.open_source(bad, "node-a")


def test_auto_falls_back_to_the_default_simulation_without_a_driver() -> None:
    _skip_if_driver()
    source = gpus.open_source("auto", "node-a")
    assert source.kind == "sim"
    assert source.devices() == simgpu.parse_sim_spec(defaults.SIM_SPEC, "node-a")
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver"):
        gpus.open_source("nvml", "node-a")


@pytest.mark.parametrize(("data", "expected"), [
    (b"12345", [12345]), (b"12345\n", [12345]), (b" 10 , 20 ,0\n", [10, 20, 0]), (b"0", [0]),
    (b"", []), (b"\n", []), (b"lots", []), (b"12abc", []), (b"-3", []), (b"1,,2", []), (b"1.5", []),
    (b"\xff\xfe", []), ("\u00b2".encode(), []),
])
def test_parse_usage(data: bytes, expected: list[int]) -> None:
    assert simgpu.parse_usage(data) == expected


# --- simulated usage of real processes ------------------------------------------------------------

class ProcView:
    """A proc root listing only chosen real processes, so other processes on the host cannot interfere."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def add(self, pid: int) -> None:
        """Show ``pid`` and its descendants (as they are now) through this view."""
        link = self.root / str(pid)
        if not link.exists():
            link.symlink_to(f"/proc/{pid}")
        for child in _children(pid):
            self.add(child)


def _wait_exec_done(pid: int) -> None:
    """Popen returns while the kernel may still be finishing exec (empty cmdline); wait that out."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes():
                return
        except OSError:
            return
        time.sleep(0.001)


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start real processes with a given environment; kills and reaps all of them afterwards."""
    started: list[subprocess.Popen] = []

    def start(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
        process = subprocess.Popen(args, env={"PATH": os.environ["PATH"], **env}, start_new_session=True, **kw)
        started.append(process)
        _wait_exec_done(process.pid)
        return process

    yield start
    for process in started:
        _kill(process)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


@pytest.fixture
def devices() -> list[Device]:
    """Two GPUs whose uuids no other test or process on this host uses."""
    return simgpu.parse_sim_spec("2x24GiB", f"test-{uuidlib.uuid4()}")


@pytest.fixture
def view(tmp_path: Path) -> ProcView:
    return ProcView(tmp_path / "proc")


@pytest.fixture
def source(view: ProcView, devices: list[Device]) -> Iterator[SimSource]:
    sim = SimSource(devices, proc=str(view.root))
    yield sim
    sim.close()


def _usage_file(tmp_path: Path, content: str = "4096") -> Path:
    path = tmp_path / f"use-{uuidlib.uuid4().hex}"
    path.write_text(content)
    return path


def _snapshot(source: SimSource) -> dict[int, list[GpuProcess]]:
    return {d.index: source.processes(d.uuid) for d in source.devices()}


def test_usage_file_charges_the_visible_gpu(tmp_path, spawn, view, source, devices) -> None:
    use = _usage_file(tmp_path, "4096\n")
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(use), simgpu.NVIDIA_VISIBLE_ENV: devices[1].uuid})
    view.add(sleeper.pid)
    assert _snapshot(source) == {0: [], 1: [GpuProcess(sleeper.pid, 4096)]}
    assert source.memory_used(devices[1].uuid) == 4096
    assert source.memory_used(devices[0].uuid) == 0


def test_usage_follows_the_file(tmp_path, spawn, view, source, devices) -> None:
    use = _usage_file(tmp_path, "100")
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(use)})
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 100
    use.write_text(str(5 * GIB))
    assert source.processes(devices[0].uuid) == [GpuProcess(sleeper.pid, 5 * GIB)]
    replacement = use.with_name("replacement")
    replacement.write_text("7")
    replacement.replace(use)
    assert source.memory_used(devices[0].uuid) == 7
    use.unlink()
    assert source.memory_used(devices[0].uuid) == 0


def test_exited_processes_vanish(tmp_path, spawn, view, source, devices) -> None:
    use = _usage_file(tmp_path)
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(use)})
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 4096
    sleeper.kill()
    sleeper.wait()
    assert source.processes(devices[0].uuid) == []
    assert source.memory_used(devices[0].uuid) == 0


def test_unreaped_process_uses_nothing(tmp_path, spawn, view, source, devices) -> None:
    use = _usage_file(tmp_path)
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(use)})
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 4096
    sleeper.kill()
    wait_for(lambda: Path(f"/proc/{sleeper.pid}/stat").read_text().split(")")[-1].split()[0] == "Z", what="zombie")
    assert source.memory_used(devices[0].uuid) == 0


def test_shell_and_child_sharing_a_file_count_once(tmp_path, spawn, view, source, devices) -> None:
    use = tmp_path / "use"
    # The trailing ':' keeps the shell from exec'ing sleep, so two processes share the environment.
    shell = spawn(["sh", "-c", f"echo 100 > {use}; sleep 30; :"], {simgpu.SIM_USAGE_ENV: str(use)})
    child = wait_for(lambda: use.exists() and _children(shell.pid), what="the shell's child")[0]
    view.add(shell.pid)
    assert sorted(int(p.name) for p in view.root.iterdir()) == [shell.pid, child]
    assert source.processes(devices[0].uuid) == [GpuProcess(min(shell.pid, child), 100)]
    assert source.memory_used(devices[0].uuid) == 100
    os.kill(shell.pid, signal.SIGKILL)
    shell.wait()
    assert source.processes(devices[0].uuid) == [GpuProcess(child, 100)]
    os.kill(child, signal.SIGKILL)


VISIBILITY = {
    "nvidia uuid": ({"NVIDIA_VISIBLE_DEVICES": "{uuid1}"}, 1),
    "nvidia index": ({"NVIDIA_VISIBLE_DEVICES": "1"}, 1),
    "nvidia all": ({"NVIDIA_VISIBLE_DEVICES": "all"}, 0),
    "nvidia wins over cuda": ({"NVIDIA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}, 1),
    "empty nvidia falls back to cuda": ({"NVIDIA_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}, 1),
    "foreign entries ignored": ({"NVIDIA_VISIBLE_DEVICES": f"{FOREIGN_UUID},7, {{uuid1}}"}, 1),
    "cuda index": ({"CUDA_VISIBLE_DEVICES": "1"}, 1),
    "cuda uuid": ({"CUDA_VISIBLE_DEVICES": "{uuid1}"}, 1),
    "default index 0": ({}, 0),
    "nvidia none": ({"NVIDIA_VISIBLE_DEVICES": "none"}, None),
    "nvidia void": ({"NVIDIA_VISIBLE_DEVICES": "void"}, None),
    "only foreign gpus": ({"NVIDIA_VISIBLE_DEVICES": f"{FOREIGN_UUID},2"}, None),
    "cuda hides all": ({"CUDA_VISIBLE_DEVICES": ""}, None),
}


@pytest.mark.parametrize("case", VISIBILITY, ids=list(VISIBILITY))
def test_which_gpu_a_process_sees(tmp_path, spawn, view, source, devices, case: str) -> None:
    template, index = VISIBILITY[case]
    env = {key: value.replace("{uuid1}", devices[1].uuid) for key, value in template.items()}
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, "777")), **env})
    view.add(sleeper.pid)
    expected = {0: [], 1: []}
    if index is not None:
        expected[index] = [GpuProcess(sleeper.pid, 777)]
    assert _snapshot(source) == expected


@pytest.mark.parametrize(("visible", "content", "expected"), [
    ("1,0", "10,20", {0: 20, 1: 10}),
    ("all", "5,6", {0: 5, 1: 6}),
    ("all", "5", {0: 5, 1: 0}),
    ("0", "5,6,7", {0: 5, 1: 0}),
    (f"{FOREIGN_UUID},1", "3,4", {0: 0, 1: 3}),
    ("0,1", "0,9", {0: 0, 1: 9}),
])
def test_one_number_per_visible_gpu(tmp_path, spawn, view, source, devices, visible, content, expected) -> None:
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, content)),
                                      simgpu.NVIDIA_VISIBLE_ENV: visible})
    view.add(sleeper.pid)
    assert {d.index: source.memory_used(d.uuid) for d in devices} == expected
    for device in devices:
        assert source.processes(device.uuid) == ([GpuProcess(sleeper.pid, expected[device.index])]
                                                 if expected[device.index] else [])


@pytest.mark.parametrize("content", ["lots", "", "12abc", "-3", "1,,2", "9" * 5000])
def test_garbage_usage_file_counts_as_nothing(tmp_path, spawn, view, source, devices, content) -> None:
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, content))})
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 0
    assert source.processes(devices[0].uuid) == []


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo"])
def test_unreadable_usage_file_counts_as_nothing_and_never_blocks(tmp_path, spawn, view, source, devices,
                                                                   kind) -> None:
    path = tmp_path / "use"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(path)})
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 0


def test_relative_path_is_read_from_the_process_cwd(tmp_path, spawn, view, source, devices) -> None:
    (tmp_path / "use").write_text("55")
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: "use"}, cwd=tmp_path)
    view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 55


def test_process_that_execs_into_a_simulated_one_is_noticed(tmp_path, spawn, view, source, devices) -> None:
    use = _usage_file(tmp_path, "321")
    shell = spawn(["sh", "-c", f"read go; exec env {simgpu.SIM_USAGE_ENV}={use} sleep 30"], {}, stdin=subprocess.PIPE)
    view.add(shell.pid)
    assert source.memory_used(devices[0].uuid) == 0
    shell.stdin.write(b"go\n")
    shell.stdin.close()
    wait_for(lambda: procmap.identity_of(shell.pid)[1] == "sleep", what="exec into sleep")
    assert source.processes(devices[0].uuid) == [GpuProcess(shell.pid, 321)]


def test_poll_rereads_known_processes_and_leaves_discovery_to_snapshots(tmp_path, spawn, view, source,
                                                                       devices) -> None:
    first_use = _usage_file(tmp_path, "100")
    first = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(first_use)})
    view.add(first.pid)
    assert source.memory_poll()[devices[0].uuid] == 0  # nothing snapshotted yet: the poll does not list proc
    source.process_snapshot()
    assert source.memory_poll()[devices[0].uuid] == 100
    first_use.write_text(str(3 * GIB))  # rewritten in place
    assert source.memory_poll()[devices[0].uuid] == 3 * GIB
    replacement = first_use.with_name("replacement")
    replacement.write_text("200")
    replacement.replace(first_use)  # replaced by rename: the next snapshot opens the new file
    assert source.memory_poll()[devices[0].uuid] == 3 * GIB
    assert source.memory_snapshot()[devices[0].uuid] == 200
    assert source.memory_poll()[devices[0].uuid] == 200
    second = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, "5"))})
    view.add(second.pid)
    assert source.memory_poll()[devices[0].uuid] == 200
    assert source.memory_snapshot()[devices[0].uuid] == 205
    assert source.memory_poll()[devices[0].uuid] == 205


def test_usage_files_are_closed_when_their_process_goes(tmp_path, spawn, view, source, devices) -> None:
    def open_usage_files() -> int:
        return sum(os.readlink(fd.path).startswith(str(tmp_path)) for fd in os.scandir("/proc/self/fd")
                   if fd.is_symlink())

    sleepers = [spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, "10"))}) for _ in range(3)]
    for sleeper in sleepers:
        view.add(sleeper.pid)
    assert source.memory_used(devices[0].uuid) == 30
    assert open_usage_files() == 3
    _kill(sleepers[0])
    assert source.memory_used(devices[0].uuid) == 20
    assert open_usage_files() == 2
    source.close()
    assert open_usage_files() == 0


def test_concurrent_callers_agree(tmp_path, spawn, view, source, devices) -> None:
    sleepers = [spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(_usage_file(tmp_path, "10"))}) for _ in range(5)]
    for sleeper in sleepers:
        view.add(sleeper.pid)
    results: list[int] = []

    def poll() -> None:
        results.extend(source.memory_used(devices[0].uuid) for _ in range(20))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [50] * 80


def test_unknown_gpu_is_a_key_error(source: SimSource) -> None:
    for name in (FOREIGN_UUID, "0"):
        with pytest.raises(KeyError):
            source.memory_used(name)
        with pytest.raises(KeyError):
            source.processes(name)


def test_real_proc_sees_a_host_process(tmp_path, spawn, devices) -> None:
    sim = SimSource(devices)
    use = _usage_file(tmp_path, "2048")
    sleeper = spawn(["sleep", "30"], {simgpu.SIM_USAGE_ENV: str(use), simgpu.CUDA_VISIBLE_ENV: devices[1].uuid})
    assert GpuProcess(sleeper.pid, 2048) in sim.processes(devices[1].uuid)
    assert sim.memory_used(devices[1].uuid) >= 2048
    sleeper.kill()
    sleeper.wait()
    assert sleeper.pid not in {p.pid for p in sim.processes(devices[1].uuid)}
    sim.close()


@pytest.mark.docker
def test_container_usage_and_owner(docker_client, test_image, devices) -> None:
    sim = SimSource(devices)
    uuid = devices[1].uuid
    # Written at the image root because a minimal image need not have /tmp.
    container = docker_client.containers.run(
        test_image, ["sh", "-c", "echo 12345 > /gpumgr-use; sleep 30"], detach=True, network_mode="none",
        environment={simgpu.SIM_USAGE_ENV: "/gpumgr-use", simgpu.NVIDIA_VISIBLE_ENV: uuid})
    try:
        found = wait_for(lambda: [p for p in sim.processes(uuid) if container.id in procmap.container_ids_of(p.pid)],
                         what="the container's usage")
        assert [p.used for p in found] == [12345]
        assert sim.memory_used(uuid) >= 12345
    finally:
        container.remove(force=True)
        sim.close()


# --- NVML -----------------------------------------------------------------------------------------

class FakeNvml:
    """Just enough of pynvml to drive NvmlSource's logic without a GPU."""

    class NVMLError(Exception):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    class NVMLLibraryMismatchError(Exception):
        pass

    def __init__(self, count: int = 2, init_fails: bool = False) -> None:
        self.count, self.init_fails, self.shutdowns = count, init_fails, 0
        self.compute: dict[int, list[Any]] = {0: [_nvml_proc(10, 100), _nvml_proc(11, None)], 1: []}
        self.mps: dict[int, list[Any]] = {0: [_nvml_proc(10, 40), _nvml_proc(12, 7)], 1: []}
        self.lost = False

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-real-{handle}".encode()

    def nvmlDeviceGetName(self, handle: int) -> bytes | str:
        return b"NVIDIA H100" if handle == 0 else "NVIDIA A10"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        if self.lost:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(total=80 * GIB, used=3 * GIB + handle, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        raise self.NVMLLibraryMismatchError("old driver")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: int) -> list[Any]:
        return self.compute[handle]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: int) -> list[Any]:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return self.mps[handle]


def _nvml_proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


def test_nvml_devices_usage_and_processes() -> None:
    fake = FakeNvml()
    source = NvmlSource(fake)
    assert source.kind == "nvml"
    assert source.devices() == [Device("GPU-real-0", 0, "NVIDIA H100", 80 * GIB),
                                Device("GPU-real-1", 1, "NVIDIA A10", 80 * GIB)]
    assert source.memory_used("GPU-real-1") == 3 * GIB + 1
    assert source.processes("GPU-real-0") == [GpuProcess(10, 100), GpuProcess(11, 0), GpuProcess(12, 7)]
    assert source.processes("GPU-real-1") == []
    with pytest.raises(KeyError):
        source.processes("GPU-nope")
    source.close()
    source.close()
    assert fake.shutdowns == 1


def test_nvml_not_available_value_counts_as_zero() -> None:
    fake = FakeNvml()
    fake.compute[0] = [_nvml_proc(10, nvml.NVML_VALUE_NOT_AVAILABLE)]
    fake.mps[0] = []
    assert NvmlSource(fake).processes("GPU-real-0") == [GpuProcess(10, 0)]


def test_nvml_failures() -> None:
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver"):
        NvmlSource(FakeNvml(init_fails=True))
    empty = FakeNvml(count=0)
    with pytest.raises(NvmlUnavailable, match="no GPU"):
        NvmlSource(empty)
    assert empty.shutdowns == 1
    fake = FakeNvml()
    source = NvmlSource(fake)
    fake.lost = True
    with pytest.raises(GpuSourceError, match="GPU-real-0"):
        source.memory_used("GPU-real-0")


@pytest.mark.gpu
def test_real_nvml() -> None:
    try:
        source = NvmlSource()
    except NvmlUnavailable as exc:
        if os.environ.get("GPUMGR_REQUIRE_GPU") == "1":
            pytest.fail(f"{exc}, and GPUMGR_REQUIRE_GPU=1 forbids skipping")
        pytest.skip(str(exc))
    try:
        assert source.devices()
        for device in source.devices():
            assert device.uuid.startswith(("GPU-", "MIG-"))
            assert 0 <= source.memory_used(device.uuid) <= device.memory_total
            assert all(p.pid > 0 and p.used >= 0 for p in source.processes(device.uuid))
    finally:
        source.close()


def _skip_if_driver() -> None:
    try:
        NvmlSource().close()
    except NvmlUnavailable:
        return
    pytest.skip("an NVIDIA driver answers here")
