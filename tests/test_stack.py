"""Stack files: ``docker gpu stack deploy`` reads ``x-gpumgr`` blocks and gives every replica its grant.

How the file is read is checked on its own (with ``docker stack config`` and with gpumgr's own merge,
which must agree); the deploy runs on a real one-node swarm of a throw-away engine (``tests/swarm.py``).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from gpumgr.plugin import services, stack
from gpumgr.plugin.docker_gpu import PluginError
from tests.images import busybox_tar
from tests.procs import ROOT, AgentProc, ManagerProc, wait_for
from tests.swarm import SwarmEngine

GiB = 1 << 30
IMAGE = "gpumgr-test/busybox:latest"
NODE = "client23-swarm"
STACK = "gs"


def write(folder: Path, name: str, text: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# --- reading the file ------------------------------------------------------------------------
BASE = """\
    version: "3.7"
    x-gpumgr: {gpu_memory: 1GiB, on_overrun: report}
    x-common: &common
      image: busybox
    services:
      train:
        <<: *common
        environment: ["A=1"]
        x-gpumgr: {gpu_memory: 3GiB, constraints: ["node.role==manager"], priority: 2}
      infer:
        <<: *common
        x-gpumgr:
      web:
        <<: *common
        deploy: {labels: {x-keep: "a label, not an extension"}}
    networks:
      net: {x-note: gone}
"""
OVERRIDE = """\
    version: "3.7"
    x-gpumgr: {gpus: 2}
    services:
      train:
        x-gpumgr: {gpu_memory: "${TRAIN_MEMORY:-5GiB}", constraints: ["node.hostname!=$${literal}"]}
"""


@pytest.mark.parametrize("use_cli", [False, True], ids=["own-merge", "docker-stack-config"])
def test_blocks_merge_and_interpolate_the_same_with_or_without_docker_stack_config(tmp_path, monkeypatch, use_cli):
    if use_cli and not (shutil.which("docker") and stack.has_stack_config()):
        pytest.skip("the Docker CLI on PATH has no 'docker stack config' (it came in 23)")
    paths = [write(tmp_path, "base.yml", BASE), write(tmp_path, "override.yml", OVERRIDE)]
    raws = [stack._load(p) for p in paths]
    monkeypatch.setenv("TRAIN_MEMORY", "6GiB")
    defaults, blocks = stack.read_blocks(paths, raws, use_cli=use_cli)
    assert defaults == {"gpu_memory": "1GiB", "on_overrun": "report", "gpus": 2}
    assert set(blocks) == {"train", "infer"}  # web has no block: it is a plain service
    assert blocks["infer"] == {}
    assert blocks["train"] == {"gpu_memory": "6GiB", "priority": 2,
                               "constraints": ["node.role==manager", "node.hostname!=${literal}"]}
    monkeypatch.delenv("TRAIN_MEMORY")
    assert stack.read_blocks(paths, raws, use_cli=use_cli)[1]["train"]["gpu_memory"] == "5GiB"


@pytest.mark.parametrize("use_cli", [False, True], ids=["own-merge", "docker-stack-config"])
def test_a_file_on_standard_input_is_read_once_for_both_readings(monkeypatch, use_cli):
    if use_cli and not (shutil.which("docker") and stack.has_stack_config()):
        pytest.skip("the Docker CLI on PATH has no 'docker stack config' (it came in 23)")
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(textwrap.dedent(BASE)))
    monkeypatch.setattr(stack, "_STDIN", [])
    raws = [stack._load("-")]
    assert stack.read_blocks(["-"], raws, use_cli=use_cli)[1]["train"]["gpu_memory"] == "3GiB"


def test_a_block_becomes_service_create_options_over_the_defaults():
    defaults = {"gpu_memory": "1GiB", "gpus": 2, "on_overrun": "report", "queue": True}
    argv = stack.grant_request("t", defaults, {"gpu_memory": "3GiB", "priority": 2, "preemptible": True,
                                               "constraints": ["a==b", "c!=d"], "queue": False})
    assert argv == ["--gpu-memory", "3GiB", "--gpus", "2", "--on-overrun", "report", "--priority", "2",
                    "--preemptible", "--constraint", "a==b", "--constraint", "c!=d"]
    for block, words in (({"gpu_mem": "1GiB"}, "no key 'gpu_mem'"), ({"preemptible": "yes"}, "true or false"),
                         ({"constraints": "a==b"}, "list of strings"), ({"gpus": [1]}, "a number or a string"),
                         ({"priority": True}, "a number or a string")):
        with pytest.raises(PluginError, match=words):
            stack.grant_request("t", {}, block)


def test_a_burstable_block_asks_the_hook_for_its_limit():
    """``gpu_memory_limit`` becomes ``--gpu-memory-limit``, which the task's environment carries to the hook."""
    argv = stack.grant_request("t", {}, {"gpu_memory": "4GiB", "gpu_memory_limit": "12GiB"})
    assert argv == ["--gpu-memory", "4GiB", "--gpu-memory-limit", "12GiB"]
    ours, _ = services._take_options(argv, services.SERVICE_OPTIONS)
    extra = services.grant_args(OneGpu(), ours)
    assert {f"--env=GPUMGR_REQUEST_MEMORY_LIMIT={12 * GiB}", f"--env=GPUMGR_REQUEST_MEMORY={4 * GiB}"} <= set(extra)
    with pytest.raises(PluginError, match="at least --gpu-memory"):
        services.grant_args(OneGpu(), {"--gpu-memory": "4GiB", "--gpu-memory-limit": "2GiB"})


