"""``--shm-size``, ``-m`` and REST ``shm_size`` / ``mem_limit`` read as the Docker CLI reads them (issue 33).

Every row is given to the real ``docker create`` and to gpumgr (the REST field, and ``docker gpu run``'s flag
read into a request body); the engine's ``docker inspect`` of both containers must agree, and a size the
Docker CLI (or the engine behind it) refuses must be a validation error in gpumgr too.
"""

from __future__ import annotations

import subprocess
from typing import Any

import pydantic
import pytest

from gpumgr.agent.runtimes.docker_run import create_options
from gpumgr.plugin.run_flags import build_request, parser
from gpumgr.wire.protocol import ContainerSpec
from gpumgr.wire.runspec import RunSpec

#: Sizes as people (and odd inputs) write them: units and case, 'b' and 'ib', decimals, exponents, spaces,
#: Go's hexadecimal floats and underscores, zero (the engine's default), negatives, and the out-of-range.
SIZES = ["1g", "1G", "1gb", "1GB", "1gib", "1GiB", "1Kib", "1kB", "64m", "1.5g", "0.3m", ".5k", "5.k", "1e3",
         "1E3k", "2.5e-1k", "+1k", "1b", "1B", "100", "1t", "1p", "1 g", "1.5 GiB", "8e18", "1_000", "0x1p4",
         "0x_1p4", "0", "-0", "0.5",
         "1gi", "1Mi", "1  g", " 1g", "1g ", "-1k", "1bb", "1kbb", "1x", "1e400", "9223372036854775807", "",
         "1.2.3", "1__0", "k", ".", "0x10", "1 gib b"]
#: Host memory limits: the same reading, and the engine's floor of 6 MiB (0 is no limit).
MEMORY = ["256m", "256M", "0.25g", "1g", "16GiB", "6m", "6291456", "0", "0.5", "5m", "1k", "1gi", "-1g", "12 m"]


def docker_cli(flag: str, size: str, image: str) -> int | None:
    """What ``docker create FLAG SIZE`` gives the container (the ``HostConfig`` field), or None if it is refused."""
    field = "ShmSize" if flag == "--shm-size" else "Memory"
    created = subprocess.run(["docker", "create", flag, size, image, "true"], capture_output=True, text=True,
                             timeout=60)
    if created.returncode != 0:
        return None
    container = created.stdout.strip()
    try:
        shown = subprocess.run(["docker", "inspect", "-f", f"{{{{.HostConfig.{field}}}}}", container],
                               capture_output=True, text=True, timeout=60, check=True)
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
    return int(shown.stdout)


def gpumgr_engine(docker_client: Any, field: str, value: object, image: str) -> int | None:
    """What the agent gives the container when a request's ``field`` is ``value``, or None if gpumgr refuses it."""
    try:
        run = RunSpec.model_validate({field: value})
    except pydantic.ValidationError:
        return None
    spec = ContainerSpec(grant="g", name="sizes", gpus=["0"], gpu_memory=1, run=run)
    container = docker_client.containers.create(image, ["true"], **create_options(spec, None, None))
    try:
        config = docker_client.api.inspect_container(container.id)["HostConfig"]
    finally:
        container.remove(force=True)
    return int(config["ShmSize" if field == "shm_size" else "Memory"])


def flag_value(flag: str, size: str) -> object:
    """The body field ``docker gpu run FLAG SIZE`` sends to the manager (None if the flag is refused there)."""
    try:
        body = build_request(parser(ValueError).parse_args(["--gpu-memory", "1G", flag, size, "image"]), ValueError)
    except ValueError:
        return None
    return body["shm_size" if flag == "--shm-size" else "mem_limit"]


@pytest.mark.parametrize(("flag", "field", "size"), [("--shm-size", "shm_size", s) for s in SIZES]
                         + [("--memory", "mem_limit", s) for s in MEMORY])
def test_a_size_reads_as_the_docker_cli_reads_it(docker_client, test_image, flag, field, size) -> None:
    expected = docker_cli(flag, size, test_image)
    assert gpumgr_engine(docker_client, field, size, test_image) == expected, "the REST field"
    from_flag = flag_value(flag, size)  # refused by the flags' reader, or sent on for the manager to judge
    through = None if from_flag is None else gpumgr_engine(docker_client, field, from_flag, test_image)
    assert through == expected, "docker gpu run's flag"


def test_the_table_holds_what_the_issue_measured(docker_client, test_image) -> None:
    # the figure the issue reported: docker run --shm-size 1g is 2**30 bytes, and so is gpumgr's
    assert docker_cli("--shm-size", "1g", test_image) == 2**30
    assert gpumgr_engine(docker_client, "shm_size", "1g", test_image) == 2**30


def test_a_refused_size_is_a_validation_error_naming_the_field() -> None:
    for body in ({"shm_size": "1gi"}, {"mem_limit": "-1g"}, {"shm_size": "1" * 200}, {"mem_limit": True}):
        with pytest.raises(pydantic.ValidationError) as refused:
            RunSpec.model_validate(body)
        assert next(iter(body)) in str(refused.value)
