"""Shared fixtures: a real Docker engine and test image, real manager and agent processes."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.images import IMAGE as TEST_IMAGE
from tests.images import busybox_tar
from tests.procs import TEST_NODES, AgentProc, ManagerProc

#: The ``GPUMGR_*`` variables the test harness itself reads (CI and tests/run set them); any other is the user's own
#: (``GPUMGR_TOKEN`` and ``GPUMGR_MANAGER``, as the README tells users of docker gpu and the client to export).
HARNESS_ENV = frozenset({"GPUMGR_REQUIRE_DOCKER", "GPUMGR_REQUIRE_GPU", "GPUMGR_REQUIRE_ETCD", "GPUMGR_REQUIRE_BROWSER",
                         "GPUMGR_VENV", "GPUMGR_IMAGE_CACHE", "GPUMGR_MODEL_EXAMPLES", "GPUMGR_CHAOS_SEED"})


def pytest_configure(config: pytest.Config) -> None:
    """Start every test from a clean ``GPUMGR_*`` environment, before any test module is read.

    gpumgr's settings read ``GPUMGR_*`` variables, so an exported token or manager address would reach the
    in-process managers and every process the tests start (issue 33); the tests set what they need themselves.
    """
    for name in [name for name in os.environ if name.startswith("GPUMGR_") and name not in HARNESS_ENV]:
        del os.environ[name]


def _require(flag: str, reason: str) -> None:
    if os.environ.get(flag) == "1":
        pytest.fail(f"{reason}, and {flag}=1 forbids skipping")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client():
    """A client of a Docker engine that answers; skips (or fails in CI) without one."""
    import docker

    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:  # any failure means there is no engine to test against
        _require("GPUMGR_REQUIRE_DOCKER", f"no Docker engine answers ({exc})")
    yield client
    client.close()


@pytest.fixture(scope="session")
def test_image(docker_client) -> str:
    """A tiny local image holding a static busybox, built without any registry."""
    try:
        docker_client.images.get(TEST_IMAGE)
        return TEST_IMAGE
    except Exception:  # not built yet
        pass
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not Path(busybox).exists():
        pytest.fail("busybox is needed to build the test image: apt-get install busybox-static")
    docker_client.api.import_image_from_data(busybox_tar(busybox), repository=TEST_IMAGE.split(":")[0], tag="latest")
    return TEST_IMAGE


@pytest.fixture
def cleanup_containers(docker_client) -> Iterator[None]:
    """Remove every gpumgr-managed container of the tests' nodes that a test leaves behind."""
    yield
    # the engine's own list, no inspect per container: one removed meanwhile (another run on the same engine,
    # or the agent finishing its own removal) must not fail the teardown
    for container in docker_client.api.containers(all=True, filters={"label": "gpumgr.grant"}):
        if (container.get("Labels") or {}).get("gpumgr.node") not in TEST_NODES:
            continue
        with contextlib.suppress(Exception):  # already gone
            docker_client.api.remove_container(container["Id"], force=True)


@pytest.fixture
def manager(tmp_path) -> Iterator[ManagerProc]:
    """A ``gpumgr manager`` process on free loopback ports."""
    proc = ManagerProc(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
def docker_agent(tmp_path, manager, test_image, cleanup_containers) -> Iterator[AgentProc]:
    """One ``gpumgr agent`` with two simulated 24 GiB GPUs and the Docker runtime, registered and ready."""
    proc = AgentProc(tmp_path, manager, "node-a", gpus="sim:2x24GiB")
    yield proc
    proc.stop()


@pytest.fixture
def etcd(tmp_path) -> Iterator[object]:
    """One real etcd member on loopback (skips without an etcd server unless GPUMGR_REQUIRE_ETCD=1)."""
    from tests.etcd import EtcdCluster

    cluster = EtcdCluster(tmp_path, size=1)
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd3(tmp_path) -> Iterator[object]:
    """A real three-member etcd cluster on loopback."""
    from tests.etcd import EtcdCluster

    cluster = EtcdCluster(tmp_path, size=3)
    yield cluster
    cluster.stop()
