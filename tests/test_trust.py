"""The trusted agent link: CURVE on every frame, joins with a token, each node name bound to one key.

Each test plays the hostile neighbour or the careless operator against a real manager on real
sockets, and checks that the map, the grants and the containers are exactly as they were.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gpumgr.manager.api.app import create_app
from gpumgr.manager.config import ManagerSettings
from gpumgr.manager.service import Manager
from gpumgr.wire import protocol, security
from tests.fake_agent import FakeAgent, GiB
from tests.procs import AgentProc, ManagerProc, wait_for

SETTINGS = {"agents": "tcp://127.0.0.1:0", "create_timeout": 2.0, "heartbeat_interval": 0.2}


class Stack:
    """An in-process manager with its REST client, and the scripted agents a test adds."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.manager = Manager(ManagerSettings(**SETTINGS, state_dir=str(state)))
        self.manager.start()
        self.client = create_app(self.manager).test_client()
        self.stop = threading.Event()
        self.agents: list[FakeAgent] = []
        self.threads: list[threading.Thread] = []

    @property
    def endpoint(self) -> str:
        return self.manager.link.bound_endpoint

    def agent(self, node: str, *, serve: bool = True, token: str | None = None, **kw) -> FakeAgent:
        """A scripted agent for ``node``: joined, registered and answering, unless told otherwise."""
        agent = FakeAgent(self.endpoint, token or self.manager.admission.token(), node=node, **kw)
        self.agents.append(agent)
        if serve:
            agent.register()
            self.threads.append(agent.serve(self.stop))
        return agent

    def place(self, node: str, memory: str = "6GiB") -> dict:
        response = self.client.post("/v1/containers", json={"gpu_memory": memory, "image": "x", "node": node})
        assert response.status_code == 201, response.json
        return response.json

    def snapshot(self) -> tuple:
        """The parts of the map a forged frame could change: nodes, GPUs, grants, container states."""
        nodes = self.client.get("/v1/nodes").json["nodes"]
        containers = self.client.get("/v1/containers").json["containers"]
        return ([(n["name"], n["state"], n["runtime"], [(g["uuid"], g["memory_total"], g["memory_reserved"],
                                                       g["memory_unmanaged"]) for g in n["gpus"]]) for n in nodes],
                [(c["id"], c["node"], c["state"], c["gpu_memory"]) for c in containers])

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(2)
        for agent in self.agents:
            agent.close()
        self.manager.stop()


@pytest.fixture
def stack(tmp_path) -> Iterator[Stack]:
    stack = Stack(tmp_path / "state")
    yield stack
    stack.close()


def _settle() -> None:
    """Long enough for a frame to cross the link and be handled (several of the manager's ticks)."""
    time.sleep(0.5)


def _hears_nothing(agent: FakeAgent, wait: float = 0.5) -> bool:
    return not agent.socket.poll(int(wait * 1000))


def _forgeries(victim: str, grant: str) -> list[protocol.Message]:
    """Every kind of message a hostile peer would send about ``victim`` and its ``grant``."""
    evil_gpu = protocol.GpuInfo(uuid="GPU-evil-0", index=0, name="Evil", memory_total=80 * GiB)
    report = protocol.ContainerReport(grant=grant, container_id="f" * 64, gpus=["GPU-x"], gpu_memory=GiB,
                                      state="exited", exit_code=0)
    return [
        protocol.Register(node="evil", runtime="docker", gpus=[evil_gpu]),
        protocol.Register(node=victim, runtime="docker", gpus=[evil_gpu]),
        protocol.Heartbeat(node=victim, gpus=[], containers=[]),
        protocol.ContainerEvent(node=victim, container=report),
        protocol.Reserve(container_id="c" * 64, gpu_memory=GiB, node=victim),
        protocol.Reply(ok=True, result={"grant": grant}),
    ]


