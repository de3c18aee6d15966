"""Constraints, GPU health and topology end to end: a real manager, agents and engine, simulated GPUs.

Three labelled nodes hold GPUs of three models; every attribute and operator is asked for over
REST and each container must land on a GPU the constraint allows (and, where the constraint bites,
not where an unconstrained request would go). A GPU turned unhealthy through its agent's health
file takes no new grant while its container runs on; a Swarm-style request checked by the runtime
hook is refused when the node's GPUs cannot satisfy its ``gpu.*`` constraints.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.procs import AgentProc, ManagerProc, wait_for

pytestmark = pytest.mark.docker
G = 1 << 30
H100, A100, T4 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla T4"
NODES = {
    "p23-a": ("sim:2x80GiB:" + H100 + "@9.0", ["zone=a", "rack=r1"]),
    "p23-b": ("sim:2x40GiB:" + A100 + "@8.0", ["zone=b"]),
    "p23-c": ("sim:1x16GiB:" + T4 + "@7.5,1x40GiB:" + A100 + "@8.0", []),
}
#: (node, index) → model, per the specs above
GPUS = {("p23-a", 0): H100, ("p23-a", 1): H100, ("p23-b", 0): A100, ("p23-b", 1): A100,
        ("p23-c", 0): T4, ("p23-c", 1): A100}


@pytest.fixture
def three_models(tmp_path, manager, test_image, cleanup_containers):
    agents = [AgentProc(tmp_path, manager, node, gpus=gpus, extra=[f"--label={lb}" for lb in labels])
              for node, (gpus, labels) in NODES.items()]
    yield manager
    for agent in agents:
        agent.stop()


def job(image: str, memory: str, **extra) -> dict:
    # SIGKILL: busybox's sleep as PID 1 ignores SIGTERM, and each removal would wait out the stop grace
    return {"image": image, "gpu_memory": memory, "command": ["sleep", "300"], "stop_signal": "SIGKILL", **extra}


def placed_on(manager: ManagerProc, record: dict) -> tuple[str, int]:
    return record["node"], record["gpus"][0]["index"]


ALLOWED = [
    ("node.name==p23-b", {k for k in GPUS if k[0] == "p23-b"}),
    ("node.name!=p23-a", {k for k in GPUS if k[0] != "p23-a"}),
    ("node.labels.zone==b", {k for k in GPUS if k[0] == "p23-b"}),
    ("node.labels.zone!=a", {k for k in GPUS if k[0] != "p23-a"}),
    ("node.labels.rack==r1", {k for k in GPUS if k[0] == "p23-a"}),
    ("gpu.model==*T4*", {("p23-c", 0)}),
    ("gpu.model!=*H100*", {k for k, m in GPUS.items() if m != H100}),
    ("gpu.index==1", {k for k in GPUS if k[1] == 1}),
    ("gpu.index!=1", {k for k in GPUS if k[1] != 1}),
    ("gpu.index>=1", {k for k in GPUS if k[1] >= 1}),
    ("gpu.index<=0", {k for k in GPUS if k[1] == 0}),
    ("gpu.memory<=40GiB", {k for k, m in GPUS.items() if m != H100}),
    ("gpu.memory>=80GiB", {k for k, m in GPUS.items() if m == H100}),
    ("gpu.memory==16GiB", {("p23-c", 0)}),
    ("gpu.memory!=80GiB", {k for k, m in GPUS.items() if m != H100}),
    ("gpu.compute_capability>=8.0", {k for k, m in GPUS.items() if m != T4}),
    ("gpu.compute_capability<=8.0", {k for k, m in GPUS.items() if m != H100}),
    ("gpu.compute_capability==7.5", {("p23-c", 0)}),
    ("gpu.compute_capability!=9.0", {k for k, m in GPUS.items() if m != H100}),
]


def test_every_attribute_and_operator_places_only_where_allowed(three_models, test_image):
    manager = three_models
    nodes = {n["name"]: n for n in manager.get("/v1/nodes").json()["nodes"]}
    assert nodes["p23-a"]["labels"] == {"zone": "a", "rack": "r1"} and nodes["p23-c"]["labels"] == {}
    assert [(g["name"], g["compute_capability"]) for g in nodes["p23-c"]["gpus"]] == [(T4, "7.5"), (A100, "8.0")]
    uuids = {(n, g["index"]): g["uuid"] for n, node in nodes.items() for g in node["gpus"]}
    cases = [*ALLOWED, (f"gpu.uuid=={uuids['p23-c', 1]}", {("p23-c", 1)}),
             (f"gpu.uuid!={uuids['p23-a', 0]}", set(GPUS) - {("p23-a", 0)})]
    for constraint, allowed in cases:
        response = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints=[constraint]))
        assert response.status_code == 201, (constraint, response.text)
        record = response.json()
        assert placed_on(manager, record) in allowed, (constraint, placed_on(manager, record))
        assert record["constraints"] == [constraint]
        removed = manager.delete(f"/v1/containers/{record['id']}")
        assert removed.status_code == 200, (constraint, removed.text)
    # two at once: both must hold
    both = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints=[
        "gpu.model==*A100*", "node.labels.zone!=b"])).json()
    assert placed_on(manager, both) == ("p23-c", 1)
    manager.delete(f"/v1/containers/{both['id']}")


def test_a_constraint_nothing_could_satisfy_is_409_queue_or_not_and_a_bad_one_400(three_models, test_image):
    manager = three_models
    for queue in (False, True):
        never = manager.post("/v1/containers", json=job(test_image, "1GiB", queue=queue,
                                                        constraints=["gpu.model==*V100*"]))
        assert never.status_code == 409 and never.json()["error"]["code"] == "never_fits", never.text
        assert "gpu.model==*V100*" in never.json()["error"]["message"]
        too_big = manager.post("/v1/containers", json=job(test_image, "20GiB", queue=queue,
                                                          constraints=["gpu.model==*T4*"]))
        assert too_big.status_code == 409 and too_big.json()["error"]["code"] == "never_fits"
    for bad, says in (("gpu.model>=H100", "compares numbers"), ("gpu.vram==1", "unknown attribute"),
                      ("gpu.memory>=lots", "cannot read"), ("node.name", "no operator")):
        response = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints=[bad]))
        assert response.status_code == 400, response.text
        assert says in response.json()["error"]["message"] and bad in response.json()["error"]["message"]
    not_a_list = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints="gpu.index==0"))
    assert not_a_list.status_code == 400
    assert manager.get("/v1/containers").json()["containers"] == []


def test_a_constrained_request_waits_in_the_queue_for_an_allowed_gpu(three_models, test_image):
    manager = three_models
    first = manager.post("/v1/containers", json=job(test_image, "10GiB", constraints=["gpu.model==*T4*"])).json()
    assert placed_on(manager, first) == ("p23-c", 0)
    waiting = manager.post("/v1/containers", json=job(test_image, "10GiB", queue=True,
                                                      constraints=["gpu.model==*T4*"]))
    assert waiting.status_code == 202 and waiting.json()["state"] == "queued"  # A100s and H100s have room: not theirs
    manager.delete(f"/v1/containers/{first['id']}")
    record = wait_for(lambda: (r := manager.get(f"/v1/containers/{waiting.json()['id']}").json())["state"]
                      == "running" and r, 30, what="the queued request to run on the T4")
    assert placed_on(manager, record) == ("p23-c", 0) and record["constraints"] == ["gpu.model==*T4*"]
    manager.delete(f"/v1/containers/{record['id']}")


# --- health ----------------------------------------------------------------------------------
def test_an_unhealthy_gpu_takes_no_grant_its_container_runs_on_and_it_comes_back(tmp_path, manager, test_image,
                                                                                   docker_client,
                                                                                   cleanup_containers):
    health = tmp_path / "health"
    agent = AgentProc(tmp_path, manager, "p23-h", gpus=f"sim:2x24GiB;health={health}")
    try:
        running = manager.post("/v1/containers", json=job(test_image, "4GiB", constraints=["gpu.index==0"])).json()
        assert running["state"] == "running"
        health.write_text("0 overheated in the test\n")
        gpu = wait_for(lambda: not (g := manager.node("p23-h")["gpus"][0])["healthy"] and g, 15,
                       what="GPU 0 to be reported unhealthy")
        assert gpu["health"] == "overheated in the test" and gpu["containers"] == [running["id"]]
        refused = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints=["gpu.index==0"]))
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_fit", refused.text
        elsewhere = manager.post("/v1/containers", json=job(test_image, "1GiB")).json()
        assert elsewhere["gpus"][0]["index"] == 1  # spread would pick GPU 0's... no: GPU 1 was emptier anyway
        binpacked = manager.post("/v1/containers", json=job(test_image, "1GiB", placement="binpack")).json()
        assert binpacked["gpus"][0]["index"] == 1  # binpack would take the fuller GPU 0 if it could
        assert docker_client.containers.get(running["container_id"]).status == "running"
        assert manager.get(f"/v1/containers/{running['id']}").json()["state"] == "running"
        event = next(e for e in manager.events("gpu_unhealthy"))
        assert "overheated in the test" in event["message"] and event["gpu"] == gpu["uuid"]
        metrics = manager.get("/metrics").text
        assert f'gpumgr_gpu_healthy{{gpu="{gpu["uuid"]}",node="p23-h"}} 0.0' in metrics
        health.write_text("")
        wait_for(lambda: manager.node("p23-h")["gpus"][0]["healthy"], 15, what="GPU 0 to be healthy again")
        back = manager.post("/v1/containers", json=job(test_image, "1GiB", constraints=["gpu.index==0"]))
        assert back.status_code == 201, back.text
        assert manager.events("gpu_healthy") and f'gpumgr_gpu_healthy{{gpu="{gpu["uuid"]}",node="p23-h"}} 1.0' \
            in manager.get("/metrics").text
    finally:
        agent.stop()


# --- topology --------------------------------------------------------------------------------
def test_two_four_gpu_jobs_each_get_one_nvlink_island(tmp_path, manager, test_image, cleanup_containers):
    agent = AgentProc(tmp_path, manager, "p23-t", gpus="sim:8x80GiB:" + H100 + "@9.0;nvlink=4;socket=8")
    try:
        gpus = manager.node("p23-t")["gpus"]
        assert [g["topology"]["nvlink"] for g in gpus] == [0, 0, 0, 0, 4, 4, 4, 4]
        islands = [{g["uuid"] for g in gpus[:4]}, {g["uuid"] for g in gpus[4:]}]
        first = manager.post("/v1/containers", json=job(test_image, "10GiB", gpus=4)).json()
        second = manager.post("/v1/containers", json=job(test_image, "10GiB", gpus=4)).json()
        chosen = [{g["uuid"] for g in r["gpus"]} for r in (first, second)]
        assert sorted(chosen, key=min) == sorted(islands, key=min)
        assert first["topology"] == second["topology"] == "nvlink"
    finally:
        agent.stop()


def test_a_pair_on_a_half_full_node_is_a_linked_pair(tmp_path, manager, test_image, cleanup_containers):
    """NVLink pairs (0, 1) ... (6, 7), sockets of four; 0, 2 and 4 full, 6 and 7 a little used: by free memory
    alone a pair would be two of 1, 3 and 5, which no NVLink joins; 6 and 7 are."""
    agent = AgentProc(tmp_path, manager, "p23-u", gpus="sim:8x80GiB:" + H100 + "@9.0;nvlink=2;socket=4")
    try:
        for index, memory in ((0, "75GiB"), (2, "75GiB"), (4, "75GiB"), (6, "1GiB"), (7, "1GiB")):
            held = manager.post("/v1/containers", json=job(test_image, memory, constraints=[f"gpu.index=={index}"]))
            assert held.status_code == 201, held.text
        pair = manager.post("/v1/containers", json=job(test_image, "10GiB", gpus=2)).json()
        assert sorted(g["index"] for g in pair["gpus"]) == [6, 7] and pair["topology"] == "nvlink"
    finally:
        agent.stop()


# --- the runtime hook ------------------------------------------------------------------------
def _reserve(container_id: str) -> dict:
    return {"container_id": container_id, "gpu_memory": 1, "gpus": 1, "name": "", "image": "", "labels": {},
            "on_overrun": None, "node": ""}


def test_the_hook_refuses_a_task_whose_gpu_constraints_this_node_cannot_meet(docker_agent, docker_client,
                                                                              test_image):
    from gpumgr.plugin.hook import Refused, ask_agent

    def task(constraints: list[str]) -> object:
        env = {"GPUMGR_REQUEST_MEMORY": str(G), "GPUMGR_REQUEST_CONSTRAINTS": json.dumps(constraints)}
        return docker_client.containers.create(test_image, ["true"], network_mode="none", environment=env,
                                               labels={"gpumgr.node": docker_agent.node})

    wrong, right, garbled = task(["gpu.model==*H100*"]), task(["gpu.index==1"]), task(["gpu.index>>1"])
    try:
        with pytest.raises(Refused, match=r"no GPU could ever hold this.*gpu\.model==\*H100\*"):
            ask_agent(_reserve(wrong.id), docker_agent.hook_socket)
        with pytest.raises(Refused, match=re.escape("gpu.index>>1")):
            ask_agent(_reserve(garbled.id), docker_agent.hook_socket)
        assert docker_agent.manager.get("/v1/containers").json()["containers"] == []
        granted = ask_agent(_reserve(right.id), docker_agent.hook_socket)
        index_one = docker_agent.manager.node(docker_agent.node)["gpus"][1]["uuid"]
        assert granted["gpus"] == [index_one]
    finally:
        for container in (wrong, right, garbled):
            container.remove(force=True)
