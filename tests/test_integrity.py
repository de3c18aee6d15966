"""Regression tests for the integrity issue: each test names the issue item it guards.

Real parts throughout (a Docker engine, ``gpumgr`` processes, ZeroMQ); only GPUs are simulated.
Tests of the manager's rules drive :class:`Cluster` directly, as tests/test_scheduler.py does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time

import pytest

from gpumgr.agent import procmap
from gpumgr.agent.enforcer import REASON_EXCEEDED, Enforcer, EnforcerSettings
from gpumgr.agent.gpus.simgpu import SimSource, parse_sim_spec
from gpumgr.agent.runtimes.choose import build_runtime
from gpumgr.agent.runtimes.process_runtime import ProcessRuntime
from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.wire import defaults, protocol
from gpumgr.wire.errors import NotFound, ProtocolError, RuntimeFailure
from gpumgr.wire.names import State
from gpumgr.wire.protocol import ContainerReport, ContainerSpec, ContainerStatus, GpuInfo
from tests.procs import AgentProc, ManagerProc, process_gone, wait_for

GiB = 1 << 30
USAGE = "/tmp/use"
#: A container that ends promptly on SIGTERM (a shell as PID 1 ignores signals it has no trap for).
POLITE = "trap 'exit 0' TERM; while :; do sleep 1; done"


# --- helpers -------------------------------------------------------------------------------------
def gpu_infos(node: str, count: int = 1, size: int = 24 * GiB) -> list[GpuInfo]:
    return [GpuInfo(uuid=f"{node}-g{i}", index=i, name="Sim", memory_total=size) for i in range(count)]


def make_cluster(count: int = 1, **kw) -> Cluster:
    cluster = Cluster(**kw)
    cluster.register("a", b"a", "docker", gpu_infos("a", count), [])
    return cluster


def reserved(cluster: Cluster) -> dict[str, int]:
    """Reserved bytes per GPU on every node on the map, ready or down."""
    return {g["uuid"]: g["memory_reserved"] for n in cluster.nodes_view() for g in n["gpus"]}


def spec(memory: int, **kw) -> PlacementSpec:
    return PlacementSpec(memory=memory, count=1, placement="spread", image="img", command=[], **kw)


def running(cluster: Cluster, memory: int):
    """A REST grant whose agent confirmed the container."""
    record = cluster.reserve(spec(memory))
    return cluster.started(record.id, ContainerReport(grant=record.id, container_id=f"c-{record.id}",
                                                      gpus=record.gpus, gpu_memory=memory, state="running"))


def sim_job(image: str, memory: str, use_bytes: int, **extra):
    """A container that declares ``use_bytes`` of simulated GPU memory and then waits to be stopped."""
    return {"image": image, "gpu_memory": memory, "env": {"GPUMGR_SIM_USAGE_FILE": USAGE},
            "command": ["sh", "-c", f"echo {use_bytes} > {USAGE}; {POLITE}"], **extra}


def record_of(manager: ManagerProc, cid: str) -> dict:
    return manager.get(f"/v1/containers/{cid}").json()


def restart_agent(tmp_path, manager: ManagerProc, old: AgentProc) -> AgentProc:
    """Stop ``old`` and start a new agent process for its node with its state (no second join).

    Returns once the new process registered: the node was ready all along, so wait for its ``node_up``.
    """
    ups = len(manager.events("node_up"))
    old.stop()
    new = AgentProc(tmp_path, manager, old.node, gpus="sim:2x24GiB", state_dir=old.state_dir, join=False)
    wait_for(lambda: len(manager.events("node_up")) > ups, 20, what="the new agent to register")
    return new


# --- item 1: heartbeats and registrations that cannot be encoded ---------------------------------
def test_agent_restart_with_commands_over_the_message_bound_keeps_every_grant(tmp_path, manager, docker_agent,
                                                                             test_image):
    """Issue item 1: registering containers whose whole reports exceed the message bound must still succeed."""
    command = ["sh", "-c", "exec sleep 300", "--"] + ["x" * 60000] * 12
    records = []
    for _ in range(6):
        response = manager.post("/v1/containers", json={"image": test_image, "gpu_memory": "1GiB",
                                                        "command": command})
        assert response.status_code == 201, response.text[:500]
        records.append(response.json())
    # whole, these reports do not fit one message: the registration has to fall back to compact ones
    whole = protocol.Register(node="node-a", runtime="docker", gpus=[], containers=[
        ContainerReport(grant=r["id"], container_id=r["container_id"], gpus=[g["uuid"] for g in r["gpus"]],
                        gpu_memory=r["gpu_memory"], state="running", command=r["command"]) for r in records])
    with pytest.raises(ProtocolError):
        protocol.encode(whole)

    again = restart_agent(tmp_path, manager, docker_agent)
    try:
        since = time.time()
        # ready, and heartbeating (ids and figures only) for a couple of intervals after registering
        wait_for(lambda: (n := manager.node("node-a"))["state"] == "ready" and n["last_seen"] > since + 2, 15,
                 what="heartbeats after the restart")
        assert again.popen.poll() is None
        for record in records:
            now = record_of(manager, record["id"])
            assert now["state"] == "running" and now["container_id"] == record["container_id"]
            assert now["command"] == command  # compact reports do not shorten the manager's records
        gpus = manager.node("node-a")["gpus"]
        assert sum(g["memory_reserved"] for g in gpus) == 6 * GiB
        assert sorted(c for g in gpus for c in g["containers"]) == sorted(r["id"] for r in records)
    finally:
        again.stop()


def test_a_usage_reading_beyond_64_bits_is_enforced_and_heartbeats_go_on(manager, docker_agent, test_image):
    """Issue item 1: a usage figure of 2**64 or more must not stop the agent's heartbeats or its enforcement."""
    reported = manager.post("/v1/containers", json=sim_job(test_image, "1GiB", 2**64, on_overrun="report")).json()
    assert reported["state"] == "running", reported
    # the figure crosses the wire (clamped to the largest one carried) and the container keeps running
    wait_for(lambda: record_of(manager, reported["id"])["gpu_memory_used"] == defaults.MAX_BYTES, 15,
             what="the huge usage figure in a heartbeat")
    assert record_of(manager, reported["id"])["state"] == "running"

    killed = manager.post("/v1/containers", json=sim_job(test_image, "1GiB", 2**64 + 5)).json()
    done = wait_for(lambda: (r := record_of(manager, killed["id"]))["state"] == "killed" and r, 15,
                    what="the container over its grant to be killed")
    assert "gpu_memory" in done["reason"]
    assert manager.gpu(killed["gpus"][0]["uuid"])["memory_reserved"] == 0
    wait_for(lambda: (n := manager.node("node-a"))["state"] == "ready" and n["last_seen"] > done["finished_at"] + 2,
             15, what="heartbeats to go on after the kill")
    assert docker_agent.popen.poll() is None