class OneGpu:
    """A manager whose map is one ready node with one 24 GiB GPU (what ``grant_args`` checks a request against)."""

    def call(self, method: str, path: str, **_: object) -> dict:
        return {"nodes": [{"name": "n", "state": "ready", "labels": {},
                           "gpus": [{"uuid": "g", "index": 0, "name": "Sim", "memory_total": 24 * GiB}]}]}


def test_x_keys_are_stripped_where_compose_allows_them_and_nothing_else():
    raw = stack._load_text(BASE)
    stripped = stack.strip(raw)
    assert not [k for k in stripped if k.startswith("x-")] and stripped["version"] == "3.7"
    assert "x-gpumgr" not in stripped["services"]["train"] and stripped["services"]["train"]["image"] == "busybox"
    assert stripped["services"]["web"]["deploy"]["labels"] == {"x-keep": "a label, not an extension"}
    assert stripped["networks"]["net"] == {}
    assert stack.strip(stack._load_text("version: 3.7\nservices: {}\n"))["version"] == "3.7"


def test_compose_files_are_taken_out_and_every_other_argument_passes_through():
    paths, rest = stack._compose_files(["-c", "a.yml", "--compose-file=b.yml", "--resolve-image", "never", "-c=c.yml",
                                        "--prune", "app"])
    assert paths == ["a.yml", "b.yml", "c.yml"] and rest == ["--resolve-image", "never", "--prune", "app"]
    for argv, words in ((["app"], "needs the stack's file"), (["app", "-c"], "-c needs a file"),
                        (["-c", "-", "-c", "-", "app"], "only one -c -")):
        with pytest.raises(PluginError, match=words):
            stack._compose_files(argv)


def test_interpolation_follows_compose():
    env = {"SET": "v", "EMPTY": ""}
    cases = {"$SET ${SET}": "v v", "$$SET": "$SET", "${UNSET:-d}": "d", "${EMPTY:-d}": "d", "${EMPTY-d}": "",
             "${UNSET-d}": "d", "${UNSET}": "", "a$": "a$"}
    for given, expected in cases.items():
        assert stack.interpolate(given, env) == expected, given
    with pytest.raises(PluginError, match="required variable UNSET is missing a value: say it"):
        stack.interpolate({"k": ["${UNSET:?say it}"]}, env)


@pytest.mark.parametrize(("text", "words"), [
    ('version: "3.3"\nservices:\n  a:\n    image: x\n    x-gpumgr: {gpu_memory: 1GiB}\n',
     "x-gpumgr on service 'a' needs compose file format 3.7 or later, and the file says version \"3.3\""),
    ('version: "3.6"\nservices:\n  a:\n    image: x\n    x-gpumgr: {gpu_memory: 1GiB}\n',
     "needs compose file format 3.7"),
    ('version: "3.3"\nx-gpumgr: {gpu_memory: 1GiB}\nservices: {}\n',
     "a top-level x-gpumgr needs compose file format 3.4 or later"),
])
def test_x_keys_before_their_compose_format_are_a_clear_error(text, words):
    with pytest.raises(PluginError, match=words):
        stack.check_format("stack.yml", stack._load_text(text))


