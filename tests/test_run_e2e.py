"""The container spec on a real engine: mounts, limits and namespaces as ``docker inspect`` shows them, the output
read back over the link, waiting for the end, signals, auto-remove, and the node's own policy (issue 19).

Real ``gpumgr manager`` and ``gpumgr agent`` processes, a real Docker engine, simulated GPUs.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.procs import AgentProc, ManagerProc, remove_containers_of, wait_for

GiB = 1 << 30
#: A node name of this process's own: the engine is shared, and other runs clean up their nodes' containers.
NODE = f"run-{os.getpid()}"


@pytest.fixture
def own_containers(docker_client):
    """Remove what this module's nodes leave in the engine, and only that (the engine is shared)."""
    yield
    remove_containers_of(docker_client, NODE, NODE + "-strict")


@pytest.fixture
def docker_agent(tmp_path, manager, test_image, own_containers):
    """One agent with two simulated 24 GiB GPUs on the Docker runtime, under a node name no other run uses."""
    proc = AgentProc(tmp_path, manager, NODE)
    yield proc
    proc.stop()


def wait_end(manager: ManagerProc, cid: str) -> dict:
    response = manager.post(f"/v1/containers/{cid}/wait", params={"timeout": 30})
    assert response.status_code == 200, response.text
    assert response.json()["ended"], response.json()
    return response.json()