# --- item 4: hook grants -------------------------------------------------------------------------
def test_hook_grants_end_at_their_deadline_unless_a_heartbeat_confirms_them():
    """Issue item 4: an unconfirmed hook grant is released at its deadline; one reported running becomes running."""
    cluster = make_cluster()
    lost = cluster.reserve(spec(2 * GiB, hook=True, container_id="lost"), deadline=5)
    kept = cluster.reserve(spec(3 * GiB, hook=True, container_id="kept"), deadline=5)
    assert reserved(cluster) == {"a-g0": 5 * GiB}
    removals = cluster.heartbeat("a", b"a", [], [ContainerStatus(grant=kept.id, container_id="kept",
                                                                 state="running")])
    assert removals == ([], [])
    assert kept.state is State.RUNNING and kept.deadline is None
    assert lost.state is State.CREATING
    cluster.down_after = 60  # the node stays up: a grant is not expired while its node is down
    cluster.sweep(now=time.monotonic() + 10)
    assert lost.state is State.FAILED and lost.reason
    assert kept.state is State.RUNNING
    assert reserved(cluster) == {"a-g0": 3 * GiB}


# --- item 5: a manager restart while tasks are being created --------------------------------------
def test_a_restarted_manager_adopts_a_grant_still_being_created_until_its_deadline():
    """Issue item 5: a registration reporting a hook task still being created keeps its grant until a deadline."""
    cluster = Cluster()
    report = ContainerReport(grant="task-1", container_id="c" * 64, gpus=["a-g0"], gpu_memory=3 * GiB,
                             state="creating", hook=True)
    cluster.register("a", b"a", "docker", gpu_infos("a"), [report])
    record = cluster.get("task-1")
    assert record.state is State.CREATING and record.hook and record.deadline is not None
    assert reserved(cluster) == {"a-g0": 3 * GiB}
    start = time.monotonic()
    cluster.down_after = 1e6  # its node stays up throughout (a down node's deadlines wait for it)
    cluster.sweep(now=start + 5)  # well before its deadline: still held
    assert record.state is State.CREATING and reserved(cluster) == {"a-g0": 3 * GiB}
    cluster.sweep(now=start + defaults.TASK_START_TIMEOUT + 60)
    assert record.state is State.FAILED and record.reason
    assert reserved(cluster) == {"a-g0": 0}


