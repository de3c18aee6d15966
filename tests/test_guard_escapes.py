"""An attacker's tests of the guard: device paths that change after create, runtimes that skip the fence.

Each runs on private engines with the guard as their authorization plugin and tries what an attacker
would: a ``--device`` path made with a real ``mknod`` (or a real symbolic link re-pointed) after the
guard said yes, with ``--restart always`` so that restarts, which no plugin sees, resolve it again;
``--runtime runc`` past gpumgr's hook; a default runtime that hands out GPUs by environment (a stand-in
for ``nvidia-container-runtime`` that adds ``/dev/nvidia0``, major 195, when ``NVIDIA_VISIBLE_DEVICES``
is set, under names that do not say nvidia), set in daemon.json, by dockerd flag, or by a reload. A
case passes only if it is refused and no GPU node ever reached a container: every container lists its
``/dev`` into its log at each start, and the engine's inspect is read too.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from gpumgr.agent.guard.engine_watch import EngineWatch
from gpumgr.agent.guard.guard import Guard, GuardState
from gpumgr.wire.engine import engine_runtime, gpudev
from tests.guard_dockerd import GuardEngine
from tests.guardproc import GuardProc
from tests.images import IMAGE, busybox_tar
from tests.procs import ROOT, wait_for

pytestmark = pytest.mark.usefixtures("docker_client")
DENIED = "gpumgr guard:"
ENV_IMAGE = "gpumgr-test/cuda-env:latest"
LIST_DEV = ["sh", "-c", "ls -ln /dev; sleep 1"]
GPU_NODE = re.compile(r"\b195,\s+\d+\s|nvidia")
#: What NVIDIA's runtime does with an image's NVIDIA_VISIBLE_DEVICES, reduced to one fake GPU node.
FAKE_NVIDIA = f"""#!{sys.executable} -I
import json, os, sys
args = sys.argv[1:]
if "create" in args and "--bundle" in args:
    path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    spec = json.load(open(path))
    env = [e for e in spec["process"].get("env", []) if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    if env and env[-1].split("=", 1)[1] not in ("", "void", "none"):
        linux = spec.setdefault("linux", {{}})
        linux.setdefault("devices", []).append({{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0,
                                                 "fileMode": 438, "uid": 0, "gid": 0}})
        rules = linux.setdefault("resources", {{}}).setdefault("devices", [])
        rules.append({{"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rwm"}})
        json.dump(spec, open(path, "w"))
os.execvp("runc", ["runc", *args])
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    """The stand-in NVIDIA runtime, a link to it under another name, and a wrapper script that runs it."""
    folder = tmp_path_factory.mktemp("runtimes")
    (folder / "nvidia-container-runtime").write_text(FAKE_NVIDIA)
    (folder / "nvidia-container-runtime").chmod(0o755)
    (folder / "gpu-runtime").symlink_to("nvidia-container-runtime")
    (folder / "wrapped").write_text(f"#!/bin/sh\nexec {folder}/nvidia-container-runtime \"$@\"\n")
    (folder / "wrapped").chmod(0o755)
    return folder


def runtimes(tools: Path) -> dict:
    return {"nvidia": {"path": "runc"}, "gpuenv": {"path": str(tools / "gpu-runtime")},
            "wrapped": {"path": str(tools / "wrapped")}, "sandbox": {"path": "runc"}, "other": {"path": "runc"}}


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    proc = GuardProc(tmp_path_factory.mktemp("guard"))
    yield proc
    proc.remove()


@pytest.fixture(scope="module")
def engine(guard, tools):
    """Default runtime runc: the guard is the only fence."""
    engine = GuardEngine(busybox_tar(), guard.name, daemon={"runtimes": runtimes(tools)})
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def hooked(tmp_path_factory, tools):
    """gpumgr's hook as the default runtime, and a guard whose node lists runtime ``sandbox`` in guard_runtimes."""
    tmp = tmp_path_factory.mktemp("hooked")
    config = tmp / "agent.yaml"
    config.write_text("guard_runtimes: [sandbox]\n")
    proc = GuardProc(tmp, config=config)
    subprocess.run([sys.executable, "-m", "gpumgr", "plugin", "install", "--daemon-config", str(tmp / "daemon.json"),
                    "--bin-dir", str(tmp / "bin"), "--cli-plugins-dir", str(tmp / "cli"), "--runtime-config",
                    str(tmp / "runtime.json"), "--hook-socket", str(tmp / "hook.sock")],
                   cwd=ROOT, capture_output=True, check=True)
    daemon = json.loads((tmp / "daemon.json").read_text())
    engine = GuardEngine(busybox_tar(), proc.name, daemon={**daemon, "runtimes": {**runtimes(tools),
                                                                                  **daemon["runtimes"]}})
    assert engine.client.info()["DefaultRuntime"] == "gpumgr"
    yield engine
    engine.stop()
    proc.remove()


def env_image(engine: GuardEngine) -> str:
    """A CUDA-like image: its own ENV sets NVIDIA_VISIBLE_DEVICES=all (imported with --change: no container needed)."""
    if engine.docker("image", "inspect", ENV_IMAGE, check=False).returncode != 0:
        engine.docker("import", "--change", "ENV NVIDIA_VISIBLE_DEVICES=all", "-", ENV_IMAGE, input=busybox_tar())
    return ENV_IMAGE


def gpu_seen(engine: GuardEngine) -> list[str]:
    """Every sign that a GPU node reached a container of ``engine``: its devices, its /dev at each start, now."""
    found = []
    for cid in engine.docker("ps", "-aq", "--no-trunc").stdout.split():
        made = json.loads(engine.docker("inspect", cid).stdout)[0]
        for device in made["HostConfig"].get("Devices") or []:
            host = device["PathOnHost"]
            if os.path.exists(host) and os.major(os.stat(host).st_rdev) == 195:
                found.append(f"{cid[:12]}: device {host} is major 195 now")
        logs = engine.docker("logs", cid, check=False)
        if GPU_NODE.search(logs.stdout + logs.stderr):
            found.append(f"{cid[:12]} listed a GPU node in /dev: {logs.stdout[-600:]}")
        if made["State"]["Running"]:
            now = engine.docker("exec", cid, "ls", "-ln", "/dev", check=False).stdout
            if GPU_NODE.search(now):
                found.append(f"{cid[:12]} holds a GPU node: {now}")
    return found


def clean(engine: GuardEngine) -> None:
    for cid in engine.docker("ps", "-aq").stdout.split():
        engine.docker("rm", "-f", cid, check=False)


def restarted(engine: GuardEngine, cid: str) -> bool:
    state = json.loads(engine.docker("inspect", cid).stdout)[0]
    return state["RestartCount"] >= 1 and state["State"]["Running"]


def attempt(engine: GuardEngine, create: list[str], after_create) -> str:
    """Create (with --restart always), change the host under it, start, wait for a restart by policy.

    The create's stderr: the test's assertion is that it was refused; if it was not, the attack runs
    to its end so that :func:`gpu_seen` can see what reached the container.
    """
    result = engine.docker("create", "--restart", "always", "--network", "none", *create, IMAGE, *LIST_DEV,
                           check=False)
    if result.returncode == 0:
        cid = result.stdout.strip()
        after_create()
        if engine.docker("start", cid, check=False).returncode == 0:  # gpumgr's hook may refuse it here
            wait_for(lambda: restarted(engine, cid), 60, what="a restart by policy")
    return result.stderr


def mknod(path: Path, major: int, minor: int) -> None:
    path.unlink(missing_ok=True)
    subprocess.run(["mknod", str(path), "c", str(major), str(minor)], check=True)


# -- item 1: device paths that cannot change under us --

@pytest.mark.parametrize("how", ["mknod-after-create", "symlink-repointed", "replaced-before-restart",
                                 "dev-shm-node"])
def test_a_device_path_changed_after_create_never_gives_a_gpu(engine, guard, tmp_path, how):
    folder = Path(tempfile.mkdtemp(prefix="gpumgr-esc-", dir="/dev/shm")) if how == "dev-shm-node" else tmp_path
    node = folder / f"g-{uuid.uuid4().hex[:6]}"
    given = node
    if how == "symlink-repointed":
        given = tmp_path / "link"
        given.symlink_to("/dev/null")  # resolves into /dev at create
    elif how != "mknod-after-create":
        mknod(node, 1, 3)  # a harmless character device (null) when the guard looks

    def swap() -> None:
        mknod(node, 195, 0)
        if how == "symlink-repointed":
            given.unlink()
            given.symlink_to(node)
    try:
        refused = attempt(engine, ["--device", f"{given}:/dev/nvidia0"], swap)
        assert f"authorization denied by plugin {guard.name}: {DENIED}" in refused and "HostConfig.Devices" in refused
        assert gpu_seen(engine) == []
    finally:
        clean(engine)
        node.unlink(missing_ok=True)
        if folder != tmp_path:
            folder.rmdir()


def test_a_folder_of_dev_cannot_be_bound_and_real_devices_still_pass(engine, guard):
    dev = Path("/dev").stat().st_dev
    folder = next(p for p in Path("/dev").iterdir() if p.is_dir() and not p.is_symlink() and p.stat().st_dev == dev)
    denied = engine.docker("create", "-v", f"{folder}:/x", IMAGE, "true", check=False)
    assert denied.returncode != 0 and DENIED in denied.stderr and "folder of the host's /dev" in denied.stderr
    try:
        assert DENIED not in attempt(engine, ["--device", "/dev/null:/dev/x", "--device", "/dev/zero"], lambda: None)
        assert engine.docker("ps", "-q").stdout.strip()
        assert gpu_seen(engine) == []
    finally:
        clean(engine)


def test_with_the_hook_as_default_neither_fence_lets_a_changed_device_through(hooked, tmp_path):
    node = tmp_path / "g0"
    for runtime in ([], ["--runtime", "runc"], ["--runtime", "gpumgr"]):
        refused = attempt(hooked, [*runtime, "--device", f"{node}:/dev/nvidia0"], lambda: mknod(node, 195, 0))
        assert DENIED in refused and "HostConfig.Devices" in refused, (runtime, refused)
        node.unlink(missing_ok=True)
    assert gpu_seen(hooked) == []


# -- item 2: no runtime that skips the fence --

@pytest.mark.parametrize("runtime", ["runc", "io.containerd.runc.v2", "other", "gpuenv", "nvidia"])
def test_a_runtime_past_the_hook_is_refused(hooked, runtime):
    result = hooked.docker("run", "--rm", "--network", "none", "--runtime", runtime, env_image(hooked), *LIST_DEV,
                           check=False)
    assert result.returncode != 0 and DENIED in result.stderr and "HostConfig.Runtime" in result.stderr, result.stderr
    assert gpu_seen(hooked) == []


@pytest.mark.parametrize("runtime", [[], ["--runtime", "gpumgr"], ["--runtime", "sandbox"]])
def test_the_default_gpumgr_and_listed_runtimes_pass_without_a_gpu(hooked, runtime):
    try:
        result = hooked.docker("run", "-d", "--network", "none", *runtime, env_image(hooked), *LIST_DEV)
        wait_for(lambda: "null" in hooked.docker("logs", result.stdout.strip()).stdout, 30, what="the /dev listing")
        assert gpu_seen(hooked) == []
    finally:
        clean(hooked)


# -- item 4: the default runtime is not assumed plain --

def test_an_engine_the_guard_cannot_read_is_not_assumed_plain():
    create = {"RequestMethod": "POST", "RequestUri": "/v1.47/containers/create",
              "RequestBody": base64.b64encode(json.dumps({"Image": IMAGE}).encode()).decode()}
    guard = Guard(gpudev.Policy(), GuardState(), engines=EngineWatch())
    for pid, why in ((None, "did not name"), (os.getpid(), "is not dockerd"), (2**22 + 7, "cannot be read")):
        decision = guard.request(create, pid)
        assert not decision.allow and "cannot tell the engine's default runtime" in decision.message, decision
        assert why in decision.message
    assert not Guard(gpudev.Policy(), GuardState()).request(create).allow


def test_a_gpu_by_env_default_lets_only_granted_creates_through(tmp_path):
    policy = gpudev.Policy(default=gpudev.DefaultRuntime(frozenset({"gpuenv"}), "runtime 'gpuenv' is NVIDIA's"))
    guard = Guard(policy, GuardState(tmp_path / "state.json"))
    guard.state.add_ticket("t" * 32)

    def create(body: dict) -> bool:
        raw = base64.b64encode(json.dumps({"Image": IMAGE, **body}).encode()).decode()
        return guard.request({"RequestMethod": "POST", "RequestUri": "/v1.47/containers/create",
                              "RequestBody": raw}).allow
    assert not create({}) and not create({"HostConfig": {"Runtime": "gpuenv"}})
    assert create({"Labels": {"gpumgr.guard.ticket": "t" * 32}})
    assert create({"HostConfig": {"Runtime": "gpumgr"}})


@pytest.mark.parametrize("name", ["gpuenv", "wrapped", "hooked-args", "shim"])
def test_runtimes_handing_out_gpus_by_env_are_known_by_what_they_are(tools, name):
    defined = {**runtimes(tools), "hooked-args": {"path": "runc", "runtimeArgs": ["--hook", "/usr/bin/"
                                                                                             "nvidia-container-runtime-hook"]},
               "shim": {"runtimeType": "io.containerd.runc.v2", "options": {"BinaryName": str(tools / "gpu-runtime")}}}
    assert engine_runtime.gpu_by_env(name, defined) is not None
    for plain in ("runc", "sandbox", "io.containerd.runc.v2"):
        assert engine_runtime.gpu_by_env(plain, defined) is None


def install_guard(tmp: Path, engine: GuardEngine) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpumgr", "plugin", "install", "--guard", "--no-default-runtime",
         "--daemon-config", str(engine.dir / "daemon.json"), "--dockerd-pidfile", str(engine.dir / "docker.pid"),
         "--bin-dir", str(tmp / "bin"), "--cli-plugins-dir", str(tmp / "cli"), "--runtime-config",
         str(tmp / "runtime.json"), "--systemd-dir", str(tmp / "systemd"), "--guard-state", str(tmp / "gi.json"),
         "--guard-socket", "/run/docker/plugins/gpumgr-guard-absent.sock", "--hook-socket", str(tmp / "h.sock")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["daemon.json", "flag"])
