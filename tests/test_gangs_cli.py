"""Gangs from the command line and from Python (issue 35): ``docker gpu run --gang N``, ``docker gpu gang ps``,
``logs`` and ``rm``, and ``client.gangs``.

Real parts, as in ``test_gangs_e2e.py``: a ``gpumgr manager`` process and two ``gpumgr agent`` processes of one
simulated 8 GiB GPU each, driving the Docker engine. The CLI's ``main`` runs in this process, as
``docker gpu accounts``' test calls it, and its output is read from ``capsys``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from gpumgr.client import NeverFits
from gpumgr.plugin import docker_gpu
from gpumgr.wire.errors import NotFound
from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, remove_containers_of, wait_for

GiB = 1 << 30
NODES = ["gangcli-0", "gangcli-1"]
HELLO = "echo hello from $GPUMGR_GANG_RANK; echo oops from $GPUMGR_GANG_RANK >&2"
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"


@pytest.fixture(scope="module")
def world(tmp_path_factory, test_image, docker_client):
    """A manager with short gang graces and two agents of one 8 GiB GPU each."""
    tmp = tmp_path_factory.mktemp("gangs-cli")
    with contextlib.ExitStack() as undo:  # undone in reverse, also when an agent fails to start
        undo.callback(remove_containers_of, docker_client, *NODES)  # ended members stay, as docker run's do
        manager = ManagerProc(tmp, env={"GPUMGR_GANG_EXIT_GRACE": "5", "GPUMGR_GANG_GRACE": "5"})
        undo.callback(manager.stop)
        for node in NODES:
            undo.callback(AgentProc(tmp, manager, node, gpus="sim:1x8GiB").stop)
        yield manager


@pytest.fixture
def clean(world, docker_client, monkeypatch):
    """The world with no token in the environment; every gang and container it left is ended after the test."""
    monkeypatch.delenv("GPUMGR_TOKEN", raising=False)
    monkeypatch.delenv("GPUMGR_MANAGER", raising=False)
    yield world
    client = world.client
    for gang in reversed(client.gangs.list()):  # newest first: a waiting gang must not take the room freed here
        gang.remove()
    for record in client.containers.list():
        if record.state in ("creating", "running", "queued"):
            record.remove()
    wait_for(lambda: not any(g.memory_reserved for n in client.nodes.list() for g in n.gpus), 20,
             what="every grant freed")
    settles(world, docker_client, set(NODES))


def gpu(manager: ManagerProc, capsys, *args: str) -> tuple[int, str, str]:
    """``docker gpu ARGS`` in this process: its exit status, stdout and stderr."""
    capsys.readouterr()
    status = docker_gpu.main(["gpu", "--manager", manager.url, *args])
    out, err = capsys.readouterr()
    return status, out, err


def ended(manager: ManagerProc, gid: str) -> dict[str, Any]:
    return wait_for(lambda: (v := manager.get(f"/v1/gangs/{gid}").json())["state"] not in
                    ("creating", "running", "restarting") and v, 30, what=f"gang {gid} ended")


def test_run_gang_prints_its_id_ps_lists_it_and_logs_prefix_each_line_with_its_rank(clean, capsys, test_image):
    manager = clean
    status, out, err = gpu(manager, capsys, "run", "--gang", "2", "--gpu-memory", "2GiB", test_image,
                           "sh", "-c", HELLO)
    assert status == 0, err
    gid = out.strip()
    view = manager.get(f"/v1/gangs/{gid}").json()  # the id printed is the gang's
    assert view["replicas"] == 2 and len(view["members"]) == 2 and view["one_per_node"]
    assert ended(manager, gid)["state"] == "exited"

    status, out, _ = gpu(manager, capsys, "gang", "ps")
    lines = out.splitlines()
    assert status == 0 and lines[0].split() == ["ID", "STATE", "REPLICAS", "GPU", "MEMORY", "RESTARTS", "MASTER",
                                                "CREATED"]
    row = next(line.split() for line in lines[1:] if line.startswith(gid))
    assert row[1:5] == ["exited", "(0)", "2", "2GiB"] and row[5] == "-", row
    assert row[6] == f"{view['master_addr']}:{view['master_port']}" and row[-1] == "ago", row
    status, out, _ = gpu(manager, capsys, "gang", "ps", "--format", "json")
    assert status == 0 and [g["id"] for g in json.loads(out)] == [g["id"] for g in manager.get("/v1/gangs").json()
                                                                  ["gangs"]]

    status, out, err = gpu(manager, capsys, "gang", "logs", gid[:6])  # a prefix names it too
    assert status == 0, err
    assert out == "[0] hello from 0\n[1] hello from 1\n" and err == "[0] oops from 0\n[1] oops from 1\n"
    status, out, err = gpu(manager, capsys, "gang", "logs", "-f", "--tail", "2", gid)
    assert status == 0 and sorted(out.splitlines()) == ["[0] hello from 0", "[1] hello from 1"], (out, err)


def test_gang_rm_ends_a_running_gang_and_its_members(clean, capsys, test_image):
    manager = clean
    status, out, err = gpu(manager, capsys, "run", "--gang", "2", "--gpu-memory", "3GiB", "--restart-gang", "1",
                           "--name", "pair", test_image, "sh", "-c", POLITE)
    assert status == 0, err
    gid = out.strip()
    members = [manager.get(f"/v1/containers/{m}").json() for m in manager.get(f"/v1/gangs/{gid}").json()["members"]]
    assert sorted(m["node"] for m in members) == NODES and [m["name"] for m in members] == ["pair-0", "pair-1"]
    status, out, _ = gpu(manager, capsys, "gang", "ps")
    row = next(line.split() for line in out.splitlines() if line.startswith(gid))
    assert row[1:5] == ["running", "2", "3GiB", "0/1"], row

    status, out, err = gpu(manager, capsys, "gang", "rm", gid)
    assert (status, out) == (0, gid + "\n"), err
    assert manager.get(f"/v1/gangs/{gid}").json()["state"] == "removed"
    wait_for(lambda: all(manager.get(f"/v1/containers/{m['id']}").json()["state"] == "removed" for m in members),
             20, what="every member removed")
    status, _, err = gpu(manager, capsys, "gang", "rm", "no-such-gang")
    assert status == 1 and "no gang 'no-such-gang'" in err


def test_run_gang_flags_and_refusals(clean, capsys, test_image):
    manager = clean
    status, out, err = gpu(manager, capsys, "run", "--gang", "2", "--no-one-per-node", "--node", NODES[1],
                           "--gpu-memory", "3GiB", test_image, "sh", "-c", POLITE)
    assert status == 0, err
    members = manager.get(f"/v1/gangs/{out.strip()}").json()["members"]
    assert [manager.get(f"/v1/containers/{m}").json()["node"] for m in members] == [NODES[1]] * 2  # one node

    status, _, err = gpu(manager, capsys, "run", "--gang", "3", "--gpu-memory", "1GiB", test_image, "true")
    assert status == 125 and "(never_fits)" in err  # three members, one per node, on two nodes
    status, _, err = gpu(manager, capsys, "run", "--gang", "2", "--gpu-memory", "6GiB", test_image, "true")
    assert status == 125 and "add --queue to wait for room (no_fit)" in err  # NODES[1] is taken
    status, out, err = gpu(manager, capsys, "run", "--gang", "2", "--gpu-memory", "6GiB", "--queue", test_image,
                           "true")
    assert status == 0 and "queued at position 1" in out, err
    assert manager.get(f"/v1/gangs/{out.split()[0]}").json()["state"] == "queued"
    for argv, words in ((["--gang", "1"], "--gang takes how many members, 2 or more"),
                        (["--no-one-per-node"], "are for a gang: add --gang N"),
                        (["--gang", "2", "--restart-gang", "x"], "--restart-gang takes how many times")):
        status, _, err = gpu(manager, capsys, "run", *argv, "--gpu-memory", "1GiB", test_image, "true")
        assert status == 125 and words in err, err
    status, _, err = gpu(manager, capsys, "run", "--gang", "2", "--gpu-memory", "1GiB", "-e", "PET_RANK=9",
                         test_image, "true")
    assert status == 125 and "PET_RANK" in err and "(invalid_request)" in err


def test_the_python_client_runs_lists_gets_reads_and_removes_gangs(clean, test_image):
    client = clean.client
    gang = client.gangs.run(test_image, ["sh", "-c", HELLO], replicas=2, gpu_memory="2GiB", env={"X": "1"})
    # every member was created; the gang's own state turns running at the manager's next dispatch
    assert (gang.replicas, gang.gpu_memory, gang.restart, len(gang.members)) == (2, 2 * GiB, "never", 2)
    assert gang.state in ("creating", "running", "exited")
    assert gang.id in [g.id for g in client.gangs.list()]
    members = gang.containers()
    assert [(m.gang, m.rank) for m in members] == [(gang.id, 0), (gang.id, 1)]
    wait_for(lambda: gang.reload().state == "exited", 30, what="the gang exited")
    # stdout and stderr together, in whichever order the engine took them
    assert {rank: sorted(out.splitlines()) for rank, out in gang.logs().items()} == \
        {rank: [f"hello from {rank}".encode(), f"oops from {rank}".encode()] for rank in (0, 1)}
    assert client.gangs.get(gang.id).exit_code == 0

    with pytest.raises(NeverFits) as never:
        client.gangs.run(test_image, "true", replicas=3, gpu_memory="1GiB")
    assert (never.value.code, never.value.status) == ("never_fits", 409)
    with pytest.raises(NotFound):
        client.gangs.get("no-such-gang")

    holder = client.gangs.run(test_image, ["sh", "-c", POLITE], replicas=2, gpu_memory="6GiB", max_restarts=2)
    assert (holder.restart, holder.max_restarts, holder.master_port is not None) == ("gang", 2, True)
    wait_for(lambda: holder.reload().state == "running", 10, what="the gang running")
    waiting = client.gangs.run(test_image, "true", replicas=2, gpu_memory="6GiB", queue=True)
    assert waiting.state == "queued" and waiting.queue is not None and waiting.queue.position == 1
    assert waiting.members == [] and waiting.containers() == []
    assert waiting.remove().state == "removed"
    assert holder.remove().state == "removed"