# --- items 6 and 10: adoption from what a container controls -------------------------------------
def test_adoption_never_takes_a_grant_from_a_containers_environment(tmp_path, manager, docker_agent, docker_client,
                                                                    test_image):
    """Issue items 6 and 10: containers without a trustworthy grant record are refused, with an event saying why."""
    real = manager.post("/v1/containers", json=sim_job(test_image, "2GiB", 0)).json()
    assert real["state"] == "running", real
    uuid = real["gpus"][0]["uuid"]
    env = {"GPUMGR_GPU_MEMORY": str(20 * GiB), "NVIDIA_VISIBLE_DEVICES": uuid, "GPUMGR_NODE": "node-a"}
    base = {"detach": True, "network_mode": "none", "command": ["sh", "-c", POLITE]}
    rogues = {
        # looks REST-created, but no memory label: its grant is unknown (once adopted as 1 byte)
        "rogue-nomem": {"labels": {"gpumgr.grant": "rogue-nomem", "gpumgr.node": "node-a", "gpumgr.gpu": uuid}},
        # a memory label that is not a byte count
        "rogue-badmem": {"labels": {"gpumgr.grant": "rogue-badmem", "gpumgr.node": "node-a", "gpumgr.gpu": uuid,
                                    "gpumgr.memory": "lots"}},
        # looks hook-created, with its grant only in its environment (once read from /proc/PID/environ)
        "rogue-task": {"labels": {"gpumgr.task": "t1"}},
    }
    started = []
    try:
        for grant, extra in rogues.items():
            started.append(docker_client.containers.run(test_image, environment={**env, "GPUMGR_GRANT": grant},
                                                        **base, **extra))
        again = restart_agent(tmp_path, manager, docker_agent)
        try:
            assert record_of(manager, real["id"])["state"] == "running"
            for grant in rogues:
                response = manager.get(f"/v1/containers/{grant}")
                assert response.status_code == 404, response.text
            gpus = manager.node("node-a")["gpus"]
            assert sum(g["memory_reserved"] for g in gpus) == 2 * GiB
            assert sorted(c for g in gpus for c in g["containers"]) == [real["id"]]
            messages = [e["message"] for e in manager.events()]
            for container in started[:2]:
                assert any(container.id[:12] in m and "not adopted" in m and "gpumgr.memory" in m for m in messages), \
                    messages
        finally:
            again.stop()
    finally:
        for container in started:
            with contextlib.suppress(Exception):  # already gone
                container.remove(force=True)


