"""Gangs end to end (issue 35): four single-GPU agents on one engine, each its own node.

Real parts: a ``gpumgr manager`` process, four ``gpumgr agent`` processes driving the Docker engine on
simulated GPUs, real containers read back with ``docker inspect``, members meeting over real sockets
(busybox ``nc``, on the host network and on a named network), and the invariant at the end of each test.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from tests.invariant import settles
from tests.procs import AgentProc, ManagerProc, wait_for

GiB = 1 << 30
NODES = [f"gang-{n}" for n in range(4)]
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"


@pytest.fixture(scope="module")
def world(tmp_path_factory, test_image, docker_client):
    """A manager with short gang graces and four agents of one 8 GiB GPU each."""
    tmp = tmp_path_factory.mktemp("gangs")
    manager = ManagerProc(tmp, env={"GPUMGR_GANG_EXIT_GRACE": "5", "GPUMGR_GANG_GRACE": "5",
                                    "GPUMGR_GANG_RESERVE_AFTER": "4"})
    agents = [AgentProc(tmp, manager, node, gpus="sim:1x8GiB") for node in NODES]
    yield manager
    for agent in agents:
        agent.stop()
    manager.stop()


@pytest.fixture
def clean(world, docker_client):
    yield world
    for gang in world.get("/v1/gangs").json()["gangs"]:
        world.http.delete(world.url + f"/v1/gangs/{gang['id']}", timeout=60)
    for record in world.get("/v1/containers").json()["containers"]:
        if record["state"] in ("creating", "running", "queued"):
            world.http.delete(world.url + f"/v1/containers/{record['id']}", timeout=60)
    settles(world, docker_client, set(NODES))


def gang(manager: ManagerProc, image: str, replicas: int, command: str = POLITE, **extra: Any):
    body = {"image": image, "gpu_memory": "4GiB", "replicas": replicas, "command": ["sh", "-c", command], **extra}
    return manager.http.post(manager.url + "/v1/gangs", json=body, timeout=90)


def env_of(docker_client, record: dict[str, Any]) -> dict[str, str]:
    config = docker_client.api.inspect_container(record["container_id"])["Config"]
    return dict(item.split("=", 1) for item in config["Env"])


def gang_state(manager: ManagerProc, gid: str) -> dict[str, Any]:
    return manager.get(f"/v1/gangs/{gid}").json()


def test_a_gang_starts_whole_with_ranks_and_rendezvous_and_five_members_never_fit(clean, test_image, docker_client):
    manager = clean
    made = gang(manager, test_image, 4)
    assert made.status_code == 201, made.text
    view = made.json()
    assert view["state"] == "running" and len(view["members"]) == 4
    records = [manager.get(f"/v1/containers/{m}").json() for m in view["members"]]
    assert sorted(r["node"] for r in records) == NODES  # one per node
    envs = [env_of(docker_client, r) for r in records]
    for rank, (record, env) in enumerate(zip(records, envs, strict=True)):
        assert (record["gang"], record["rank"]) == (view["id"], rank)
        assert env["GPUMGR_GANG"] == view["id"] and env["GPUMGR_GANG_RANK"] == str(rank)
        assert env["GPUMGR_GANG_SIZE"] == "4" and env["PET_NNODES"] == "4" and env["PET_NODE_RANK"] == str(rank)
        assert env["PET_NPROC_PER_NODE"] == "1" and env["PET_RDZV_ID"] == view["rdzv_id"]
    # the agents advertise nothing: the master is the local address of their connection to the manager (loopback)
    assert {(e["PET_MASTER_ADDR"], e["PET_MASTER_PORT"]) for e in envs} == {("127.0.0.1", str(view["master_port"]))}
    assert not any("NCCL_SOCKET_IFNAME" in e for e in envs)  # only with host networking
    never = gang(manager, test_image, 5)
    assert never.status_code == 409 and never.json()["error"]["code"] == "never_fits", never.text
    reserved = gang(manager, test_image, 2, env={"PET_MASTER_PORT": "1", "GPUMGR_GANG_RANK": "9"})
    assert reserved.status_code == 400 and "PET_MASTER_PORT" in reserved.json()["error"]["message"]
    beside = gang(manager, test_image, 2)  # the four nodes share one host: its master port is another
    assert beside.status_code == 201, beside.text
    assert beside.json()["master_addr"] == "127.0.0.1" and beside.json()["master_port"] != view["master_port"]
    patched = manager.http.patch(manager.url + f"/v1/containers/{view['members'][1]}", json={"gpu_memory": "5GiB"},
                                 timeout=30)
    assert patched.status_code == 409 and view["id"] in patched.json()["error"]["message"], patched.text
    # a DELETE of one member ends its whole gang, and no other
    manager.http.delete(manager.url + f"/v1/containers/{view['members'][2]}", timeout=60)
    wait_for(lambda: all(manager.get(f"/v1/containers/{m}").json()["state"] == "removed" for m in view["members"]),
             20, what="every member removed")
    assert gang_state(manager, view["id"])["state"] == "removed"
    assert gang_state(manager, beside.json()["id"])["state"] == "running"


def test_a_waiting_gang_holds_nothing_and_starts_whole_once_room_frees(clean, test_image):
    manager = clean
    busy = manager.http.post(manager.url + "/v1/containers", json={
        "image": test_image, "gpu_memory": "6GiB", "node": NODES[2], "command": ["sh", "-c", POLITE]}, timeout=90)
    assert busy.status_code == 201, busy.text
    waiting = gang(manager, test_image, 4, queue=True)
    assert waiting.status_code == 202 and waiting.json()["state"] == "queued", waiting.text
    time.sleep(0.5)  # (well before gang_reserve_after, 4 s here)
    gpus = [g for n in manager.get("/v1/nodes").json()["nodes"] for g in n["gpus"] if n["name"] in NODES]
    assert sum(g["memory_reserved"] for g in gpus) == 6 * GiB  # only the busy container's grant
    assert sum(g["memory_reserved_for_gang"] for g in gpus) == 0  # the waiting gang holds nothing
    behind = manager.http.post(manager.url + "/v1/containers", json={  # backfill: a smaller request behind it runs
        "image": test_image, "gpu_memory": "2GiB", "node": NODES[0], "command": ["sh", "-c", POLITE]}, timeout=90)
    assert behind.status_code == 201, behind.text
    freed = time.monotonic()
    manager.http.delete(manager.url + f"/v1/containers/{busy.json()['id']}", timeout=60)
    running = wait_for(lambda: (v := gang_state(manager, waiting.json()["id"]))["state"] == "running" and v, 20,
                       what="the gang running")
    print(f"the gang ran whole {time.monotonic() - freed:.2f}s after its room was freed")
    assert len(running["members"]) == 4


def test_docker_kill_of_one_member_stops_the_others_and_restart_gang_brings_it_back(clean, test_image,
                                                                                     docker_client):
    manager = clean
    made = gang(manager, test_image, 3, restart="gang", max_restarts=1)
    assert made.status_code == 201, made.text
    first = made.json()
    victim = manager.get(f"/v1/containers/{first['members'][1]}").json()
    docker_client.api.kill(victim["container_id"])
    again = wait_for(lambda: (v := gang_state(manager, first["id"]))["restart_count"] == 1 and
                     v["state"] == "running" and v, 40, what="the gang placed again")
    assert set(again["members"]).isdisjoint(first["members"]) and again["rdzv_id"] == first["rdzv_id"]
    for cid in first["members"]:
        assert manager.get(f"/v1/containers/{cid}").json()["state"] in ("killed", "removed", "exited")
    victim = manager.get(f"/v1/containers/{again['members'][0]}").json()
    docker_client.api.kill(victim["container_id"])
    ended = wait_for(lambda: (v := gang_state(manager, first["id"]))["state"] not in ("running", "restarting")
                     and v, 30, what="the gang ended")
    # the restarts are spent: a member killed by a signal (exit 137) fails the gang, with its reason
    assert (ended["state"], ended["exit_code"], ended["restart_count"]) == ("failed", 137, 1), ended
    assert "member 0" in ended["reason"]
    wait_for(lambda: all(manager.get(f"/v1/containers/{m}").json()["state"] not in ("creating", "running")
                         for m in again["members"]), 20, what="every member ended")


def test_a_failed_member_create_removes_the_others_and_answers_as_one_container_would(clean, test_image):
    manager = clean
    failed = gang(manager, "gpumgr-test/no-such-image:1", 3, restart="gang", max_restarts=1)
    assert failed.status_code == 400 and failed.json()["error"]["code"] == "image_not_found", failed.text
    gangs = [g for g in manager.get("/v1/gangs").json()["gangs"] if g["image"] == "gpumgr-test/no-such-image:1"]
    # a failed create neither restarts the gang nor counts against max_restarts
    assert len(gangs) == 1 and gangs[0]["state"] == "failed" and gangs[0]["restart_count"] == 0
    wait_for(lambda: all(manager.get(f"/v1/containers/{m}").json()["state"] not in ("creating", "running")
                         for m in gangs[0]["members"]), 20, what="every member ended")
    reserved = sum(g["memory_reserved"] for n in manager.get("/v1/nodes").json()["nodes"] for g in n["gpus"]
                   if n["name"] in NODES)
    assert reserved == 0  # every grant released


def test_after_gang_reserve_after_room_is_held_for_a_waiting_gang_and_nothing_else_takes_it(clean, test_image):
    manager = clean
    small = {"image": test_image, "gpu_memory": "4GiB", "command": ["sh", "-c", POLITE]}
    first = manager.http.post(manager.url + "/v1/containers", json={**small, "node": NODES[0]}, timeout=90)
    assert first.status_code == 201, first.text
    waiting = gang(manager, test_image, 4, queue=True, gpu_memory="8GiB")  # every GPU whole: one is half taken
    assert waiting.status_code == 202, waiting.text

    def held() -> dict[str, int]:
        return {n["name"]: n["gpus"][0]["memory_reserved_for_gang"] for n in manager.get("/v1/nodes").json()["nodes"]
                if n["name"] in NODES}

    # gang_reserve_after is 4 s here: then the free GPUs are held for it, whole, and the busy one's free half
    wait_for(lambda: held() == {NODES[0]: 4 * GiB, **{n: 8 * GiB for n in NODES[1:]}}, 10, what="room held")
    gauges = [line.rsplit(" ", 1) for line in manager.get("/metrics").text.splitlines()
              if line.startswith("gpumgr_gpu_memory_reserved_for_gang_bytes{") and any(f'"{n}"' in line for n in NODES)]
    assert sorted(float(value) for _, value in gauges) == [4 * GiB] + [8 * GiB] * 3  # and in the metrics
    refused = manager.http.post(manager.url + "/v1/containers", json=small, timeout=90)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_fit", refused.text
    manager.http.delete(manager.url + f"/v1/containers/{first.json()['id']}", timeout=60)
    wait_for(lambda: gang_state(manager, waiting.json()["id"])["state"] == "running", 20, what="the gang placed")
    assert set(held().values()) == {0}  # released once it is placed


def test_two_gangs_at_once_run_one_after_the_other_never_both_partly(clean, test_image):
    manager = clean
    work = "sleep 2; exit 0"
    first = gang(manager, test_image, 3, command=work, queue=True, gpu_memory="6GiB")  # one member per GPU
    second = gang(manager, test_image, 3, command=work, queue=True, gpu_memory="6GiB")
    assert first.status_code == 201 and second.status_code == 202, (first.text, second.text)
    seen_both = False
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        live = [r for r in manager.get("/v1/containers").json()["containers"]
                if r["gang"] and r["state"] in ("creating", "running")]
        gangs = {r["gang"] for r in live}
        seen_both = seen_both or len(gangs) > 1
        for made in (first, second):  # never partly: a gang's members are placed all at once, or none
            assert len(gang_state(manager, made.json()["id"])["members"]) in (0, 3)
        if gang_state(manager, second.json()["id"])["state"] == "exited":
            break
        time.sleep(0.2)
    assert gang_state(manager, first.json()["id"])["state"] == "exited"
    assert gang_state(manager, second.json()["id"])["state"] == "exited" and not seen_both


@pytest.fixture
def gangnet(docker_client):
    """A user-defined network the members share by name (an attachable overlay's stand-in on one engine)."""
    network = docker_client.networks.create(f"gpumgr-test-gangnet-{time.monotonic_ns()}")
    yield network.name
    network.remove()  # after ``clean`` (set up later, ended first) removed the members' containers


@pytest.mark.parametrize("network", ["host", "named"])
def test_members_meet_on_the_master_address_and_port_and_the_gang_ends_exited(gangnet, clean, test_image,
                                                                            docker_client, network):
    manager = clean
    # rank 0 listens on the master's port; rank 1 connects (retrying until rank 0 listens); they swap ranks
    meet = ('if [ "$GPUMGR_GANG_RANK" = 0 ]; then echo rank0 | timeout 30 nc -l -p "$PET_MASTER_PORT" > /tmp/got; '
            'else until echo rank1 | timeout 5 nc "$PET_MASTER_ADDR" "$PET_MASTER_PORT" > /tmp/got '
            '&& [ -s /tmp/got ]; do sleep 0.2; done; fi; cat /tmp/got; '
            'grep -q "rank$((1 - GPUMGR_GANG_RANK))" /tmp/got')
    made = gang(manager, test_image, 2, command=meet, network="host" if network == "host" else gangnet)
    assert made.status_code == 201, made.text
    name = f"gpumgr-gang-{made.json()['id']}-0"
    assert made.json()["master_addr"] == ("127.0.0.1" if network == "host" else name)  # rank 0's container name
    ended = wait_for(lambda: (v := gang_state(manager, made.json()["id"]))["state"] not in ("creating", "running")
                     and v, 40, what="the gang ended")
    assert (ended["state"], ended["exit_code"]) == ("exited", 0), ended
    for cid in ended["members"]:
        record = manager.get(f"/v1/containers/{cid}").json()
        assert (record["state"], record["exit_code"]) == ("exited", 0)
        peer = 1 - record["rank"]
        logs = manager.http.get(manager.url + f"/v1/containers/{cid}/logs", timeout=30).text
        assert f"rank{peer}" in logs
        env = env_of(docker_client, record)  # an ended member's container stays until its gang is removed
        assert env.get("NCCL_SOCKET_IFNAME") == ("^docker,lo" if network == "host" else None)


def test_a_gang_survives_a_kill_9_of_the_manager_and_still_ends_as_one(tmp_path, test_image, docker_client,
                                                                       cleanup_containers):
    nodes = ["gang-r0", "gang-r1"]
    manager = ManagerProc(tmp_path)
    agents = [AgentProc(tmp_path, manager, node, gpus="sim:1x8GiB", env={"GPUMGR_ADVERTISE_ADDR": "127.0.0.3"})
              for node in nodes]  # where other hosts reach them, as the agents' setting says
    try:
        made = gang(manager, test_image, 2, gpu_memory="6GiB")
        assert made.status_code == 201, made.text
        before = made.json()
        assert before["master_addr"] == "127.0.0.3"
        waiting = gang(manager, test_image, 2, gpu_memory="6GiB", queue=True)  # no room: it waits whole
        assert waiting.status_code == 202, waiting.text
        manager.stop(signal.SIGKILL)
        manager = ManagerProc(tmp_path, api_port=manager.api_port, agent_port=manager.agent_port)
        rebuilt = wait_for(lambda: (r := manager.get(f"/v1/gangs/{before['id']}")).status_code == 200
                           and r.json()["state"] == "running" and r.json(), 30, what="the gang rebuilt")
        for key in ("members", "rdzv_id", "master_addr", "master_port", "replicas"):
            assert rebuilt[key] == before[key], key
        assert gang_state(manager, waiting.json()["id"])["state"] == "queued"  # its 202 survived the kill
        victim = manager.get(f"/v1/containers/{before['members'][0]}").json()
        docker_client.api.kill(victim["container_id"])
        ended = wait_for(lambda: (v := gang_state(manager, before["id"]))["state"] == "failed" and v, 30,
                         what="the rebuilt gang ended as one")
        assert "member 0" in ended["reason"]
        wait_for(lambda: manager.get(f"/v1/containers/{before['members'][1]}").json()["state"] == "removed", 20,
                 what="the other member stopped")
        wait_for(lambda: gang_state(manager, waiting.json()["id"])["state"] == "running", 30,
                 what="the gang that waited through the restart placed whole")
        settles(manager, docker_client, set(nodes))
    finally:
        for agent in agents:
            agent.stop()
        manager.stop()