def test_a_plain_dealer_gets_nothing_through(stack) -> None:
    stack.agent("real")
    grant = stack.place("real")["id"]
    before = stack.snapshot()
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.setsockopt(zmq.SNDTIMEO, 1000)  # the failed handshake may leave it no pipe to queue in: do not hang
    plain.connect(stack.endpoint)
    try:
        for message in _forgeries("real", grant):
            with contextlib.suppress(zmq.Again):
                plain.send(protocol.encode(message))
        _settle()
        assert stack.snapshot() == before
        assert not plain.poll(300)
    finally:
        plain.close(linger=0)


def test_an_unadmitted_key_gets_nothing_through_and_is_sent_nothing(stack) -> None:
    stack.agent("real")
    grant = stack.place("real")["id"]
    before = stack.snapshot()
    stranger = stack.agent("evil", serve=False)  # CURVE with a key of its own, never joined
    for message in _forgeries("real", grant):
        stranger.send(message)
    assert _hears_nothing(stranger)
    assert stack.snapshot() == before


def test_an_admitted_key_speaks_only_for_its_own_node(stack) -> None:
    stack.agent("a")
    grant = stack.place("a")["id"]
    other = stack.agent("b", gpu_prefix="b")
    before = stack.snapshot()
    for message in _forgeries("a", grant):
        other.send(message)
    # speaking for itself, about a grant of another node
    report = protocol.ContainerReport(grant=grant, container_id="f" * 64, gpus=["GPU-a-0"], gpu_memory=GiB,
                                      state="exited", exit_code=0)
    other.send(protocol.ContainerEvent(node="b", container=report))
    _settle()
    assert stack.snapshot() == before
    assert stack.client.get(f"/v1/containers/{grant}").json["state"] == "running"


def test_a_name_bound_to_another_key_is_refused_and_the_node_in_place_untouched(stack) -> None:
    stack.agent("n")
    grant = stack.place("n")["id"]
    before = stack.snapshot()
    impostor = stack.agent("n", serve=False)  # a second agent with its own key and the same name
    reply = impostor.join()
    assert not reply.ok and reply.error is not None
    assert reply.error.code == "join_refused" and "bound to another agent's key" in reply.error.message
    impostor.send(protocol.Register(node="n", runtime="docker", gpus=impostor.gpus))
    assert _hears_nothing(impostor)
    assert stack.snapshot() == before
    assert stack.client.get(f"/v1/containers/{grant}").json["state"] == "running"


def test_a_key_bound_to_one_node_cannot_join_as_another(stack) -> None:
    agent = stack.agent("first", serve=False)
    agent.register()
    reply = agent.join(node="second")
    assert not reply.ok and "already bound to node 'first'" in reply.error.message


def test_a_gpu_held_by_another_live_node_is_refused(stack) -> None:
    stack.agent("a")
    before = stack.snapshot()
    twin = stack.agent("twin", serve=False, gpu_prefix="a")  # the same NVML GPUs seen by a second agent
    assert twin.join().ok
    twin.send(protocol.Register(node="twin", runtime="docker", gpus=twin.gpus))
    refused = twin.expect(protocol.Refused)
    assert refused.code == "gpu_conflict" and "already held by node a" in refused.message
    assert stack.snapshot() == before


def test_wrong_and_rotated_out_tokens_admit_nothing(stack) -> None:
    admitted = stack.agent("old")
    outsider = stack.agent("new", serve=False)
    assert not outsider.join(secret=security.new_join_secret()).ok
    old_secret = outsider.join_secret
    stack.manager.admission.rotate()
    reply = outsider.join(secret=old_secret)
    assert not reply.ok and "rotated out" in reply.error.message
    assert stack.manager.admission.node_of(outsider.keys.public) is None
    _, fresh = security.parse_token(stack.manager.admission.token())
    assert outsider.join(secret=fresh).ok
    # an agent admitted before the rotation stays admitted
    admitted.heartbeat(used=3 * GiB)
    wait_for(lambda: stack.snapshot()[0][0][3][0][3] == 3 * GiB, 5, what="the old agent's heartbeat to count")