# --- item 7: the grant is kept until the offender is dead; failed kills are retried ---------------
def test_an_overrun_keeps_the_grant_until_the_exit_is_confirmed():
    """Issue item 7: an overrun report must not free the grant; only the confirmed exit does."""
    cluster = make_cluster()
    record = running(cluster, 2 * GiB)
    detail = {"reason": REASON_EXCEEDED, "gpu": "a-g0", "observed": 5 * GiB, "grant_bytes": 2 * GiB,
              "action": "kill"}
    cluster.overrun(record.id, detail)
    assert record.state is State.RUNNING and reserved(cluster) == {"a-g0": 2 * GiB}
    assert record.detail["overrun"] == detail
    cluster.overrun(record.id, {**detail, "kill_failed": "the engine refused", "retry_in": 0.2})
    assert record.state is State.RUNNING and reserved(cluster) == {"a-g0": 2 * GiB}
    overruns = [e for e in cluster.events.since() if e["type"] == "overrun" and e["container"] == record.id]
    assert len(overruns) == 2 and "retrying" in overruns[1]["message"]
    # a heartbeat that still sees it (dying) keeps the grant too
    cluster.heartbeat("a", b"a", [], [ContainerStatus(grant=record.id, container_id=record.container_id,
                                                      state="running")])
    assert reserved(cluster) == {"a-g0": 2 * GiB}
    cluster.finish(record.id, State.KILLED, reason=REASON_EXCEEDED, exit_code=137)
    assert record.state is State.KILLED and reserved(cluster) == {"a-g0": 0}


