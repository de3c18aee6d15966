"""Escapes around the guard, second round (issue 32): an image's own ENV and LABEL, and privileged in all but name.

Item 3. The engine merges an image's ``ENV`` and ``LABEL`` into the container after the guard has
judged the create, so the agent judges the hook request from the container's record: images
committed with ``GPUMGR_REQUEST_MEMORY`` get no grant, an image's Swarm task label makes no Swarm
task (its ``GPUMGR_REQUEST_PRIORITY=1000`` is capped to the node's 0 and the grant counts for the
node's ``hook_tenant``), and ``hook_max_memory`` is enforced by the agent itself.

Item 5. On a private dockerd with the guard as its authorization plugin and a node policy that
lists ``NET_ADMIN`` alone: ``--cap-add ALL`` and ``SYS_ADMIN`` in every spelling, any capability the
policy does not list, and unconfined seccomp or AppArmor together with an added capability are
denied, naming the field, on plain and ticketed creates and on services (``CapabilityAdd``,
``Privileges``); no such container or service is ever made.
"""

from __future__ import annotations

import base64
import json

import docker
import pytest
import yaml

from gpumgr.agent.guard.guard import Guard, GuardState
from gpumgr.agent.guard.guard_client import ticket_labels
from gpumgr.plugin.hook import Refused, ask_agent
from gpumgr.wire.engine import gpudev
from tests import test_guard
from tests.guardproc import GuardProc
from tests.images import IMAGE, busybox_tar
from tests.procs import AgentProc
from tests.swarm import SwarmEngine
from tests.test_guard import raw_post
from tests.test_guard_decisions import plugin_request
from tests.test_tenants import operator_manager, write_config

GiB = 1 << 30
DENIED = "gpumgr guard:"
NODE = "escape-caps-node"
#: the node's limits on a plain run's hook grant
MAX_MEMORY = 8 * GiB
ALLOW_ALL = "{\"defaultAction\": \"SCMP_ACT_ALLOW\"}"


# -- item 3: an image's own ENV and LABEL --------------------------------------------------------------------

@pytest.fixture(scope="module")
def hook_node(tmp_path_factory, docker_client, test_image):
    """A manager (tenant alice may hold 100 GiB) and an agent whose plain runs act for alice, at most 8 GiB."""
    tmp = tmp_path_factory.mktemp("escape-hook")
    manager = operator_manager(tmp, write_config(tmp / "manager.yaml", alice={"gpu_memory": "100GiB"}))
    agent = AgentProc(tmp, manager, NODE, env={"GPUMGR_HOOK_TENANT": "alice",
                                                  "GPUMGR_HOOK_MAX_MEMORY": str(MAX_MEMORY)})
    images: list[str] = []
    yield manager, agent, images
    agent.stop()
    manager.stop()
    for image in images:
        docker_client.images.remove(image, force=True)


def committed(docker_client, test_image: str, images: list[str], *changes: str) -> str:
    """An image committed from the test image with ``changes`` (``ENV ...``, ``LABEL ...``), as an attacker would."""
    base = docker_client.containers.create(test_image, ["true"], network_mode="none")
    try:
        image = base.commit(changes=list(changes))
    finally:
        base.remove(force=True)
    images.append(image.id)
    return str(image.id)


def ask(agent: AgentProc, container_id: str) -> dict:
    """What the runtime hook sends for the container (the agent reads the rest from the engine's record)."""
    request = {"container_id": container_id, "gpu_memory": 1, "gpus": 1, "name": "", "image": "", "labels": {},
               "on_overrun": None, "node": ""}
    return ask_agent(request, agent.hook_socket)


def assert_within_limits(manager, tasks: tuple[str, ...] = ()) -> None:
    """No record on the node holds more than the node's limits let a plain run have, or acts as the operator,
    but the containers in ``tasks`` (real Swarm tasks)."""
    records = [r for r in manager.get("/v1/containers").json()["containers"] if r.get("node") == NODE]
    assert records  # the check below has records to look at
    for record in records:
        if record["container_id"] not in tasks:
            assert record["tenant"] == "alice" and record["gpu_memory"] <= MAX_MEMORY and record["priority"] <= 0, \
                record


