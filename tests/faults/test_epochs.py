"""Epochs only rise, and an agent that cannot write its fence never deposes anyone (issue 31, items 7 and 8).

Everything is real: etcd (Debian's etcd-server; snapshots with etcdctl from etcd-client), ``gpumgr
manager`` processes on it, a ``gpumgr agent`` driving the Docker engine; only the GPU is simulated;
loopback only.

- An etcd restored from a snapshot hands out revisions again under the same generation, and one
  rebuilt from scratch starts both again: the agents, fenced at a later leader's epoch, refuse the new
  leader. They say so, the leader raises the store's generation above their fence and stands again,
  and they follow it, fence.json untouched.
- An agent whose fence.json cannot be written answers ``fence_unwritable``: the node is shown unusable
  (with the reason) and takes no grants, the leader stays, and the node takes grants once it can write.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpumgr.manager.control import etcdv3
from gpumgr.manager.control.ha import read_only_store
from gpumgr.manager.control.store_etcd import EtcdStore
from gpumgr.wire.epoch import Epoch
from tests.etcd import Member
from tests.faults.test_failover_truth import NODE, plane  # noqa: F401  (one etcd, two managers, one agent)
from tests.ha_procs import HaManager
from tests.procs import AgentProc, wait_for

GiB = 1 << 30
READY = 30.0
#: how long the control plane has to lead again and take the agent back after the store went back
RECOVERY = 60.0


def job(image: str, tag: str) -> dict[str, Any]:
    return {"image": image, "gpu_memory": "1GiB", "command": ["sleep", "600"], "labels": {"ep.req": tag}}


def epoch_of(manager: HaManager) -> Epoch | None:
    text = str((manager.health() or {}).get("epoch") or "")
    if "." not in text:
        return None
    generation, revision = text.split(".")
    return Epoch(int(generation), int(revision))


def fence_of(agent: AgentProc) -> Epoch:
    data = json.loads((agent.state_dir / "fence.json").read_text())
    return Epoch(data["generation"], data["revision"])


def etcdctl(*args: str) -> None:
    found = shutil.which("etcdctl")
    if found is None:
        pytest.skip("no etcdctl (apt-get install etcd-client)")
    subprocess.run([found, *args], check=True, capture_output=True, timeout=60, env={"ETCDCTL_API": "3"})


def start_on(member: Member, data: Path) -> None:
    """Start ``member`` again (it was killed) on the data folder ``data``."""
    member.args[member.args.index("--data-dir") + 1] = str(data)
    member.start()


def ready_on(manager: HaManager) -> bool:
    """Whether ``manager`` shows the node ready (False while it does not answer, or no longer leads)."""
    try:
        node = manager.node(NODE)
    except Exception:  # an election under way: asked again
        return False
    return bool(node and node["state"] == "ready")


def a_later_leader(rig: dict[str, Any]) -> Epoch:
    """Move the store's revision well on, then fail the leader over: the agent's fence is that leader's epoch."""
    ha, agent, etcd = rig["ha"], rig["agent"], rig["etcd"]
    client = etcd.client()
    for i in range(300):
        client.txn([], [etcdv3.put(f"/unrelated/{i}".encode(), b"x")])
    first = ha.leader()
    api_port, agent_port = first.api_port, first.agent_port
    first.stop(signal.SIGKILL)
    second = ha.leader(besides=first)
    wait_for(lambda: ready_on(second), READY, interval=0.1, what="the agent to follow the next leader")
    ha.start(api_port=api_port, agent_port=agent_port)  # the killed one comes back, as a follower
    later = epoch_of(second)
    assert later is not None
    wait_for(lambda: fence_of(agent) == later, 15, what="the agent's fence to hold the new leader's epoch")
    return later


def leads_with_the_agent(rig: dict[str, Any], test_image: str, above: Epoch, tag: str) -> HaManager:
    """Wait until a manager leads above ``above`` with the agent's node ready, and the agent runs its create."""
    ha, agent = rig["ha"], rig["agent"]

    def leader_with_node() -> HaManager | None:
        for manager in ha.managers:
            epoch = epoch_of(manager) if manager.popen.poll() is None else None
            if epoch is not None and epoch > above and ready_on(manager):
                return manager
        return None

    leader: HaManager = wait_for(leader_with_node, RECOVERY, interval=0.2,
                                 what=f"a leader above {above} with node {NODE} ready:\n{agent.output()[-3000:]}")
    epoch = epoch_of(leader)
    created = leader.post("/v1/containers", json=job(test_image, tag))
    assert created.status_code == 201 and created.json()["state"] == "running", created.text
    assert fence_of(agent) == epoch  # the agent kept its fence, and raised it to the new leader's
    assert agent.popen.poll() is None
    return leader