class FlakyKillRuntime(ProcessRuntime):
    """Host processes whose kill the "engine" refuses the first ``failures`` times."""

    def __init__(self, *args, failures: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.failures = failures
        self.kills = 0

    def kill(self, grant, reason, detail=None):
        self.kills += 1
        if self.kills <= self.failures:
            raise RuntimeFailure("the engine refused the kill")
        super().kill(grant, reason, detail)


def test_a_refused_kill_is_reported_and_retried_until_it_succeeds(tmp_path):
    """Issue item 7: a kill the runtime refuses is reported each time and tried again with a growing pause."""
    devices = parse_sim_spec("sim:1x8GiB", seed=f"integrity-{tmp_path.name}")
    exits: list = []
    runtime = FlakyKillRuntime(exits.append, log_dir=str(tmp_path / "logs"), failures=2)
    overruns: list = []
    enforcer = Enforcer(SimSource(devices), devices, runtime, lambda m, d: overruns.append(d),
                        EnforcerSettings(samples=1))
    usage = tmp_path / "use"
    usage.write_text(str(2 * GiB))
    runtime.create(ContainerSpec(grant="g1", name="g1", command=["sleep", "300"], gpus=[devices[0].uuid],
                                 gpu_memory=GiB, env={"GPUMGR_SIM_USAGE_FILE": str(usage)}))
    try:
        def killed() -> bool:
            if runtime.kills < 3:
                enforcer.check()
            return runtime.kills >= 3

        wait_for(killed, 10, what="the kill to be retried until it works")
        wait_for(lambda: exits, 5, what="the killed process to be reported")
    finally:
        for managed in runtime.managed():
            runtime.remove(managed.grant, 1)
    failures = [o for o in overruns if "kill_failed" in o]
    assert len(failures) == 2 and all("refused" in o["kill_failed"] for o in failures)
    assert [o["retry_in"] for o in failures] == [defaults.KILL_RETRY_MIN, 2 * defaults.KILL_RETRY_MIN]
    assert runtime.kills == 3
    assert exits[0].state == "killed" and exits[0].reason == REASON_EXCEEDED


# --- item 9: outages lose neither history nor intent ---------------------------------------------
def test_delete_while_the_node_is_down_is_kept_and_done_when_it_returns(manager, docker_agent, docker_client,
                                                                        test_image):
    """Issue item 9: DELETE on a down node answers 202, keeps the grant, and removes the container on return."""
    record = manager.post("/v1/containers", json=sim_job(test_image, "3GiB", 0)).json()
    assert record["state"] == "running", record
    uuid = record["gpus"][0]["uuid"]
    os.kill(docker_agent.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: manager.node("node-a")["state"] == "down", 15, what="the node to be down")
        response = manager.delete(f"/v1/containers/{record['id']}")
        assert response.status_code == 202, response.text
        assert response.json()["id"] == record["id"] and response.json()["state"] == "running"
        assert manager.gpu(uuid)["memory_reserved"] == 3 * GiB
        assert docker_client.containers.get(record["container_id"]).status == "running"
    finally:
        os.kill(docker_agent.popen.pid, signal.SIGCONT)
    done = wait_for(lambda: (r := record_of(manager, record["id"]))["state"] == "removed" and r, 30,
                    what="the removal to be carried out")
    assert done["finished_at"] is not None
    assert manager.gpu(uuid)["memory_reserved"] == 0
    # ignore_removed: docker-py inspects what it lists, and the engine may remove it in between (a 404)
    wait_for(lambda: not docker_client.containers.list(all=True, filters={"id": record["container_id"]},
                                                       ignore_removed=True), 15,
             what="the container to be gone from the engine")


def test_a_kill_while_the_manager_was_away_is_recorded_once_with_its_reason():
    """Issue item 9: an end reported at registration is recorded with reason, time and exactly one final event."""
    cluster = Cluster()
    finished = time.time() - 30
    report = ContainerReport(grant="gone-1", container_id="d" * 64, gpus=["a-g0"], gpu_memory=2 * GiB,
                             state="killed", reason=REASON_EXCEEDED, exit_code=137, finished_at=finished)
    gpus = gpu_infos("a")
    cluster.register("a", b"a", "docker", gpus, [report])
    record = cluster.get("gone-1")
    assert record.state is State.KILLED and record.reason == REASON_EXCEEDED
    assert record.exit_code == 137 and record.finished_at == finished
    assert reserved(cluster) == {"a-g0": 0}
    # the agent repeats the end in a later registration and in its heartbeats: still recorded once
    cluster.register("a", b"a", "docker", gpus, [report])
    cluster.heartbeat("a", b"a", [], [ContainerStatus(grant="gone-1", container_id="d" * 64, state="killed",
                                                      reason=REASON_EXCEEDED, exit_code=137, finished_at=finished)])
    finals = [e for e in cluster.events.since() if e["container"] == "gone-1" and e.get("final")]
    assert len(finals) == 1 and finals[0]["type"] == "killed"


# --- item 11: bounded growth ---------------------------------------------------------------------
def test_ended_grants_past_the_finished_cap_stay_forgotten(monkeypatch):
    """Issue item 11: reports of ended grants must not grow the records past the finished-record cap."""
    monkeypatch.setattr(defaults, "FINISHED_KEPT", 5)
    cluster = make_cluster()
    ids = []
    for _ in range(8):
        record = running(cluster, GiB)
        cluster.finish(record.id, State.EXITED, exit_code=0)
        ids.append(record.id)
    for cid in ids[:3]:
        with pytest.raises(NotFound):
            cluster.get(cid)
    statuses = [ContainerStatus(grant=c, container_id=f"c-{c}", state="exited", exit_code=0) for c in ids]
    assert cluster.heartbeat("a", b"a", [], statuses) == ([], [])  # not None: no new registration is asked for
    for cid in ids[:3]:
        with pytest.raises(NotFound):
            cluster.get(cid)
    assert len(cluster.containers()) == 5
    reports = [ContainerReport(grant=c, container_id=f"c-{c}", gpus=["a-g0"], gpu_memory=GiB, state="exited",
                               exit_code=0, finished_at=time.time()) for c in ids]
    for _ in range(3):
        cluster.register("a", b"a", "docker", gpu_infos("a"), reports)
        assert len(cluster.containers()) <= 5
    assert reserved(cluster) == {"a-g0": 0}


def test_a_node_down_longer_than_forget_after_is_forgotten_with_its_grants():
    """Issue item 11: a node down longer than forget_after leaves the map and its live grants end as removed."""
    cluster = make_cluster(forget_after=60)
    record = running(cluster, 4 * GiB)
    start = time.monotonic()
    assert cluster.sweep(now=start + 10)[0] == ["a"]
    assert cluster.routing_id_of("a") is not None and record.state is State.RUNNING
    cluster.sweep(now=start + 120)
    assert cluster.routing_id_of("a") is None and cluster.nodes_view() == []
    assert record.state is State.REMOVED and record.reason
    # the node may come back later: it starts from a clean GPU
    cluster.register("a", b"a2", "docker", gpu_infos("a"), [])
    assert reserved(cluster) == {"a-g0": 0}


# --- item 12: the host-process runtime -----------------------------------------------------------
def test_a_process_group_outliving_its_leader_keeps_its_grant_and_is_owned(tmp_path, manager):
    """Issue item 12: a host-process group runs, owned and charged, until its last member exits."""
    agent = AgentProc(tmp_path, manager, "node-pg", gpus="sim:1x8GiB", runtime="process")
    usage = tmp_path / "use"
    leader = None
    try:
        record = manager.post("/v1/containers", json={
            "gpu_memory": "2GiB", "env": {"GPUMGR_SIM_USAGE_FILE": str(usage)},
            "command": ["sh", "-c", f"echo {GiB} > {usage}; sleep 300 & exit 0"]}).json()
        assert record["state"] == "running", record
        leader = int(record["container_id"])
        uuid = record["gpus"][0]["uuid"]
        wait_for(lambda: process_gone(leader), 10, what="the group leader to exit")
        members = procmap.group_members(leader)
        assert members, "the backgrounded member should still run"
        # its member's use is charged to the grant (it is owned), and the grant is held
        wait_for(lambda: record_of(manager, record["id"])["gpu_memory_used"] == GiB, 15, what="the member's usage")
        assert record_of(manager, record["id"])["state"] == "running"
        assert manager.gpu(uuid)["memory_reserved"] == 2 * GiB
        assert manager.delete(f"/v1/containers/{record['id']}").json()["state"] == "removed"
        wait_for(lambda: all(process_gone(p) for p in members), 10, what="the group's member to be gone")
        assert manager.gpu(uuid)["memory_reserved"] == 0
    finally:
        agent.stop()
        if leader is not None:
            for pid in procmap.group_members(leader):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_process_group_that_ended_is_never_signalled_again(tmp_path, monkeypatch):
    """Issue item 12: once a group is gone its number may be reused, so no signal may be sent to it."""
    exits: list = []
    runtime = ProcessRuntime(exits.append, log_dir=str(tmp_path / "logs"))
    managed = runtime.create(ContainerSpec(grant="g-ended", name="g-ended", command=["true"], gpus=["GPU-x"],
                                           gpu_memory=GiB))
    wait_for(lambda: exits, 10, what="the group to end")
    assert not procmap.group_members(managed.pid)
    signalled = []
    real_killpg = os.killpg

    def spy(pgid, sig):
        signalled.append((pgid, sig))
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", spy)
    runtime.kill(managed.grant, "test")
    runtime.remove(managed.grant, 0.1)
    assert signalled == []


def test_auto_runtime_never_falls_back_to_host_processes_while_docker_is_down(tmp_path, monkeypatch):
    """Issue item 12: with an engine installed but not answering, runtime auto must wait and fail, not switch."""
    folder = tempfile.mkdtemp(prefix="gpumgr-")  # short: a socket path has a length limit
    try:
        path = os.path.join(folder, "docker.sock")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path)  # the socket file exists; nothing listens on it
        monkeypatch.setenv("DOCKER_HOST", f"unix://{path}")
        monkeypatch.setattr(defaults, "ENGINE_WAIT", 0.5)
        kw = {"network_mode": "none", "device_requests": "never", "gpu_kind": "sim",
              "log_dir": str(tmp_path / "logs"), "node": "node-auto"}
        with pytest.raises(OSError, match="did not answer"):
            build_runtime("auto", lambda m: None, **kw)
        # a host with no engine at all is where host processes are the answer
        monkeypatch.setenv("DOCKER_HOST", f"unix://{folder}/absent.sock")
        assert isinstance(build_runtime("auto", lambda m: None, **kw), ProcessRuntime)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- item 13: a send to a stale routing id ------------------------------------------------------