@pytest.mark.docker
def test_an_images_own_gpu_request_gets_no_grant(hook_node, docker_client, test_image):
    manager, agent, images = hook_node
    image = committed(docker_client, test_image, images, "ENV GPUMGR_REQUEST_MEMORY=2GiB")
    container = docker_client.containers.create(image, ["true"], network_mode="none")
    try:
        with pytest.raises(Refused, match="comes from the container's image"):
            ask(agent, container.id)
        # the same value passed by the create itself cannot be told from the image's: refused as well, while
        # another value is the create's own and is granted (within the node's limits)
        same = docker_client.containers.create(image, ["true"], network_mode="none",
                                               environment={"GPUMGR_REQUEST_MEMORY": "2GiB"})
        own = docker_client.containers.create(image, ["true"], network_mode="none",
                                              environment={"GPUMGR_REQUEST_MEMORY": "1GiB"})
        with pytest.raises(Refused, match="comes from the container's image"):
            ask(agent, same.id)
        grant = ask(agent, own.id)["grant"]
        assert manager.get(f"/v1/containers/{grant}").json()["gpu_memory"] == GiB
        assert_within_limits(manager)
    finally:
        for each in docker_client.containers.list(all=True, filters={"ancestor": image}):
            each.remove(force=True)


@pytest.mark.docker
def test_an_image_above_hook_max_memory_gets_no_grant_from_env_or_image(hook_node, docker_client, test_image):
    manager, agent, images = hook_node
    image = committed(docker_client, test_image, images, "ENV GPUMGR_REQUEST_MEMORY=20GiB")
    from_image = docker_client.containers.create(image, ["true"], network_mode="none")
    from_create = docker_client.containers.create(test_image, ["true"], network_mode="none",
                                                  environment={"GPUMGR_REQUEST_MEMORY": "20GiB"})
    try:
        with pytest.raises(Refused):
            ask(agent, from_image.id)
        with pytest.raises(Refused, match="hook_max_memory"):
            ask(agent, from_create.id)
        assert_within_limits(manager)
    finally:
        from_image.remove(force=True)
        from_create.remove(force=True)


@pytest.mark.docker
def test_an_images_swarm_label_makes_no_swarm_task(hook_node, docker_client, test_image):
    manager, agent, images = hook_node
    image = committed(docker_client, test_image, images, "LABEL com.docker.swarm.task.id=forged-task",
                      "ENV GPUMGR_REQUEST_PRIORITY=1000")
    forged = docker_client.containers.create(image, ["true"], network_mode="none",
                                             environment={"GPUMGR_REQUEST_MEMORY": "1GiB"})
    # Swarm's executor writes its own task id over the image's: that one is trusted (the guard keeps the
    # label out of every plain create, so only the executor can write it)
    task = docker_client.containers.create(image, ["true"], network_mode="none",
                                           environment={"GPUMGR_REQUEST_MEMORY": "1GiB",
                                                        "GPUMGR_REQUEST_PRIORITY": "5"},
                                           labels={"com.docker.swarm.task.id": "real-task"})
    try:
        record = manager.get(f"/v1/containers/{ask(agent, forged.id)['grant']}").json()
        assert (record["tenant"], record["priority"]) == ("alice", 0), record
        record = manager.get(f"/v1/containers/{ask(agent, task.id)['grant']}").json()
        assert (record["tenant"], record["priority"]) == (None, 5), record
        assert_within_limits(manager, tasks=(task.id,))
    finally:
        forged.remove(force=True)
        task.remove(force=True)


@pytest.fixture(scope="module")
def hook_engine(hook_node, tmp_path_factory):
    """A private dockerd whose default runtime is gpumgr's hook, and an agent behind it with the same limits."""
    manager, _, _ = hook_node
    engine = SwarmEngine(busybox_tar())
    agent = AgentProc(tmp_path_factory.mktemp("escape-e2e"), manager, f"{NODE}-e2e",
                      env={"DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket,
                           "GPUMGR_HOOK_TENANT": "alice", "GPUMGR_HOOK_MAX_MEMORY": str(MAX_MEMORY)})
    yield engine, manager
    agent.stop()
    engine.stop()