def test_bindings_survive_a_manager_restart(tmp_path) -> None:
    first = Stack(tmp_path / "state")
    agent = first.agent("keeper")
    keys, token = agent.keys, first.manager.admission.token()
    first.close()
    second = Stack(tmp_path / "state")
    try:
        assert second.manager.admission.token() == token
        again = FakeAgent(second.endpoint, token, node="keeper", keys=keys)
        second.agents.append(again)
        again.joined = True  # no new join: the binding was kept
        again.register()
        assert second.manager.cluster.node_ready("keeper")
        stranger = second.agent("keeper", serve=False)
        assert not stranger.join().ok  # still bound to the first key
    finally:
        second.close()


def test_a_node_that_is_down_can_be_forgotten_with_its_binding(stack) -> None:
    stack.agent("gone")
    assert stack.client.delete("/v1/nodes/gone").status_code == 409  # it is up
    assert stack.client.delete("/v1/nodes/nobody").status_code == 404
    stack.stop.set()  # its agent falls silent
    for thread in stack.threads:
        thread.join(2)
    wait_for(lambda: not stack.manager.cluster.node_ready("gone"), 5, what="the node to be marked down")
    response = stack.client.delete("/v1/nodes/gone")
    assert response.status_code == 200, response.json
    assert stack.client.get("/v1/nodes").json["nodes"] == []
    assert stack.manager.admission.key_of("gone") is None


def test_the_state_directory_is_private(stack) -> None:
    assert stat.S_IMODE(os.stat(stack.state).st_mode) == 0o700
    stack.agent("n")
    for name in ("manager_key.json", "join_secret.json", "nodes.json"):
        assert stat.S_IMODE(os.stat(stack.state / name).st_mode) == 0o600, name


# --- the real commands -----------------------------------------------------------------------------