def shared_dir(tmp_path: Path) -> Path:
    """A host folder any container user can read, holding one file."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "hello").write_text("hello from the host\n")
    for path in (tmp_path, folder):
        path.chmod(0o755)
    (folder / "hello").chmod(0o644)
    return folder


def test_the_spec_reaches_the_engine_as_asked(manager, docker_agent, docker_client, test_image, tmp_path) -> None:
    data = shared_dir(tmp_path)
    script = ("cat hello; touch /data/new || echo cannot-write; df -k /dev/shm | tail -1; id -u; "
              "echo nofile-$(ulimit -n); exit 3")
    body = {"image": test_image, "gpu_memory": "1GiB", "volumes": [f"{data}:/data:ro"], "shm_size": "1g",
            "working_dir": "/data", "user": "1000:1000", "entrypoint": ["sh", "-c"], "command": [script],
            "mounts": [{"type": "tmpfs", "target": "/scratch"}], "nano_cpus": 500_000_000, "mem_limit": "256m",
            "ulimits": [{"name": "nofile", "soft": 512, "hard": 1024}], "cap_add": ["SYS_PTRACE"],
            "stop_signal": "SIGINT", "ipc_mode": "shareable"}
    created = manager.post("/v1/containers", json=body)
    assert created.status_code == 201, created.text
    record = created.json()
    attrs = docker_client.api.inspect_container(record["container_id"])
    host, config = attrs["HostConfig"], attrs["Config"]
    assert host["ShmSize"] == 2**30 and host["NanoCpus"] == 500_000_000 and host["Memory"] == 256 * 2**20
    assert config["WorkingDir"] == "/data" and config["User"] == "1000:1000" and config["Entrypoint"] == ["sh", "-c"]
    assert config["StopSignal"] == "SIGINT" and host["IpcMode"] == "shareable" and host["CapAdd"] == ["SYS_PTRACE"]
    # (memlock=-1, as NVIDIA's images run, needs an engine allowed to raise limits; this one may not be)
    assert host["Ulimits"] == [{"Name": "nofile", "Soft": 512, "Hard": 1024}]
    mounts = {m["Destination"]: m for m in attrs["Mounts"]}
    assert mounts["/data"]["Source"] == os.path.realpath(data) and mounts["/data"]["RW"] is False
    assert mounts["/scratch"]["Type"] == "tmpfs"
    assert host["NetworkMode"] == "none"  # the node's default, as no network was asked for

    end = wait_end(manager, record["id"])
    assert (end["state"], end["exit_code"]) == ("exited", 3)
    out = manager.get(f"/v1/containers/{record['id']}/logs").text
    assert "hello from the host" in out and "cannot-write" in out and "1000" in out and "nofile-512" in out
    assert " 1048576 " in out  # /dev/shm of 1g (2^30 bytes, as docker run reads it) in KiB, as df shows it
    assert not (data / "new").exists()


def test_output_streams_by_stream_and_follow_ends_with_the_container(manager, docker_agent, test_image) -> None:
    script = "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.3; done; exit 0"
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                  "command": ["sh", "-c", script]}).json()
    response = manager.get(f"/v1/containers/{record['id']}/logs", params={"follow": "1"},
                           headers={"Accept": "application/vnd.docker.multiplexed-stream"}, stream=True)
    assert response.status_code == 200
    raw = response.raw.read()  # returns only once the container ended and its last lines were sent
    frames, offset = [], 0
    while offset < len(raw):
        stream, size = struct.unpack(">BxxxI", raw[offset:offset + 8])
        frames.append((stream, raw[offset + 8:offset + 8 + size]))
        offset += 8 + size
    assert [d for s, d in frames if s == 1] == [b"out1\n", b"out2\n", b"out3\n"]
    assert [d for s, d in frames if s == 2] == [b"err1\n", b"err2\n", b"err3\n"]
    assert manager.get(f"/v1/containers/{record['id']}").json()["state"] == "exited"
    tail = manager.get(f"/v1/containers/{record['id']}/logs", params={"tail": "2"}).text
    assert sorted(tail.splitlines()) == ["err3", "out3"]


def test_a_long_output_comes_whole_across_many_pieces(manager, docker_agent, test_image) -> None:
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                  "command": ["sh", "-c", "seq 1 250000"]}).json()
    wait_end(manager, record["id"])
    lines = manager.get(f"/v1/containers/{record['id']}/logs").text.splitlines()
    assert lines == [str(i) for i in range(1, 250001)]  # 1.6 MB: more than one piece, nothing lost or twice


def test_a_signal_reaches_the_container_and_wait_gives_its_exit(manager, docker_agent, test_image) -> None:
    script = "trap 'echo got-int; exit 130' INT; echo ready; while :; do sleep 0.1; done"
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB", "name": "sig-test",
                                                  "command": ["sh", "-c", script]}).json()
    wait_for(lambda: "ready" in manager.get("/v1/containers/sig-test/logs").text, 10, what="the trap set")
    assert manager.post("/v1/containers/sig-test/kill", params={"signal": "SIGINT"}).status_code == 200
    end = wait_end(manager, "sig-test")
    assert (end["state"], end["exit_code"]) == ("exited", 130)
    assert "got-int" in manager.get(f"/v1/containers/{record['id'][:6]}/logs").text
    assert manager.post("/v1/containers/sig-test/kill").status_code == 409  # not running any more
    assert manager.post("/v1/containers/sig-test/kill", params={"signal": "KILL ME"}).status_code == 400


def test_auto_remove_leaves_nothing_in_the_engine(manager, docker_agent, docker_client, test_image) -> None:
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB", "auto_remove": True,
                                                  "command": ["sh", "-c", "sleep 0.5; exit 4"]}).json()
    end = wait_end(manager, record["id"])
    assert end["exit_code"] == 4
    # ignore_removed: docker-py inspects what it lists, and the engine may remove it in between (a 404)
    wait_for(lambda: not docker_client.containers.list(all=True, filters={"id": record["container_id"]},
                                                       ignore_removed=True), 10,
             what="the engine to remove it")
    assert all(g["memory_reserved"] == 0 for g in manager.node(NODE)["gpus"])


def test_published_ports_reach_the_engine_as_asked(manager, docker_agent, docker_client, test_image) -> None:
    # this engine runs without a bridge (and the test nodes with no network), so nothing is published for real:
    # what is checked is that the request reaches the engine as asked
    record = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                  "ports": {"8080/tcp": ["127.0.0.1", 18080], "53/udp": None},
                                                  "command": ["sleep", "30"]})
    assert record.status_code == 201, record.text
    host = docker_client.api.inspect_container(record.json()["container_id"])["HostConfig"]
    assert host["PortBindings"]["8080/tcp"] == [{"HostIp": "127.0.0.1", "HostPort": "18080"}]
    assert host["PortBindings"]["53/udp"] == [{"HostIp": "", "HostPort": ""}]


def test_lookup_by_name_and_prefix_and_ambiguity(manager, docker_agent, test_image) -> None:
    records = [manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB", "name": f"job-{i}",
                                                    "command": ["sleep", "30"]}).json() for i in range(17)]
    assert manager.get("/v1/containers/job-1").json()["id"] == records[1]["id"]
    assert manager.get(f"/v1/containers/{records[2]['container_id'][:12]}").json()["id"] == records[2]["id"]
    # 17 hex ids over 16 first digits: some digit starts two of them
    firsts = [r["id"][0] for r in records]
    shared = next(c for c in "0123456789abcdef" if firsts.count(c) >= 2)
    ambiguous = manager.get(f"/v1/containers/{shared}")
    assert ambiguous.status_code == 409 and "ambiguous" in ambiguous.json()["error"]["message"]
    assert manager.get("/v1/containers/" + "z" * 20).status_code == 404
    assert manager.delete("/v1/containers/job-0").json()["state"] == "removed"
    assert manager.get("/v1/containers/job-0").json()["state"] == "removed"  # a removed record is still found


@pytest.fixture
def strict_node(tmp_path, manager, test_image, own_containers):
    """An agent whose own policy allows binds only from one folder, read-only: a ceiling even for the operator."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "escape").symlink_to("/etc")
    policy = json.dumps({"bind_paths": {str(allowed): "ro"}})
    proc = AgentProc(tmp_path, manager, NODE + "-strict", env={"GPUMGR_POLICY": policy})
    yield proc, allowed
    proc.stop()


def test_the_node_refuses_what_its_own_policy_does_not_allow(manager, strict_node, docker_client, test_image) -> None:
    _, allowed = strict_node
    for volume, words in ((f"{allowed}/escape:/e:ro", "/etc"), ("/var/run/docker.sock:/s", "docker.sock"),
                          (f"{allowed}:/a", "read-only")):
        response = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                        "volumes": [volume], "command": ["true"]})
        assert response.status_code == 403, response.text
        error = response.json()["error"]
        assert error["code"] == "policy_denied" and error["rule"] == "bind_paths" and words in error["message"]
    assert all(g["memory_reserved"] == 0 for g in manager.node(NODE + "-strict")["gpus"])
    assert not docker_client.containers.list(all=True, filters={"label": f"gpumgr.node={NODE}-strict"})
    ok = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB", "command": ["true"],
                                              "volumes": [f"{allowed}:/a:ro"]})
    assert ok.status_code == 201, ok.text
