"""The runtime hook as the guard's second fence: Swarm task creation skips authorization plugins.

On an engine whose default runtime is the gpumgr hook (and no guard), a container whose OCI spec
carries NVIDIA device nodes, a device rule for their major or every device, or the NVIDIA prestart
hook, and holds no grant, fails to start with the hook's reason in the engine's error; a container
that merely names ``NVIDIA_VISIBLE_DEVICES`` still runs on plain runc, without a GPU, as before.
"""

from __future__ import annotations

import pytest

from gpumgr.plugin.hook import gpu_in_spec
from tests.images import IMAGE, busybox_tar
from tests.swarm import SwarmEngine

pytestmark = pytest.mark.usefixtures("docker_client")


@pytest.fixture(scope="module")
def hook_engine():
    engine = SwarmEngine(busybox_tar())
    yield engine
    engine.stop()


@pytest.mark.parametrize("spec, words", [
    ({"linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]}}, "/dev/nvidia0"),
    ({"linux": {"devices": [{"path": "/dev/x", "type": "c", "major": 195, "minor": 255}]}}, "/dev/x"),
    ({"linux": {"resources": {"devices": [{"allow": True, "type": "c", "major": 195, "access": "rwm"}]}}}, "rules"),
    ({"linux": {"resources": {"devices": [{"allow": True, "access": "rwm"}]}}}, "rules"),
    ({"hooks": {"prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}]}}, "NVIDIA hook"),
])
def test_gpu_specs_are_recognised(spec, words):
    assert words in (gpu_in_spec(spec) or "")


def test_plain_specs_are_not():
    spec = {"linux": {"devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
                      "resources": {"devices": [{"allow": False, "access": "rwm"},
                                                {"allow": True, "type": "c", "major": 1, "access": "rwm"}]}},
            "hooks": {"prestart": [{"path": "/usr/bin/other-hook"}]}}
    assert gpu_in_spec(spec) is None


@pytest.mark.parametrize("args", [["--device-cgroup-rule", "c 195:* rwm"], ["--device", "/dev/null:/dev/nvidia0"]])
def test_a_gpu_container_without_a_grant_never_runs(hook_engine, args):
    result = hook_engine.docker("run", "--rm", "--network", "none", *args, IMAGE, "true", check=False)
    assert result.returncode != 0
    assert "holds no gpumgr grant" in result.stderr and "docker gpu run" in result.stderr, result.stderr


def test_plain_and_cuda_env_containers_still_run_on_plain_runc(hook_engine):
    for env in ([], ["-e", "NVIDIA_VISIBLE_DEVICES=all"]):
        result = hook_engine.docker("run", "--rm", "--network", "none", *env, IMAGE, "echo", "ran", check=False)
        assert result.returncode == 0 and result.stdout == "ran\n", result.stderr