def test_a_create_for_an_agent_that_died_fails_at_once_and_frees_the_grant(tmp_path):
    """Issue item 13: a create whose frame cannot be routed fails with a 503, not a 504 after the timeout."""
    # the node stays "ready" long after its agent died, so the create is really sent to the stale routing id
    manager = ManagerProc(tmp_path, env={"GPUMGR_HEARTBEAT_LIVENESS": "60", "GPUMGR_CREATE_TIMEOUT": "15"})
    agent = None
    try:
        agent = AgentProc(tmp_path, manager, "node-gone", gpus="sim:1x8GiB", runtime="process")
        os.kill(agent.popen.pid, signal.SIGKILL)
        agent.popen.wait(10)
        time.sleep(1.5)  # let the manager's socket see the connection close (not an assertion)
        assert manager.node("node-gone")["state"] == "ready"
        response = manager.post("/v1/containers", json={"gpu_memory": "1GiB", "command": ["sleep", "30"]})
        assert response.status_code in (502, 503), response.text
        assert response.json()["error"]["code"] in ("no_agents", "agent_failed")
        assert manager.node("node-gone")["gpus"][0]["memory_reserved"] == 0
        failed = manager.get("/v1/containers", params={"state": "failed"}).json()["containers"]
        assert len(failed) == 1 and failed[0]["reason"]
    finally:
        if agent is not None:
            agent.stop()
        manager.stop()