def test_a_gpu_by_env_default_under_another_name_is_refused_by_install_and_the_guard(tmp_path, guard, tools, how):
    # the guard named in daemon.json, not by flag: install refuses a flag for a reason of its own
    daemon = {"runtimes": runtimes(tools), "authorization-plugins": [guard.name],
              **({"default-runtime": "wrapped"} if how == "daemon.json" else {})}
    engine = GuardEngine(busybox_tar(), None, daemon=daemon,
                         flags=("--default-runtime", "gpuenv") if how == "flag" else ())
    try:
        default = engine.client.info()["DefaultRuntime"]
        before = (engine.dir / "daemon.json").read_bytes()
        done = install_guard(tmp_path, engine)
        assert done.returncode == 2 and f"default runtime is {default!r}" in done.stderr, done.stderr
        assert (engine.dir / "daemon.json").read_bytes() == before
        result = engine.docker("run", "--network", "none", env_image(engine), *LIST_DEV, check=False)
        assert result.returncode != 0 and DENIED in result.stderr and "HostConfig.Runtime" in result.stderr
        assert gpu_seen(engine) == []
    finally:
        engine.stop()


def reload(engine: GuardEngine, default: str) -> None:
    daemon = engine.dir / "daemon.json"
    daemon.write_text(json.dumps({**json.loads(daemon.read_text()), "default-runtime": default}))
    os.kill(engine.proc.pid, signal.SIGHUP)
    wait_for(lambda: engine.client.info()["DefaultRuntime"] == default, 30, what="the engine's reload")