def _gpumgr(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumgr", *argv], capture_output=True, text=True, timeout=60)


def test_join_token_prints_the_token_last_and_rotates(tmp_path) -> None:
    state = str(tmp_path / "state")
    first = _gpumgr("join-token", "--state-dir", state)
    assert first.returncode == 0, first.stderr
    token = first.stdout.strip().splitlines()[-1]
    assert security.parse_token(token)
    assert _gpumgr("join-token", "--state-dir", state).stdout.strip().splitlines()[-1] == token
    rotated = _gpumgr("join-token", "--state-dir", state, "--rotate").stdout.strip().splitlines()[-1]
    assert rotated != token and rotated.split("-")[2] == token.split("-")[2]  # same manager key, new secret


def test_keys_are_created_once_when_two_processes_race(tmp_path) -> None:
    state = str(tmp_path / "state")
    runs = [subprocess.Popen([sys.executable, "-m", "gpumgr", "join-token", "--state-dir", state],
                             stdout=subprocess.PIPE, text=True) for _ in range(4)]
    tokens = {run.communicate(timeout=60)[0].strip().splitlines()[-1] for run in runs}
    assert len(tokens) == 1


@pytest.fixture
def manager_proc(tmp_path) -> Iterator[ManagerProc]:
    proc = ManagerProc(tmp_path)
    yield proc
    proc.stop()


def test_an_agent_with_a_wrong_or_rotated_token_says_so_and_exits(tmp_path, manager_proc) -> None:
    good = manager_proc.token()
    wrong = good[: -64] + security.new_join_secret()
    agent = AgentProc(tmp_path, manager_proc, "wrong", runtime="process", wait=False,
                      state_dir=tmp_path / "wrong", join=False, env={"GPUMGR_JOIN_TOKEN": wrong})
    assert agent.popen.wait(30) == 1
    assert "refused this agent" in agent.output() and "wrong or was rotated out" in agent.output()
    garbage = _gpumgr("agent", "--manager", manager_proc.endpoint, "--join", "nonsense", "--gpus", "sim:1x1GiB",
                      "--state-dir", str(tmp_path / "garbage"))
    assert garbage.returncode == 2 and "not a gpumgr join token" in garbage.stderr
    unjoined = _gpumgr("agent", "--manager", manager_proc.endpoint, "--gpus", "sim:1x1GiB",
                       "--state-dir", str(tmp_path / "unjoined"))
    assert unjoined.returncode == 2 and "has not joined a manager" in unjoined.stderr


def test_a_second_agent_with_the_same_name_is_refused_on_both_sides(tmp_path, manager_proc) -> None:
    first = AgentProc(tmp_path, manager_proc, "twin-name", gpus="sim:1x8GiB", runtime="process")
    try:
        second = AgentProc(tmp_path, manager_proc, "twin-name", gpus="sim:1x8GiB", runtime="process", wait=False,
                           state_dir=tmp_path / "second")
        assert second.popen.wait(30) == 1
        assert "bound to another agent's key" in second.output()
        assert "bound to another agent's key" in manager_proc.output()
        assert manager_proc.node("twin-name")["state"] == "ready" and first.popen.poll() is None
    finally:
        first.stop()


def test_a_restarted_agent_needs_no_token(tmp_path, manager_proc) -> None:
    agent = AgentProc(tmp_path, manager_proc, "returning", gpus="sim:1x8GiB", runtime="process")
    agent.stop()
    again = AgentProc(tmp_path, manager_proc, "returning", gpus="sim:1x8GiB", runtime="process", join=False,
                      state_dir=agent.state_dir)
    try:
        assert manager_proc.node("returning")["state"] == "ready"
    finally:
        again.stop()


def test_node_rm_forgets_a_down_node(tmp_path, manager_proc) -> None:
    agent = AgentProc(tmp_path, manager_proc, "leaving", gpus="sim:1x8GiB", runtime="process")
    env = {**os.environ, "GPUMGR_MANAGER": manager_proc.url}
    up = subprocess.run([sys.executable, "-m", "gpumgr", "node", "rm", "leaving"], capture_output=True, text=True,
                        env=env, timeout=60)
    assert up.returncode == 1 and "is up" in up.stderr
    agent.stop()
    wait_for(lambda: manager_proc.node("leaving")["state"] == "down", 10, what="the node to be down")
    gone = subprocess.run([sys.executable, "-m", "gpumgr", "node", "rm", "leaving"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert gone.returncode == 0, gone.stderr
    assert manager_proc.node("leaving") is None


def test_an_exit_detail_nested_without_end_is_cut_and_every_view_still_answers(stack) -> None:
    """A node's own event may carry any ``detail``; one nested 500 deep once made every list of containers a 500."""
    agent = stack.agent("deep")
    placed = stack.place("deep")
    deep: dict = {}
    level = deep
    for _ in range(500):
        level["more"] = {}
        level = level["more"]
    wide = {f"k{i}": i for i in range(10_000)}
    report = agent.reports[placed["id"]].model_copy(update={"state": "exited", "exit_code": 3})
    agent.send(protocol.ContainerEvent(node="deep", container=report, detail={"deep": deep, "wide": wide}))
    def exited():
        answer = stack.client.get(f"/v1/containers/{placed['id']}")
        return answer if answer.status_code != 200 or answer.json["state"] == "exited" else None

    record = wait_for(exited, 10, what="the exit to be recorded")
    assert record.status_code == 200, record.json
    for path in ("/v1/containers", f"/v1/containers/{placed['id']}", "/v1/events", "/v1/nodes", "/metrics"):
        answer = stack.client.get(path)
        assert answer.status_code == 200, (path, answer.status_code)
    detail = record.json["detail"]
    depth, level = 0, detail["deep"]
    while isinstance(level, dict) and "more" in level:
        depth, level = depth + 1, level["more"]
    assert depth < 10 and len(detail["wide"]) <= 64, (depth, len(detail["wide"]))