def test_x_keys_in_formats_that_allow_them_pass():
    for text in ('version: "3.7"\nx-gpumgr: {}\nservices: {a: {x-gpumgr: {}}}\n',
                 'version: "3.4"\nx-gpumgr: {}\nservices: {a: {image: x}}\n',
                 "x-gpumgr: {}\nservices: {a: {x-gpumgr: {}}}\n"):
        stack.check_format("stack.yml", stack._load_text(text))


def test_the_example_stack_says_what_each_service_gets():
    path = str(ROOT / "examples" / "swarm" / "inference.yml")
    raw = stack._load(path)
    stack.check_format(path, raw)
    defaults, blocks = stack.read_blocks([path], [raw], use_cli=False)
    assert set(blocks) == {"train", "infer"}
    assert stack.grant_request("train", defaults, blocks["train"]) == [
        "--gpu-memory", "20GiB", "--on-overrun", "kill", "--gpus", "2", "--priority", "5",
        "--constraint", "node.labels.zone==a"]
    assert stack.grant_request("infer", defaults, blocks["infer"]) == [
        "--gpu-memory", "6GiB", "--on-overrun", "kill", "--preemptible", "--queue"]


# --- on a real swarm -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(docker_client, tmp_path_factory):
    if shutil.which("dockerd") is None:
        pytest.fail("dockerd is needed for the swarm tests")
    engine = SwarmEngine(busybox_tar(shutil.which("busybox") or "/bin/busybox"))
    tmp = tmp_path_factory.mktemp("stack")
    manager = ManagerProc(tmp)
    agent = AgentProc(tmp, manager, NODE, gpus="sim:2x16GiB",
                      env={"DOCKER_HOST": engine.env["DOCKER_HOST"], "GPUMGR_HOOK_SOCKET": engine.hook_socket})
    yield engine, manager
    agent.stop()
    manager.stop()
    engine.stop()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def docker_gpu(engine: SwarmEngine, manager: ManagerProc, *args: str) -> subprocess.CompletedProcess:
    return engine.docker("gpu", "--manager", manager.url, *args, check=False)


STACK_FILE = """\
    version: "3.7"
    x-gpumgr: {gpu_memory: 1GiB, gpus: 2, on_overrun: report}
    x-task: &task
      image: %(image)s
      stop_grace_period: 1s
      environment: ["GPUMGR_SIM_USAGE_FILE=/tmp/use"]
      command: ["sh", "-c", "echo %(use)d > /tmp/use; exec sleep 3600"]
    services:
      train:
        <<: *task
        deploy: {replicas: 3}
        x-gpumgr: {gpu_memory: 3GiB, gpus: 1, priority: 4, preemptible: true, on_overrun: kill,
                   constraints: ["node.role==manager", "gpu.index==1"]}
      infer:
        <<: *task
        deploy: {replicas: 3}
        x-gpumgr:
      plain:
        image: %(image)s
        command: ["sleep", "3600"]
        stop_grace_period: 1s
"""


def live(manager: ManagerProc, service: str) -> list:
    return [r for r in manager.client.containers.list(service=f"{STACK}_{service}") if r.state == "running"]