def test_a_default_changed_by_reload_is_judged_and_stays_suspect_until_the_engine_restarts(guard, tools):
    # named in daemon.json, as install --guard does: dockerd 20.10 drops a plugin named by flag at a reload
    engine = GuardEngine(busybox_tar(), None, daemon={"runtimes": runtimes(tools),
                                                      "authorization-plugins": [guard.name]})
    try:
        image = env_image(engine)
        engine.docker("run", "--rm", "--network", "none", image, "true")  # runc: the image's ENV gives nothing
        reload(engine, "gpuenv")
        result = engine.docker("run", "--network", "none", image, *LIST_DEV, check=False)
        assert result.returncode != 0 and DENIED in result.stderr and "'gpuenv'" in result.stderr, result.stderr
        assert gpu_seen(engine) == []
        reload(engine, "runc")  # the guard cannot see the reload: it keeps refusing until the engine restarts
        again = engine.docker("run", "--rm", "--network", "none", image, "true", check=False)
        assert again.returncode != 0 and "whether it reloaded" in again.stderr, again.stderr
        engine.proc.send_signal(signal.SIGTERM)
        engine.proc.wait(60)
        engine._log.close()
        engine.start()  # a new engine process, whose default has only ever been runc
        assert engine.docker("run", "--rm", "--network", "none", image, "true").returncode == 0
    finally:
        engine.stop()
