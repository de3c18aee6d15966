"""A grant asked through the runtime hook by a plain ``docker run`` is no operator's grant.

Before, ``docker run -e GPUMGR_REQUEST_MEMORY=80GiB -e GPUMGR_REQUEST_PRIORITY=...`` on any node got a
grant as the operator, at the priority it named. Now it gets the node's ``hook_max_priority`` at most
(0) and counts against the agent's ``hook_tenant``; a Swarm task (the engine's own Swarm label on the
container) keeps acting as the operator.
"""

from __future__ import annotations

import pytest

from gpumgr.agent.runtimes.hook_limits import HookLimits
from gpumgr.plugin.hook import ask_agent
from gpumgr.wire.protocol import Reserve
from tests.procs import AgentProc, wait_for
from tests.test_tenants import operator_manager, write_config

GiB = 1 << 30


def reserve(container_id: str) -> dict:
    return {"container_id": container_id, "gpu_memory": GiB, "gpus": 1, "name": "", "image": "", "labels": {},
            "on_overrun": None, "node": ""}


def test_limits_leave_swarm_tasks_alone_and_lower_plain_runs():
    request = Reserve(container_id="c", gpu_memory=GiB, priority=9)
    limited = HookLimits("alice", 0).apply(request, {"team": "x"})
    assert (limited.priority, limited.tenant) == (0, "alice")
    assert HookLimits("alice", 0).apply(request, {"com.docker.swarm.task.id": "t1"}) == request
    assert HookLimits(None, 0).apply(Reserve(container_id="c", gpu_memory=GiB, priority=-3), None).priority == -3


@pytest.mark.docker
def test_a_plain_run_acts_for_the_hook_tenant_at_priority_zero(tmp_path, docker_client, test_image,
                                                               cleanup_containers):
    manager = operator_manager(tmp_path, write_config(tmp_path / "manager.yaml"))
    agent = AgentProc(tmp_path, manager, "hook-tenant-node", env={"GPUMGR_HOOK_TENANT": "alice"})
    env = {"GPUMGR_REQUEST_MEMORY": "1GiB", "GPUMGR_REQUEST_PRIORITY": "5"}
    plain = docker_client.containers.create(test_image, ["true"], network_mode="none", environment=env)
    task = docker_client.containers.create(test_image, ["true"], network_mode="none", environment=env,
                                           labels={"com.docker.swarm.task.id": "task-1"})
    try:
        for container, tenant, priority in ((plain, "alice", 0), (task, None, 5)):
            grant = ask_agent(reserve(container.id), agent.hook_socket)
            record = manager.get(f"/v1/containers/{grant['grant']}").json()
            assert (record["tenant"], record["priority"]) == (tenant, priority), record
    finally:
        plain.remove(force=True)
        task.remove(force=True)
        agent.stop()
        manager.stop()


def test_a_hook_grant_keeps_its_tenant_across_a_manager_restart(tmp_path, docker_client, test_image,
                                                                cleanup_containers):
    """The grant reply carried no tenant, and the agent took the tenant from it: after any restart a
    ``hook_tenant`` node's grants were re-adopted as the operator's, out of the tenant's quota and views."""
    config = write_config(tmp_path / "manager.yaml")
    manager = operator_manager(tmp_path, config)
    agent = AgentProc(tmp_path, manager, "hook-tenant-node", env={"GPUMGR_HOOK_TENANT": "alice"})
    plain = docker_client.containers.create(test_image, ["sleep", "60"], network_mode="none",
                                            environment={"GPUMGR_REQUEST_MEMORY": "1GiB"})
    try:
        grant = ask_agent(reserve(plain.id), agent.hook_socket)["grant"]
        assert manager.get(f"/v1/containers/{grant}").json()["tenant"] == "alice"
        manager.stop()
        manager = operator_manager(tmp_path, config, api_port=manager.api_port, agent_port=manager.agent_port)
        record = wait_for(lambda: (r := manager.get(f"/v1/containers/{grant}")).ok and r.json(), 30,
                          what="the hook grant re-adopted by the restarted manager")
        assert record["tenant"] == "alice", record
    finally:
        plain.remove(force=True)
        agent.stop()
        manager.stop()