def test_docker_run_of_such_images_through_the_hook(hook_engine):
    """End to end: the engine merges the image, the hook asks, the agent refuses or limits: no GPU reaches it."""
    engine, manager = hook_engine
    for tag, change in (("asks", "ENV GPUMGR_REQUEST_MEMORY=20GiB"),
                        ("task", "LABEL com.docker.swarm.task.id=forged-task")):
        base = engine.docker("create", "--network", "none", IMAGE, "true").stdout.strip()
        engine.docker("commit", "--change", change, *(["--change", "ENV GPUMGR_REQUEST_PRIORITY=1000"]
                                                     if tag == "task" else []), base, f"escape/{tag}:1")
        engine.docker("rm", base)
    refused = engine.docker("run", "--rm", "--network", "none", "escape/asks:1", "env", check=False)
    assert refused.returncode != 0 and "comes from the container's image" in refused.stderr, refused.stderr
    ran = engine.docker("run", "--rm", "--network", "none", "-e", "GPUMGR_REQUEST_MEMORY=1GiB", "escape/task:1",
                        "env", check=False)
    assert ran.returncode == 0 and "GPUMGR_GRANT=" in ran.stdout, ran.stderr
    grant = next(line.split("=", 1)[1] for line in ran.stdout.splitlines() if line.startswith("GPUMGR_GRANT="))
    record = manager.get(f"/v1/containers/{grant}").json()
    assert (record["tenant"], record["priority"], record["gpu_memory"]) == ("alice", 0, GiB), record
    records = [r for r in manager.get("/v1/containers").json()["containers"] if r["node"] == f"{NODE}-e2e"]
    assert [r["id"] for r in records] == [grant]  # the image asking for 20 GiB got nothing at all


# -- item 5: privileged in all but name ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("escape-caps")
    config = tmp / "agent.yaml"
    config.write_text(yaml.safe_dump({"policy": {"cap_add": ["NET_ADMIN"]}}))
    proc = GuardProc(tmp, config=config)
    yield proc
    proc.remove()


#: the private dockerd of the guard's engine tests, behind this module's guard
engine = test_guard.engine


@pytest.fixture
def no_container_left(engine):
    """Each case passes only if the engine made no container for it."""
    yield
    assert engine.client.containers.list(all=True) == []


@pytest.mark.parametrize("args, field", [
    (["--cap-add", "ALL"], "HostConfig.CapAdd"),
    (["--cap-add", "all"], "HostConfig.CapAdd"),
    (["--cap-add", "SYS_ADMIN"], "CAP_SYS_ADMIN"),
    (["--cap-add", "cap_sys_admin"], "CAP_SYS_ADMIN"),
    (["--cap-add", "NET_ADMIN", "--cap-add", "SYS_MODULE"], "CAP_SYS_MODULE"),
    (["--cap-add", "NET_ADMIN", "--security-opt", "seccomp=unconfined"], "HostConfig.SecurityOpt"),
    (["--cap-add", "NET_ADMIN", "--security-opt", "apparmor=unconfined"], "HostConfig.SecurityOpt"),
])
def test_what_adds_up_to_privileged_is_denied_naming_the_field(engine, guard, no_container_left, args, field):
    result = engine.docker("run", "--rm", "--network", "none", *args, IMAGE, "true", check=False)
    assert result.returncode != 0
    assert f"authorization denied by plugin {guard.name}: {DENIED}" in result.stderr, result.stderr
    assert field in result.stderr


def test_a_custom_seccomp_profile_allowing_everything_counts_as_unconfined(engine, no_container_left, tmp_path):
    profile = tmp_path / "allow.json"
    profile.write_text(ALLOW_ALL)
    result = engine.docker("run", "--rm", "--network", "none", "--cap-add", "NET_ADMIN", "--security-opt",
                           f"seccomp={profile}", IMAGE, "true", check=False)
    assert result.returncode != 0 and DENIED in result.stderr and "allows every syscall" in result.stderr


@pytest.mark.parametrize("body", [
    {"HostConfig": {"CapAdd": "SYS_ADMIN"}},  # a lone string is a list of one to the engine
    {"CapAdd": ["sys_admin"]},  # the legacy top-level HostConfig fields
    {"HostConfig": {"capadd": ["NET_ADMIN"], "SecurityOpt": ["seccomp:unconfined"]}},
    {"HostConfig": {"CapAdd": ["NET_ADMIN"], "securityopt": ["apparmor:unconfined"]}},
])
def test_hand_made_bodies_are_read_as_the_engine_reads_them(engine, no_container_left, body):
    status, answer = raw_post(engine, "/v1.41/containers/create", json.dumps({"Image": IMAGE, **body}).encode())
    assert status == 403 and DENIED in answer, answer


def test_a_listed_capability_and_confinement_alone_pass(engine):
    for args in (["--cap-add", "NET_ADMIN"], ["--cap-add", "cap_net_admin"], ["--security-opt", "seccomp=unconfined"]):
        result = engine.docker("run", "--rm", "--network", "none", *args, IMAGE, "echo", "ran", check=False)
        assert result.returncode == 0 and result.stdout == "ran\n", (args, result.stderr)


