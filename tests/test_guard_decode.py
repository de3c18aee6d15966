"""The guard's reading of request bodies: Go's decoding rules, and what counts as asking for a GPU."""

from __future__ import annotations

import json

import pytest

from gpumgr.wire.engine import gojson, gpudev

POLICY = gpudev.Policy(default=gpudev.DefaultRuntime(frozenset({"runc"}), None))


def reasons(body: str | bytes) -> list[str]:
    raw = body.encode() if isinstance(body, str) else body
    return gpudev.create_reasons(gojson.decode(raw, gpudev.CREATE), POLICY)


@pytest.mark.parametrize("key", ["Privileged", "privileged", "PRIVILEGED", "pRiViLeGeD"])
def test_struct_keys_fold_case(key):
    assert reasons(json.dumps({"Image": "x", "HostConfig": {key: True}}))


def test_long_s_and_kelvin_fold_onto_ascii_fields():
    assert reasons('{"HostConfig": {"Bind\u017f": ["/dev:/dev"]}}')  # Binds with a long s
    assert gojson.fold("\u212a") == "K"  # Kelvin sign
    # a dotless i is no i in Go's simple folding: "Prıvileged" is not Privileged
    assert not reasons('{"HostConfig": {"Pr\u0131vileged": true}}')


def test_duplicate_host_config_merges_so_a_hidden_request_counts():
    body = '{"HostConfig": {"DeviceRequests": [{"Count": -1, "Capabilities": [["gpu"]]}]}, "hostconfig": {}}'
    assert any("DeviceRequests" in r for r in reasons(body))


def test_duplicate_scalar_keeps_the_last_and_null_leaves_a_bool():
    assert not reasons('{"HostConfig": {"Privileged": true, "privileged": false}}')
    assert reasons('{"HostConfig": {"Privileged": true, "privileged": null}}')


def test_null_host_config_brings_back_the_legacy_top_level_fields():
    assert reasons('{"Privileged": true}')
    assert reasons('{"HostConfig": {"Privileged": true}, "HostConfig": null, "Runtime": "nvidia"}')
    # an inner HostConfig, even empty, makes the engine ignore the top-level ones
    assert not reasons('{"HostConfig": {}, "Privileged": true}')


def test_slice_elements_merge_field_by_field():
    body = ('{"HostConfig": {"Devices": [{"PathOnHost": "/dev/nvidia0"}], '
            '"devices": [{"PathInContainer": "/dev/x"}]}}')
    decoded = gojson.decode(body.encode(), gpudev.CREATE)
    assert decoded["HostConfig"]["Devices"] == [{"PathOnHost": "/dev/nvidia0", "PathInContainer": "/dev/x"}]


def test_map_keys_are_exact_and_the_last_wins():
    decoded = gojson.decode(b'{"Labels": {"a": "1", "A": "2", "a": "3"}, "labels": {"b": "4"}}', gpudev.CREATE)
    assert decoded["Labels"] == {"a": "3", "A": "2", "b": "4"}


@pytest.mark.parametrize("raw", [b"", b"{", b'{"Image": "x"} {}', b'{"Image": "x"}garbage', b"\xff\xfe{}",
                                 b'{"HostConfig": {"Privileged": NaN}}', b'{"HostConfig": []}',
                                 b'{"HostConfig": {"Binds": "/dev:/dev"}}', b"[" * 100000])
def test_unreadable_bodies_raise(raw):
    with pytest.raises(gojson.BodyError):
        gojson.decode(raw, gpudev.CREATE)