def test_after_etcd_is_restored_from_a_snapshot_the_agent_follows_the_next_leader(plane, test_image,  # noqa: F811
                                                                                 tmp_path) -> None:
    etcd, tmp = plane["etcd"], tmp_path
    member = etcd.members[0]
    snapshot = tmp / "snapshot.db"
    etcdctl("--endpoints", member.url, "snapshot", "save", str(snapshot))
    later = a_later_leader(plane)
    member.kill()
    restored = tmp / "etcd-restored"
    token = member.args[member.args.index("--initial-cluster-token") + 1]
    etcdctl("snapshot", "restore", str(snapshot), "--name", member.name, "--data-dir", str(restored),
            "--initial-cluster", f"{member.name}={member.peer}", "--initial-cluster-token", token,
            "--initial-advertise-peer-urls", member.peer)
    start_on(member, restored)
    wait_for(etcd.healthy, 20, interval=0.1, what="the restored etcd to answer")
    leads_with_the_agent(plane, test_image, later, "restored")


def test_after_etcd_is_rebuilt_from_scratch_the_agent_follows_the_next_leader(plane, test_image,  # noqa: F811
                                                                               tmp_path) -> None:
    ha, etcd, tmp = plane["ha"], plane["etcd"], tmp_path
    member = etcd.members[0]
    later = a_later_leader(plane)
    bindings = read_only_store(ha.store).nodes()
    managers = [m for m in ha.managers if m.popen.poll() is None]
    for manager in managers:  # held while the operator rebuilds the store and puts the node bindings back
        manager.popen.send_signal(signal.SIGSTOP)
    try:
        member.kill()
        start_on(member, tmp / "etcd-rebuilt")
        wait_for(etcd.healthy, 20, interval=0.1, what="the rebuilt etcd to answer")
        prefix = "/" + ha.store.rsplit("/", 1)[1] + "/"
        operator = EtcdStore(etcd.client(), lambda: [], prefix=prefix)
        for node, key in bindings.items():
            operator.bind(node, key)
    finally:
        for manager in managers:
            manager.popen.send_signal(signal.SIGCONT)
    leads_with_the_agent(plane, test_image, later, "rebuilt")


def test_an_agent_that_cannot_write_its_fence_makes_its_node_unusable_and_never_deposes_the_leader(
        plane, test_image) -> None:  # noqa: F811
    ha, agent = plane["ha"], plane["agent"]
    first = ha.leader()
    fence = agent.state_dir / "fence.json"
    fence.unlink()
    fence.mkdir()  # a write there fails, as on a read-only or full disk (root ignores file modes)
    try:
        first.stop(signal.SIGKILL)  # the next leader's epoch must be written before the agent runs its commands
        second = ha.leader(besides=first)

        def unusable() -> str | None:
            node = second.node(NODE)
            return node.get("unusable") if node and node["state"] == "ready" else None

        why = wait_for(unusable, READY, interval=0.2, what=f"node {NODE} shown unusable:\n{agent.output()[-2000:]}")
        assert why.startswith("fence_unwritable") and "fence.json" in why, why
        refused = second.post("/v1/containers", json=job(test_image, "unwritable"))
        assert refused.status_code in (409, 503) and refused.json()["error"]["code"], refused.text
        assert second.leads and epoch_of(second) is not None, "the leader stepped down"
        assert agent.popen.poll() is None, "the agent died of its own disk"
    finally:
        fence.rmdir()  # the disk is fixed: the agent writes its fence at its next heartbeat
    wait_for(lambda: (second.node(NODE) or {}).get("unusable", "x") is None, READY, interval=0.2,
             what="the node to take grants again")
    created = second.post("/v1/containers", json=job(test_image, "written"))
    assert created.status_code == 201 and created.json()["state"] == "running", created.text
    assert fence_of(agent) == epoch_of(second) and second.leads
