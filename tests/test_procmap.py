"""procmap reads container ids from every cgroup path shape in use, and stat lines with hostile names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpumgr.agent import procmap

ID = "0123456789abcdef" * 4
ID2 = "fedcba9876543210" * 4
POD = "pod0b9f3c2e-6c1a-4d3e-9b7a-2f1e0d9c8b7a"
FAKE_PID = 4242

CGROUP_SHAPES = {
    "v1 cgroupfs docker": (f"12:memory:/docker/{ID}\n11:cpu,cpuacct:/docker/{ID}\n1:name=systemd:/docker/{ID}\n"
                           f"0::/docker/{ID}\n", [ID]),
    "v1 some controllers at root": f"4:memory:/docker/{ID}\n3:cpuset:/\n0::/\n",
    "v2 systemd docker": f"0::/system.slice/docker-{ID}.scope\n",
    "v1 systemd docker": f"9:pids:/system.slice/docker-{ID}.scope\n1:name=systemd:/system.slice/docker-{ID}.scope\n",
    "nested docker": (f"0::/docker/{ID}/docker/{ID2}\n", [ID, ID2]),
    "nested, outer controllers shorter": (f"5:memory:/docker/{ID}\n0::/docker/{ID}/docker/{ID2}\n", [ID, ID2]),
    "kubepods cgroupfs": f"8:memory:/kubepods/besteffort/{POD}/{ID}\n",
    "kubepods systemd containerd": ("0::/kubepods.slice/kubepods-burstable.slice/"
                                    f"kubepods-burstable-pod0b9f3c2e_6c1a_4d3e.slice/cri-containerd-{ID}.scope\n"),
    "kubepods systemd cri-o": f"0::/kubepods.slice/kubepods-besteffort.slice/crio-{ID}.scope\n",
    "containerd.service with systemd driver": (f"3:memory:/system.slice/containerd.service/"
                                               f"kubepods-besteffort-pod0b9f3c2e.slice:cri-containerd:{ID}\n"),
    "containerd namespace": f"0::/default/{ID}\n",
    "moby": f"0::/moby/{ID}\n",
    "actions job": f"0::/actions_job/{ID}\n",
    "private cgroup namespace": f"0::/../../docker/{ID}\n",
}
NO_CONTAINER = {
    "host process v2": "0::/user.slice/user-1000.slice/session-2.scope\n",
    "host process v1": "4:memory:/\n1:name=systemd:/init.scope\n0::/\n",
    "containerd service itself": "0::/system.slice/containerd.service\n",
    "32-hex sandbox": "4:memory:/process_api/4241914649212c7e02e0dcdbb9cde652\n",
    "65 hex digits": f"0::/docker/{ID}a\n",
    "uppercase is not an id": f"0::/docker/{ID.upper()}\n",
    "empty file": "",
}


def _fake_proc(root: Path, pid: int, **files: str) -> str:
    directory = root / str(pid)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return str(root)


def _stat_line(pid: int, comm: str, start: int, stack: int) -> str:
    fields = ["S"] + [str(n) for n in range(4, 53)]
    fields[22 - 3], fields[28 - 3] = str(start), str(stack)
    return f"{pid} ({comm}) {' '.join(fields)}\n"


@pytest.mark.parametrize("shape", CGROUP_SHAPES, ids=list(CGROUP_SHAPES))
def test_container_ids_from_every_path_shape(tmp_path: Path, shape: str) -> None:
    case = CGROUP_SHAPES[shape]
    text, expected = case if isinstance(case, tuple) else (case, [ID])
    proc = _fake_proc(tmp_path, FAKE_PID, cgroup=text)
    assert procmap.container_ids_of(FAKE_PID, proc) == expected


@pytest.mark.parametrize("shape", NO_CONTAINER, ids=list(NO_CONTAINER))
def test_no_container_id(tmp_path: Path, shape: str) -> None:
    proc = _fake_proc(tmp_path, FAKE_PID, cgroup=NO_CONTAINER[shape])
    assert procmap.container_ids_of(FAKE_PID, proc) == []


def test_missing_process_has_no_ids_and_no_start_time(tmp_path: Path) -> None:
    assert procmap.container_ids_of(FAKE_PID, str(tmp_path)) == []
    assert procmap.start_time_of(FAKE_PID, str(tmp_path)) is None
    assert procmap.identity_of(FAKE_PID, str(tmp_path)) is None


@pytest.fixture(scope="module")
def scratch_proc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake proc root shared by Hypothesis examples, which cannot use function-scoped tmp_path."""
    return tmp_path_factory.mktemp("proc")


@given(st.text(max_size=300))
def test_arbitrary_cgroup_text_yields_only_ids(scratch_proc: Path, text: str) -> None:
    ids = procmap.container_ids_of(FAKE_PID, _fake_proc(scratch_proc, FAKE_PID, cgroup=text))
    assert all(len(i) == 64 and set(i) <= set("0123456789abcdef") for i in ids)
    assert len(ids) == len(set(ids))


# Separators start and end with a non-hex character, as every real path does around an id.
@given(st.lists(st.sampled_from(["/", "-", "/docker/", "/system.slice/docker-", ".scope/", ":cri-containerd:",
                                 "/kubepods/pod1/"]), min_size=2, max_size=6))
def test_ids_are_found_between_any_separators(scratch_proc: Path, separators: list[str]) -> None:
    ids = [f"{n:064x}" for n in range(1, len(separators))]
    path = separators[0] + "".join(i + sep for i, sep in zip(ids, separators[1:], strict=True))
    assert procmap.container_ids_of(FAKE_PID, _fake_proc(scratch_proc, FAKE_PID, cgroup=f"0::{path}\n")) == ids


@pytest.mark.parametrize("comm", ["sleep", "a) (b", "x) S 1 2 3 (y", "two words", ")"])
def test_start_time_survives_hostile_command_names(tmp_path: Path, comm: str) -> None:
    proc = _fake_proc(tmp_path, FAKE_PID, stat=_stat_line(FAKE_PID, comm, start=987654, stack=140000))
    assert procmap.start_time_of(FAKE_PID, proc) == 987654
    assert procmap.identity_of(FAKE_PID, proc) == (987654, comm, 140000)


@pytest.mark.parametrize("stat", ["", "4242 (truncated", "4242 (x) S 1 2\n", "4242 (x) " + "z " * 40])
def test_malformed_stat_reads_as_gone(tmp_path: Path, stat: str) -> None:
    proc = _fake_proc(tmp_path, FAKE_PID, stat=stat)
    assert procmap.start_time_of(FAKE_PID, proc) is None


def test_real_process() -> None:
    me = os.getpid()
    assert procmap.process_group_of(me) == os.getpgrp()
    assert procmap.start_time_of(me) == procmap.start_time_of(me) > 0
    assert isinstance(procmap.container_ids_of(me), list)
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert procmap.start_time_of(child.pid) >= procmap.start_time_of(me)
        assert procmap.identity_of(child.pid)[1] == "sleep"
        assert procmap.container_ids_of(child.pid) == procmap.container_ids_of(me)
    finally:
        child.kill()
        child.wait()


def test_exited_process_is_gone() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert procmap.process_group_of(child.pid) is None
    assert procmap.start_time_of(child.pid) is None
    assert procmap.container_ids_of(child.pid) == []