def test_a_stack_gives_every_replica_its_services_grant_and_rm_ends_them(swarm, tmp_path):
    engine, manager = swarm
    path = write(tmp_path, "stack.yml", STACK_FILE % {"image": IMAGE, "use": GiB // 2})
    deployed = docker_gpu(engine, manager, "stack", "deploy", "-c", path, "--resolve-image", "never", STACK)
    assert deployed.returncode == 0, deployed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.yml"]  # the files handed to Docker are gone
    try:
        train = wait_for(lambda: len(t := live(manager, "train")) == 3 and t, 90, what="3 train replicas with grants")
        infer = wait_for(lambda: len(i := live(manager, "infer")) == 3 and i, 90, what="3 infer replicas with grants")
        assert {(r.gpu_memory, r.gpu_count, r.priority, r.preemptible, r.on_overrun) for r in train} == {
            (3 * GiB, 1, 4, True, "kill")}
        assert {(r.gpu_memory, r.gpu_count, r.priority, r.preemptible, r.on_overrun) for r in infer} == {
            (GiB, 2, 0, False, "report")}
        assert {g.index for r in train for g in r.gpus} == {1}  # the gpu.* constraint, checked by the hook
        assert {r.labels["gpumgr.service"] for r in train + infer} == {f"{STACK}_train", f"{STACK}_infer"}
        node = manager.client.nodes.get(NODE)
        assert sum(g.memory_reserved for g in node.gpus) == 3 * 3 * GiB + 3 * 2 * GiB
        for record in train + infer:  # each replica's container holds the grant the manager has for it
            pid = int(engine.docker("inspect", "--format", "{{.State.Pid}}", record.container_id).stdout)
            env = environ(pid)
            assert env["GPUMGR_GRANT"] == record.id and env["GPUMGR_SIM_USAGE_FILE"] == "/tmp/use"
            assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in record.gpus)
        plain = engine.docker("ps", "-q", "--filter", f"label=com.docker.swarm.service.name={STACK}_plain").stdout
        assert plain.strip() and not manager.client.containers.list(service=f"{STACK}_plain")
        labels = engine.docker("service", "inspect", "--format", "{{json .Spec.Labels}}", f"{STACK}_train").stdout
        assert '"gpumgr.gpu-memory":"3221225472"' in labels and "x-gpumgr" not in engine.docker(
            "service", "inspect", f"{STACK}_train").stdout
        table = wait_for(lambda: (t := docker_gpu(engine, manager, "stack", "ps", STACK).stdout).count("512MiB") == 6
                         and t, 30, what="stack ps to show each replica's usage")
        assert table.count("3GiB") == 3 and table.count("1GiB") == 3 and "GPU" in table.splitlines()[0]
        assert docker_gpu(engine, manager, "stack", "ls").stdout.count(STACK) == 1
    finally:
        removed = remove_stack(engine, manager)
    assert removed.returncode == 0, removed.stderr
    wait_for(lambda: not live(manager, "train") and not live(manager, "infer"), 60, what="every grant to end")
    assert all(g.memory_reserved == 0 for g in manager.client.nodes.get(NODE).gpus)


def remove_stack(engine, manager) -> subprocess.CompletedProcess[str]:
    """``docker gpu stack rm``, once more after the stack's containers are gone if the engine refused its network.

    ``docker stack rm`` (plain or through gpumgr) removes the services and then at once their networks,
    which the engine refuses while a task is still stopping ("network ... is in use by task",
    moby/moby#31068); run again once the containers are gone, it removes what is left.
    """
    removed = docker_gpu(engine, manager, "stack", "rm", STACK)
    if removed.returncode != 0 and "is in use by task" in removed.stderr:
        wait_for(lambda: not engine.docker("ps", "-aq", "--filter", f"label=com.docker.stack.namespace={STACK}")
                 .stdout.strip(), 60, what="the stack's containers to be gone")
        removed = docker_gpu(engine, manager, "stack", "rm", STACK)
    return removed


def test_a_format_3_3_file_with_x_gpumgr_is_refused_before_anything_is_deployed(swarm, tmp_path):
    engine, manager = swarm
    path = write(tmp_path, "old.yml", f"""\
        version: "3.3"
        services:
          old:
            image: {IMAGE}
            x-gpumgr: {{gpu_memory: 1GiB}}
    """)
    refused = docker_gpu(engine, manager, "stack", "deploy", "-c", path, "--resolve-image", "never", "old")
    assert refused.returncode == 1
    assert "x-gpumgr on service 'old' needs compose file format 3.7 or later" in refused.stderr, refused.stderr
    assert "old" not in engine.docker("stack", "ls").stdout
    too_big = write(tmp_path, "big.yml", f'version: "3.7"\nservices:\n  big:\n    image: {IMAGE}\n'
                    "    x-gpumgr: {gpu_memory: 20GiB}\n")
    refused = docker_gpu(engine, manager, "stack", "deploy", "-c", too_big, "--resolve-image", "never", "big")
    assert refused.returncode == 1 and "service 'big'" in refused.stderr and "largest" in refused.stderr
    assert "big" not in engine.docker("stack", "ls").stdout