def test_an_agent_re_reports_only_the_newest_ends_so_the_cap_holds() -> None:
    """Issue item 11: an agent with many exited containers registers only the newest ends, and every live one."""
    from gpumgr.agent.agent import _newest_ends
    from gpumgr.agent.runtimes.runtime import Managed

    live = [Managed(grant=f"live{i}", container_id=f"c{i}", name="n", gpus=["g"], gpu_memory=1) for i in range(3)]
    ended = [Managed(grant=f"end{i}", container_id=f"e{i}", name="n", gpus=["g"], gpu_memory=1, state="exited",
                     exit_code=0, finished_at=1000.0 + i) for i in range(50)]
    kept = _newest_ends(ended[:20] + live + ended[20:], 10)
    assert {m.grant for m in kept} == {m.grant for m in live} | {f"end{i}" for i in range(40, 50)}


def test_a_create_that_finished_after_a_manager_restart_is_never_adopted_over_the_gpu() -> None:
    """Review finding: a container created while the manager restarted was adopted on bytes granted to another."""
    cluster = Cluster()
    cluster.register("a", b"a", "docker", gpu_infos("a", size=10 * GiB), [])
    placed = cluster.reserve(PlacementSpec(memory=8 * GiB, count=1, placement="spread", image="i", command=[]))
    cluster.started(placed.id, ContainerReport(grant=placed.id, container_id="c1", gpus=placed.gpus,
                                               gpu_memory=8 * GiB, state="running"))
    late = ContainerReport(grant="late", container_id="c2", gpus=placed.gpus, gpu_memory=8 * GiB, state="running")
    mine = ContainerReport(grant=placed.id, container_id="c1", gpus=placed.gpus, gpu_memory=8 * GiB, state="running")
    removals = cluster.register("a", b"a2", "docker", gpu_infos("a", size=10 * GiB), [mine, late])[0]
    assert removals == ["late"]
    gpu = cluster.nodes_view()[0]["gpus"][0]
    assert gpu["memory_reserved"] == 8 * GiB and gpu["containers"] == [placed.id]
    refused = cluster.get("late")
    assert refused.state is State.FAILED and "no longer fit" in (refused.reason or "")


def test_a_hook_grant_is_not_expired_while_its_node_is_down() -> None:
    """Review finding: the sweep failed a task's grant while its node could not confirm it, then killed the task."""
    cluster = Cluster()
    cluster.register("a", b"a", "docker", gpu_infos("a"), [])
    hook = cluster.reserve(PlacementSpec(memory=GiB, count=1, placement="spread", image="i", command=[], node="a",
                                         hook=True), deadline=5.0)
    now = time.monotonic()
    cluster.sweep(now=now + cluster.down_after + 1)  # the node goes silent
    cluster.sweep(now=now + 60)  # long past the grant's deadline
    assert cluster.get(hook.id).state is State.CREATING
    status = ContainerStatus(grant=hook.id, container_id="t1", state="running")
    assert cluster.heartbeat("a", b"a", [], [status]) is None  # back from down: its whole report is asked for
    report = ContainerReport(grant=hook.id, container_id="t1", gpus=hook.gpus, gpu_memory=GiB, state="running",
                             hook=True)
    cluster.register("a", b"a", "docker", gpu_infos("a"), [report])  # its registration confirms the task
    assert cluster.get(hook.id).state is State.RUNNING
