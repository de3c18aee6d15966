"""The enforcer's decisions on real host processes: re-checks before acting, strikes, unmanaged PIDs."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from gpumgr.agent.enforcer import Enforcer, EnforcerSettings, Verdict
from gpumgr.agent.gpus.simgpu import SimSource, parse_sim_spec
from gpumgr.agent.procmap import start_time_of
from gpumgr.agent.runtimes.process_runtime import ProcessRuntime
from gpumgr.wire import defaults
from gpumgr.wire.protocol import ContainerSpec
from tests.procs import wait_for

GiB = 1 << 30


@pytest.fixture
def setup(tmp_path):
    devices = parse_sim_spec("sim:1x8GiB", seed=f"unit-{tmp_path.name}")
    source = SimSource(devices)
    exits: list = []
    runtime = ProcessRuntime(exits.append, log_dir=str(tmp_path / "logs"))
    overruns: list = []
    enforcer = Enforcer(source, devices, runtime, lambda m, d: overruns.append(d), EnforcerSettings(samples=2))
    yield tmp_path, devices[0].uuid, runtime, enforcer, overruns, exits
    for managed in runtime.managed():
        runtime.remove(managed.grant, 1)


def start(tmp_path: Path, runtime: ProcessRuntime, uuid: str, use: int, grant: str = "g1"):
    usage = tmp_path / f"{grant}.use"
    usage.write_text(str(use))
    spec = ContainerSpec(grant=grant, name=grant, command=["sleep", "300"], gpus=[uuid], gpu_memory=GiB,
                         env={"GPUMGR_SIM_USAGE_FILE": str(usage)})
    return runtime.create(spec), usage


def test_two_consecutive_samples_over_the_grant_are_needed(setup):
    tmp_path, uuid, runtime, enforcer, overruns, exits = setup
    _managed, usage = start(tmp_path, runtime, uuid, 2 * GiB)
    assert enforcer.check() is True and not overruns  # first strike: look again soon
    usage.write_text(str(GiB // 2))
    assert enforcer.check() is False and not overruns  # back under: strikes reset
    usage.write_text(str(2 * GiB))
    enforcer.check()
    enforcer.check()
    wait_for(lambda: exits, 5, what="the killed process to be reported")
    assert [o["reason"] for o in overruns] == ["gpu_memory_exceeded"]
    assert exits[0].state == "killed" and exits[0].detail["observed"] == 2 * GiB


def test_a_reused_pid_is_not_acted_on(setup):
    tmp_path, uuid, runtime, enforcer, overruns, _ = setup
    managed, _ = start(tmp_path, runtime, uuid, 2 * GiB)
    stale = Verdict(managed.grant, "gpu_memory_exceeded", uuid, 2 * GiB, GiB,
                    [(managed.pid, (start_time_of(managed.pid) or 0) - 1)])
    enforcer._act(managed, stale)
    assert not overruns and managed.state == "running"


def test_a_pid_now_outside_the_container_is_not_acted_on(setup):
    tmp_path, uuid, runtime, enforcer, overruns, _ = setup
    managed, _ = start(tmp_path, runtime, uuid, 2 * GiB)
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        moved = Verdict(managed.grant, "gpu_memory_exceeded", uuid, 2 * GiB, GiB,
                        [(stranger.pid, start_time_of(stranger.pid))])
        enforcer._act(managed, moved)
        assert not overruns and managed.state == "running" and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_gone_pid_is_not_acted_on(setup):
    tmp_path, uuid, runtime, enforcer, overruns, _ = setup
    managed, _ = start(tmp_path, runtime, uuid, 2 * GiB)
    gone = subprocess.Popen(["true"])
    gone.wait()
    enforcer._act(managed, Verdict(managed.grant, "gpu_memory_exceeded", uuid, 2 * GiB, GiB, [(gone.pid, 1)]))
    assert not overruns and managed.state == "running"


def test_unmanaged_processes_count_as_unmanaged_and_are_never_judged(setup):
    tmp_path, uuid, _runtime, enforcer, overruns, _ = setup
    usage = tmp_path / "stranger.use"
    usage.write_text(str(7 * GiB))
    stranger = subprocess.Popen(["sleep", "30"], env={"GPUMGR_SIM_USAGE_FILE": str(usage),
                                                      "NVIDIA_VISIBLE_DEVICES": uuid, "PATH": "/usr/bin:/bin"})
    try:
        for _ in range(3):
            enforcer.check()
        sample = enforcer.latest
        assert sample.gpus[0].memory_unmanaged == 7 * GiB and not sample.usage
        assert not overruns and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_growth_past_the_tightest_room_triggers_a_full_sample(setup):
    tmp_path, uuid, runtime, enforcer, _, _ = setup
    _, usage = start(tmp_path, runtime, uuid, GiB // 2)
    enforcer.check()
    assert enforcer._grew_past_room() is False
    usage.write_text(str(GiB // 2 + GiB // 4))
    assert enforcer._grew_past_room() is False  # still inside the grant's room
    usage.write_text(str(GiB + 1))
    assert enforcer._grew_past_room() is True


def test_a_first_over_reading_is_confirmed_at_the_confirm_interval_not_a_poll_later(setup):
    tmp_path, uuid, runtime, enforcer, overruns, exits = setup
    _, usage = start(tmp_path, runtime, uuid, GiB // 2)
    assert enforcer.next_interval(enforcer.check()) == enforcer.settings.sample_interval  # all quiet
    usage.write_text(str(2 * GiB))
    assert enforcer.next_interval(enforcer.check()) == defaults.OVERRUN_CONFIRM_INTERVAL  # strike 1: confirm soon
    assert not overruns
    enforcer.check()  # strike 2: acted on, nothing left to confirm
    assert not enforcer.confirming
    wait_for(lambda: exits, 5, what="the killed process to be reported")
    assert [o["reason"] for o in overruns] == ["gpu_memory_exceeded"]


def test_a_kill_that_frees_memory_cannot_hide_a_neighbours_growth(setup):
    """On a real GPU a killed process's bytes come back at once: the GPU's total falls, and a neighbour that then
    crosses its grant by less than was freed never made the total grow past the last full sample's."""
    tmp_path, uuid, runtime, enforcer, _, exits = setup
    start(tmp_path, runtime, uuid, 2 * GiB, grant="greedy")
    _, neighbour = start(tmp_path, runtime, uuid, GiB // 2, grant="neighbour")
    enforcer.check()
    enforcer.check()  # greedy is killed ...
    wait_for(lambda: exits, 5, what="the killed process to be reported")
    assert enforcer.source.memory_poll()[uuid] == GiB // 2  # ... and, as on NVML, its bytes are free at once
    assert enforcer._grew_past_room() is True  # a fall is looked at: the next full sample is taken now
    enforcer.check()
    neighbour.write_text(str(GiB + GiB // 2))  # over its grant, yet less than greedy gave back
    assert enforcer._grew_past_room() is True


def test_a_fall_in_use_triggers_one_full_sample_then_the_room_counts_from_there(setup):
    tmp_path, uuid, runtime, enforcer, _, _ = setup
    _, usage = start(tmp_path, runtime, uuid, 3 * GiB // 4)
    enforcer.check()
    usage.write_text(str(GiB // 4))
    assert enforcer._grew_past_room() is True
    enforcer.check()
    assert enforcer._grew_past_room() is False
    usage.write_text(str(GiB // 2))  # grew by less than the room left under the grant
    assert enforcer._grew_past_room() is False


class BlockingKills(ProcessRuntime):
    """A runtime whose kill of one chosen grant hangs until released, as a stuck engine call would."""

    def __init__(self, *args, stuck: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stuck, self.release, self.kills = stuck, threading.Event(), []

    def kill(self, grant, reason, detail=None) -> None:
        self.kills.append(grant)
        if grant == self.stuck:
            self.release.wait(30)
        super().kill(grant, reason, detail)


def test_kills_of_different_containers_do_not_wait_on_each_other_and_none_is_acted_on_twice(tmp_path):
    devices = parse_sim_spec("sim:1x8GiB", seed=f"unit-{tmp_path.name}")
    exits: list = []
    runtime = BlockingKills(exits.append, log_dir=str(tmp_path / "logs"), stuck="slow")
    enforcer = Enforcer(SimSource(devices), devices, runtime, lambda m, d: None, EnforcerSettings(samples=2))
    try:
        start(tmp_path, runtime, devices[0].uuid, 2 * GiB, grant="slow")
        start(tmp_path, runtime, devices[0].uuid, 2 * GiB, grant="fast")
        enforcer.check()
        enforcer.check()  # both confirmed: two kills handed to the workers; the slow one hangs
        wait_for(lambda: [m.grant for m in exits] == ["fast"], 10, what="the other container's kill")
        for _ in range(3):  # the slow one is still over and still running: it is not acted on again
            assert enforcer.check() is False
        assert runtime.get("slow").state == "running"
        runtime.release.set()
        wait_for(lambda: len(exits) == 2, 10, what="the stuck kill to go through")
        assert sorted(runtime.kills) == ["fast", "slow"]
    finally:
        runtime.release.set()
        enforcer.stop()
        for managed in runtime.managed():
            runtime.remove(managed.grant, 1)


@pytest.mark.docker
def test_cgroup_lookups_are_remembered_per_process_identity(docker_client, test_image, tmp_path):
    from gpumgr.agent.runtimes.docker_runtime import DockerRuntime
    from tests.procs import TEST_NODES

    node = f"unit-cgroup-{tmp_path.name}"[:60]
    TEST_NODES.add(node)
    runtime = DockerRuntime(lambda m: None, node=node, network_mode="none", client=docker_client)
    spec = ContainerSpec(grant="g-cgroup", name="cgroup", image=test_image, command=["sleep", "300"],
                         gpus=["GPU-x"], gpu_memory=GiB)
    try:
        managed = runtime.create(spec)
        pid = docker_client.api.inspect_container(managed.container_id)["State"]["Pid"]
        started = start_time_of(pid)
        assert runtime.owner_of(pid).grant == "g-cgroup"  # no start time: read afresh, nothing kept
        assert pid not in runtime._cgroups
        assert runtime.owner_of(pid, started).grant == "g-cgroup"
        assert runtime._cgroups[pid] == (started, [managed.container_id])
        runtime._cgroups[pid] = (started, [])  # what is remembered for this identity is used ...
        assert runtime.owner_of(pid, started) is None
        assert runtime.owner_of(pid, started + 1).grant == "g-cgroup"  # ... and another identity reads again
    finally:
        runtime.remove("g-cgroup", 1)
        runtime.close()


@pytest.mark.docker
def test_a_missed_start_event_is_caught_by_the_resync(docker_client, test_image, tmp_path):
    """Defect 9: a task whose start event was lost stayed ``creating`` for good (never enforced, never resizable)."""
    from gpumgr.agent.runtimes.docker_runtime import DockerRuntime
    from gpumgr.agent.runtimes.runtime import Managed
    from gpumgr.wire.names import State
    from tests.procs import TEST_NODES

    node = f"unit-resync-{tmp_path.name}"[:60]
    TEST_NODES.add(node)
    changes: list[str] = []
    runtime = DockerRuntime(lambda m: changes.append(str(m.state)), node=node, network_mode="none",
                            client=docker_client)
    container = docker_client.containers.run(test_image, ["sleep", "300"], detach=True, network_mode="none",
                                              labels={"gpumgr.test-node": node})
    try:
        managed = Managed(grant="g-resync", container_id=container.id, name="task", gpus=["GPU-x"], gpu_memory=GiB,
                          state=State.CREATING, hook=True)
        runtime._track(managed)  # a hook grant whose container started while the event stream was down
        runtime._resync()
        assert managed.state == State.RUNNING and changes == ["running"]
    finally:
        container.remove(force=True)
        runtime.close()


@pytest.mark.docker
def test_a_create_sent_again_to_a_new_agent_process_starts_the_container_once(docker_client, test_image, tmp_path):
    """The HA chaos suite's find: an agent killed between the engine's create and start; the manager sent the create
    again to the agent's new process, which refused it (the name was taken: 502 agent_failed, 'nothing ran'), and
    the container it had adopted was started all the same. Now the new process answers with that container, started."""
    from gpumgr.agent.runtimes.docker_runtime import DockerRuntime
    from gpumgr.agent.runtimes.runtime import managed_from_labels
    from gpumgr.wire.names import State
    from tests.procs import TEST_NODES

    node = f"unit-again-{tmp_path.name}"[:60]
    TEST_NODES.add(node)
    runtime = DockerRuntime(lambda m: None, node=node, network_mode="none", client=docker_client)
    spec = ContainerSpec(grant="g-again", name=f"again-{tmp_path.name}"[:60], image=test_image,
                         command=["sleep", "300"], gpus=["GPU-x"], gpu_memory=GiB)
    labels = {"gpumgr.grant": "g-again", "gpumgr.test-node": node}
    created = docker_client.api.create_container(test_image, ["sleep", "300"], name=spec.name, labels=labels,
                                                  host_config=docker_client.api.create_host_config(network_mode="none"))
    try:
        managed = managed_from_labels(created["Id"], labels, test_image, State.CREATING)
        managed.grant, managed.gpus, managed.gpu_memory = "g-again", ["GPU-x"], GiB
        runtime._track(managed)  # what the new process adopted: created by the old one, never started
        again = runtime.create(spec)
        assert again.container_id == created["Id"] and again.state == State.RUNNING
        assert docker_client.api.inspect_container(created["Id"])["State"]["Running"]
        named = docker_client.api.containers(all=True, filters={"name": spec.name})
        assert [c["Id"] for c in named] == [created["Id"]], "a second container was made"
    finally:
        docker_client.api.remove_container(created["Id"], force=True)
        runtime.close()


@pytest.mark.docker
def test_a_container_created_but_not_started_is_adopted_as_creating_and_its_late_start_kept(docker_client, test_image,
                                                                                          tmp_path):
    """The HA chaos suite's find: an agent killed between the engine's create and start; its new process adopted the
    never-started container as ``exited``, so when the engine carried out the old process's start, it took it for
    a restart behind gpumgr and killed it (exit 137) though its create had been answered 201."""
    import time

    from gpumgr.agent.runtimes.docker_runtime import DockerRuntime
    from gpumgr.agent.runtimes.runtime import grant_labels
    from gpumgr.wire.names import Label, State
    from tests.procs import TEST_NODES, wait_for

    node = f"unit-fresh-{tmp_path.name}"[:60]
    TEST_NODES.add(node)
    spec = ContainerSpec(grant="g-fresh", name=f"fresh-{tmp_path.name}"[:60], image=test_image,
                         command=["sleep", "300"], gpus=["GPU-x"], gpu_memory=GiB)
    labels = {**grant_labels(spec), Label.NODE: node}
    created = docker_client.api.create_container(test_image, ["sleep", "300"], name=spec.name, labels=labels,
                                                  host_config=docker_client.api.create_host_config(network_mode="none"))
    runtime = DockerRuntime(lambda m: None, node=node, network_mode="none", client=docker_client)
    try:
        managed = runtime.get("g-fresh")
        assert managed.state == State.CREATING and managed.exit_code is None
        docker_client.api.start(created["Id"])  # the old process's start lands
        wait_for(lambda: managed.state == State.RUNNING, 10, what="its start to be taken as the create's")
        time.sleep(1.0)  # a kill (taken for a restart behind gpumgr) would have come by now
        assert docker_client.api.inspect_container(created["Id"])["State"]["Running"]
    finally:
        docker_client.api.remove_container(created["Id"], force=True)
        runtime.close()