def test_a_ticket_does_not_buy_capabilities(engine, guard, no_container_left):
    with pytest.raises(docker.errors.APIError) as caught:
        engine.client.containers.create(IMAGE, "true", network_mode="none", cap_add=["SYS_ADMIN"],
                                        labels=ticket_labels(guard.control))
    assert caught.value.status_code == 403 and "HostConfig.CapAdd" in str(caught.value)


def service_body(name: str, **container: object) -> bytes:
    spec = {"Image": IMAGE, "Command": ["sleep", "60"], **container}
    return json.dumps({"Name": name, "TaskTemplate": {"ContainerSpec": spec}}).encode()


SERVICES = [
    ({"CapabilityAdd": ["CAP_SYS_ADMIN"]}, "TaskTemplate.ContainerSpec.CapabilityAdd"),
    ({"CapabilityAdd": ["ALL"]}, "TaskTemplate.ContainerSpec.CapabilityAdd"),
    ({"CapabilityAdd": ["CAP_NET_ADMIN"], "Privileges": {"Seccomp": {"Mode": "unconfined"}}},
     "TaskTemplate.ContainerSpec.Privileges.Seccomp"),
    ({"CapabilityAdd": ["CAP_NET_ADMIN"], "Privileges": {"AppArmor": {"Mode": "disabled"}}},
     "TaskTemplate.ContainerSpec.Privileges.AppArmor"),
    ({"CapabilityAdd": ["CAP_NET_ADMIN"], "Privileges": {"Seccomp": {
        "Mode": "custom", "Profile": base64.b64encode(ALLOW_ALL.encode()).decode()}}},
     "TaskTemplate.ContainerSpec.Privileges.Seccomp"),
]


def test_services_are_judged_the_same_way(engine, guard):
    engine.docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:0")
    try:
        cli = engine.docker("service", "create", "--detach", "--cap-add", "SYS_ADMIN", IMAGE, "sleep", "60",
                            check=False)
        assert cli.returncode != 0 and DENIED in cli.stderr and "CapabilityAdd" in cli.stderr, cli.stderr
        for index, (container, field) in enumerate(SERVICES):
            status, answer = raw_post(engine, "/v1.41/services/create", service_body(f"esc{index}", **container))
            assert status == 403 and DENIED in answer and field in answer, (container, answer)
        assert engine.docker("service", "ls", "-q").stdout.strip() == ""
        # a listed capability passes; adding SYS_ADMIN to it by an update does not
        status, answer = raw_post(engine, "/v1.41/services/create",
                                  service_body("listed", CapabilityAdd=["CAP_NET_ADMIN"]))
        assert status == 201, answer
        update = engine.docker("service", "update", "--detach", "--cap-add", "SYS_ADMIN", "listed", check=False)
        assert update.returncode != 0 and DENIED in update.stderr, update.stderr
        caps = engine.docker("service", "inspect", "--format", "{{json .Spec.TaskTemplate.ContainerSpec}}",
                             "listed").stdout
        assert "SYS_ADMIN" not in caps and "NET_ADMIN" in caps, caps
    finally:
        engine.docker("service", "rm", "listed", check=False)
        engine.docker("swarm", "leave", "--force", check=False)


@pytest.mark.parametrize("policy, cap, allowed", [
    ({"ALL"}, "NET_RAW", True),
    ({"ALL"}, "SYS_ADMIN", False),  # ALL in the policy lets every capability pass but those named by name only
    ({"ALL"}, "ALL", True),
    ({"SYS_ADMIN"}, "CAP_SYS_ADMIN", True),
    ({"SYS_ADMIN"}, "ALL", False),
    (set(), "NET_RAW", False),  # no node policy: no capability may be added
])
def test_the_policy_names_what_passes(tmp_path, policy, cap, allowed):
    plain = gpudev.DefaultRuntime(frozenset({"runc"}), None)
    guard = Guard(gpudev.Policy(default=plain, cap_add=frozenset(policy)), GuardState(tmp_path / "guard.json"))
    body = {"Image": IMAGE, "HostConfig": {"CapAdd": [cap]}}
    assert guard.request(plugin_request("/v1.41/containers/create", body)).allow is allowed
    service = {"TaskTemplate": {"ContainerSpec": {"Image": IMAGE, "CapabilityAdd": [cap]}}}
    assert guard.request(plugin_request("/v1.41/services/create", service)).allow is allowed