@pytest.mark.parametrize("body, field", [
    ({"HostConfig": {"DeviceRequests": [{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=all"]}]}}, "DeviceRequests"),
    ({"HostConfig": {"Devices": [{"PathOnHost": "nvidia.com/gpu=0"}]}}, "CDI"),
    ({"HostConfig": {"Devices": [{"PathOnHost": "/dev/nvidia0"}]}}, "Devices"),
    ({"HostConfig": {"Devices": [{"PathOnHost": "/dev"}]}}, "Devices"),
    ({"HostConfig": {"Devices": [{"PathOnHost": "/dev/char/195:0"}]}}, "Devices"),
    ({"HostConfig": {"DeviceCgroupRules": ["c *:* rwm"]}}, "DeviceCgroupRules"),
    ({"HostConfig": {"DeviceCgroupRules": ["a"]}}, "DeviceCgroupRules"),
    ({"HostConfig": {"Binds": ["/:/host"]}}, "Binds"),
    ({"HostConfig": {"Binds": ["/etc/docker:/x:ro"]}}, "Binds"),
    ({"HostConfig": {"Binds": ["/run/docker/plugins:/x"]}}, "Binds"),
    ({"HostConfig": {"Mounts": [{"Type": "bind", "Source": "/dev/dri", "Target": "/x"}]}}, "Mounts"),
    ({"HostConfig": {"Mounts": [{"Type": "volume", "Target": "/x", "VolumeOptions": {
        "DriverConfig": {"Options": {"device": "/dev", "o": "bind", "type": "none"}}}}]}}, "Mounts"),
    ({"Env": ["NVIDIA_DRIVER_CAPABILITIES=all"]}, "NVIDIA_DRIVER_CAPABILITIES"),
    ({"Env": ["GPUMGR_REQUEST_MEMORY=1GiB", "GPUMGR_REQUEST_PRIORITY=1000000"]}, "GPUMGR_REQUEST_PRIORITY"),
    ({"Labels": {"gpumgr.grant": "forged"}}, "gpumgr.grant"),
    ({"Labels": {"com.docker.swarm.task.id": "forged"}}, "com.docker.swarm"),
])
def test_each_gpu_field_is_named_in_the_reason(body, field):
    found = reasons(json.dumps(body))
    assert found and field in found[0]


@pytest.mark.parametrize("body", [
    {"Image": "busybox", "Cmd": ["true"], "HostConfig": {"Binds": ["/tmp:/tmp", "vol:/data"], "Runtime": "runc"}},
    {"Env": ["GPUMGR_REQUEST_MEMORY=1GiB", "CUDA_VISIBLE_DEVICES=0"], "HostConfig": {"Devices": [
        {"PathOnHost": "/dev/null"}], "DeviceCgroupRules": ["c 1:3 rwm"]}},
    {"Labels": {"team": "ml"}, "HostConfig": {"Mounts": [{"Type": "tmpfs", "Target": "/x"}]}},
])
def test_plain_containers_pass(body):
    assert reasons(json.dumps(body)) == []


def test_a_symlink_to_a_guarded_path_is_followed(tmp_path):
    link = tmp_path / "looks-harmless"
    link.symlink_to("/etc/docker")
    assert reasons(json.dumps({"HostConfig": {"Binds": [f"{link}:/x"]}}))


def test_services_and_volumes():
    spec = {"TaskTemplate": {"ContainerSpec": {"Image": "x", "Env": ["NVIDIA_VISIBLE_DEVICES=all"]}}}
    assert gpudev.service_reasons(gojson.decode(json.dumps(spec).encode(), gpudev.SERVICE), POLICY)
    spec = {"taskTemplate": {"resources": {"reservations": {"genericResources": [
        {"DiscreteResourceSpec": {"Kind": "NVIDIA-GPU", "Value": 1}}]}}}}
    assert gpudev.service_reasons(gojson.decode(json.dumps(spec).encode(), gpudev.SERVICE), POLICY)
    ok = {"TaskTemplate": {"ContainerSpec": {"Image": "x", "Env": ["GPUMGR_REQUEST_MEMORY=1GiB"]}}}
    assert gpudev.service_reasons(gojson.decode(json.dumps(ok).encode(), gpudev.SERVICE), POLICY) == []
    volume = {"Name": "v", "DriverOpts": {"type": "none", "o": "bind", "device": "/dev"}}
    assert gpudev.volume_reasons(gojson.decode(json.dumps(volume).encode(), gpudev.VOLUME), POLICY)


def test_hook_requests_over_the_node_policy():
    policy = gpudev.Policy(hook_max_priority=5, hook_max_memory=2 << 30, default=POLICY.default)
    body = {"Env": ["GPUMGR_REQUEST_MEMORY=4GiB", "GPUMGR_REQUEST_PRIORITY=5"]}
    found = gpudev.create_reasons(gojson.decode(json.dumps(body).encode(), gpudev.CREATE), policy)
    assert len(found) == 1 and "GPUMGR_REQUEST_MEMORY" in found[0]
