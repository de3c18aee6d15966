"""The engine is the reference for the guard's decoding: what it made of a body, read back, is what counts.

Hypothesis writes container-create bodies with and without GPU fields, in every spelling the engine
accepts (any case, the long s, keys given twice, the legacy top-level HostConfig fields). Each body
is created (never started) on a private engine without the guard, and ``docker inspect`` shows what
the engine made of it; the guard must deny exactly the bodies whose container got a GPU device,
runtime, device rule, privilege or guarded bind.
"""

from __future__ import annotations

import base64
import json
import random

import docker
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumgr.agent.guard.guard import Guard, GuardState
from gpumgr.wire.engine import gpudev
from tests.guard_dockerd import GuardEngine
from tests.images import IMAGE, busybox_tar

pytestmark = pytest.mark.usefixtures("docker_client")
POLICY = gpudev.Policy(default=gpudev.DefaultRuntime(frozenset({"runc"}), None))  # the reference engine's
#: how many generated bodies the engine made with a GPU (True), without (False), or refused (None)
SEEN: dict[bool | None, int] = {True: 0, False: 0, None: 0}

HOST_VALUES = {
    "Privileged": st.booleans(),
    "Runtime": st.sampled_from(["", "runc", "nvidia"]),
    "Binds": st.lists(st.sampled_from(["/tmp:/a", "/dev:/b", "/:/c", "/run/docker/plugins:/d"]), max_size=2,
                      unique=True),
    "DeviceCgroupRules": st.lists(st.sampled_from(["c 1:3 rwm", "c 195:* rwm", "a *:* rwm"]), max_size=2),
    "DeviceRequests": st.lists(st.just({"Count": -1, "Capabilities": [["gpu"]]}), max_size=1),
    # a device given in part: a second Devices decodes into the elements of the first (Go keeps their fields)
    "Devices": st.lists(st.sampled_from([{"PathOnHost": "/dev/null", "PathInContainer": "/dev/n",
                                          "CgroupPermissions": "rwm"}, {"PathOnHost": "/dev/nvidia0"},
                                         {"PathInContainer": "/dev/m", "CgroupPermissions": "r"}]), max_size=2),
}
CONFIG_VALUES = {"Env": st.lists(st.sampled_from(["A=1", "NVIDIA_VISIBLE_DEVICES=all"]), max_size=2)}


@st.composite
def spelling(draw, name: str) -> str:
    """``name`` in a spelling Go's decoder still matches: any case, and a long s for an s."""
    chars = [draw(st.sampled_from([c.lower(), c.upper()])) for c in name]
    chars = [("\u017f" if c in "sS" and draw(st.booleans()) else c) for c in chars]
    spelled = "".join(chars)
    return spelled if spelled != name or draw(st.booleans()) else name


@st.composite
def bodies(draw) -> str:
    """A create body as text: its fields spelled at random, some given twice, inside HostConfig or at the top."""
    pairs: list[tuple[str, object]] = [("Image", IMAGE), ("Cmd", ["true"])]
    for name, values in CONFIG_VALUES.items():
        if draw(st.booleans()):
            pairs.append((draw(spelling(name)), draw(values)))
    host: list[tuple[str, object]] = []
    for name, values in HOST_VALUES.items():
        for _ in range(draw(st.integers(0, 2))):  # absent, once, or twice (the second merges or replaces)
            host.append((draw(spelling(name)), draw(values)))
    where = draw(st.sampled_from(["inner", "top", "split", "null-then-top"]))
    if where == "inner":
        pairs.append((draw(spelling("HostConfig")), _Obj(host)))
    elif where == "top":
        pairs += host
    elif where == "split":  # one HostConfig given twice: Go merges them into one
        cut = draw(st.integers(0, len(host)))
        pairs += [(draw(spelling("HostConfig")), _Obj(host[:cut])), (draw(spelling("HostConfig")), _Obj(host[cut:]))]
    else:
        pairs += [("HostConfig", _Obj(host)), (draw(spelling("HostConfig")), None), *host]
    random.Random(draw(st.integers(0, 1000))).shuffle(pairs[2:])
    return _dump(pairs)


class _Obj(list):
    """An object kept as pairs, so duplicate keys survive until the text is written."""


def _dump(pairs) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {_value(v)}" for k, v in pairs) + "}"


def _value(value) -> str:
    return _dump(value) if isinstance(value, _Obj) else json.dumps(value)


@pytest.fixture(scope="module")
def reference():
    engine = GuardEngine(busybox_tar(), plugin=None)
    yield engine
    engine.stop()


def guard_denies(body: str) -> bool:
    guard = Guard(POLICY, GuardState())
    request = {"RequestMethod": "POST", "RequestUri": "/v1.41/containers/create",
               "RequestBody": base64.b64encode(body.encode()).decode()}
    return not guard.request(request).allow


def engine_made_a_gpu(engine: GuardEngine, body: str) -> bool | None:
    """Whether the container the engine made of ``body`` got a GPU field; None if it refused the body."""
    api = engine.client.api
    response = api._post(api._url("/containers/create"), data=body.encode(),
                         headers={"Content-Type": "application/json"})
    if response.status_code != 201:
        return None
    container_id = response.json()["Id"]
    try:
        made = api.inspect_container(container_id)
    finally:
        api.remove_container(container_id, force=True)
    canonical = {"Env": made["Config"].get("Env"), "Labels": made["Config"].get("Labels"),
                 "HostConfig": made["HostConfig"]}
    return bool(gpudev.create_reasons(canonical, POLICY))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(body=bodies())
def test_the_guard_denies_exactly_what_the_engine_would_give_a_gpu(reference, body):
    made = engine_made_a_gpu(reference, body)
    SEEN[made] += 1
    if made is None:
        return  # the engine refuses the body itself: nothing to give a GPU to
    assert guard_denies(body) == made, body


def test_the_reference_really_makes_gpu_containers(reference):
    """The check above could pass vacuously if the engine refused every GPU body: it does not."""
    base = {"Image": IMAGE, "Cmd": ["true"]}
    assert engine_made_a_gpu(reference, json.dumps({**base, "hostconfig": {"privileged": True}})) is True
    assert engine_made_a_gpu(reference, json.dumps({**base, "Runtime": "nvidia"})) is True
    assert engine_made_a_gpu(reference, json.dumps({**base, "HostConfig": {}, "Privileged": True})) is False
    # and the generated bodies were mostly made, both kinds of them
    assert SEEN[True] >= 10 and SEEN[False] >= 10, SEEN
    with pytest.raises(docker.errors.NotFound):
        reference.client.containers.get("never-created")
