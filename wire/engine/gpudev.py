"""Does a Docker API request ask for a GPU (or to loosen the guard)? The guard's judgement, with no I/O but paths.

Each ``*_reasons`` function takes a body decoded by :mod:`gpumgr.wire.engine.gojson` with the schema named
beside it and returns what in it asks for a GPU or would reach the guard itself, one sentence per
field, naming the field as the engine's API spells it: an empty list is a clean request. The same
checks judge what ``docker inspect`` shows of a container, so a test can hold the guard to what the
engine really made. Host paths are resolved on this host (symbolic links followed), as the engine
resolves them when it mounts a bind or adds a device; a device's path must be one that cannot change
before the engine's next start (:mod:`gpumgr.wire.engine.devpath`).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumgr.wire.engine import devpath, privilege
from gpumgr.wire.engine.gojson import ANY, BOOL, STR, Map, Slice, Struct
from gpumgr.wire.names import LABEL_PREFIX, Env

#: The character-device majors of NVIDIA GPUs (195) and of DRI render nodes (226); the dynamic majors
#: of ``nvidia-uvm`` and ``nvidia-caps`` are read from /proc/devices (:func:`gpu_majors`).
STATIC_MAJORS = frozenset({195, 226})
#: Environment a GPU runtime reads to give a container devices (the NVIDIA runtime; its Swarm resource mode).
GPU_ENV = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_MIG_CONFIG_DEVICES",
           "NVIDIA_MIG_MONITOR_DEVICES")
GPU_ENV_PREFIXES = ("DOCKER_RESOURCE_",)
#: Runtimes a create may name whatever the engine's default is: gpumgr's hook (it checks every GPU container
#: for a grant); a node adds its sandboxes (runsc, kata) with ``guard_runtimes``. runc named outright skips the
#: hook, so it passes only as the engine's default (:func:`runtime_reasons`).
FENCED_RUNTIMES = frozenset({"gpumgr"})
STOCK_RUNTIMES = frozenset({"runc", "io.containerd.runc.v2", "io.containerd.runtime.v1.linux"})
#: Paths a bind must neither be, nor hold, nor sit inside: the GPUs' nodes, the engine's and gpumgr's settings
#: and sockets (a container that can write them can replace the guard).
GUARDED = ("/dev/nvidiactl", "/dev/dri", "/dev/char", "/etc/docker", "/run/docker/plugins", "/run/gpumgr",
           "/etc/gpumgr", "/etc/systemd/system", "/var/lib/docker")
GPU_NODE_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/char/195:", "/dev/char/226:")
#: Labels a plain create may not carry: gpumgr's own, and Swarm's (the agent trusts those as a Swarm task's).
RESERVED_LABELS = (LABEL_PREFIX, "com.docker.swarm.")
RULE = re.compile(r"^([abc]) (\*|[0-9]+):(\*|[0-9]+)(?: ([rwm]{1,3}))?$")
HINT = "Ask gpumgr for a GPU instead: 'docker gpu run --gpu-memory SIZE ...' or POST /v1/containers"

# -- the engine's request bodies, as far as the guard reads them (field names as the Go structs spell them) --
MOUNT = Struct({"Type": STR, "Source": STR, "Target": STR,
                "VolumeOptions": Struct({"DriverConfig": Struct({"Name": STR, "Options": Map(STR)})})})
RESOURCES = {
    "Devices": Slice(Struct({"PathOnHost": STR, "PathInContainer": STR, "CgroupPermissions": STR})),
    "DeviceCgroupRules": Slice(STR),
    "DeviceRequests": Slice(Struct({"Driver": STR, "Count": ANY, "DeviceIDs": Slice(STR),
                                    "Capabilities": Slice(Slice(STR)), "Options": Map(STR)})),
}
HOST_FIELDS = {"Binds": Slice(STR), "Privileged": BOOL, "Runtime": STR, "Mounts": Slice(MOUNT),
               "VolumesFrom": Slice(STR), "CapAdd": Slice(STR, lone=True), "SecurityOpt": Slice(STR), **RESOURCES}
HOST_CONFIG = Struct(HOST_FIELDS)
CONFIG_FIELDS = {"Image": STR, "Env": Slice(STR), "Labels": Map(STR)}
#: ``POST /containers/create``: Config and the legacy HostConfig fields at the top, HostConfig inside.
CREATE = Struct({**CONFIG_FIELDS, "HostConfig": HOST_CONFIG, **HOST_FIELDS})
#: ``POST /containers/{id}/update``
UPDATE = Struct(dict(RESOURCES))
#: ``POST /containers/{id}/exec``
EXEC = Struct({"Privileged": BOOL})
#: ``POST /services/create`` and ``/services/{id}/update``
SERVICE = Struct({"TaskTemplate": Struct({
    "ContainerSpec": Struct({**CONFIG_FIELDS, "Mounts": Slice(MOUNT), "CapabilityAdd": Slice(STR),
                             "Privileges": Struct({"Seccomp": Struct({"Mode": STR, "Profile": STR}),
                                                   "AppArmor": Struct({"Mode": STR})})}),
    "PluginSpec": Struct({"Name": STR, "Remote": STR}), "Runtime": STR,
    "Resources": Struct({"Reservations": Struct({"GenericResources": Slice(Struct({
        "NamedResourceSpec": Struct({"Kind": STR, "Value": STR}),
        "DiscreteResourceSpec": Struct({"Kind": STR, "Value": ANY})}))})})})})
#: ``POST /volumes/create``
VOLUME = Struct({"Name": STR, "Driver": STR, "DriverOpts": Map(STR)})


@dataclass(frozen=True)
class DefaultRuntime:
    """What the guard knows of the engine's default runtime: every name that may be in force, and its trouble.

    ``problem`` is why a container holding no grant may not use it (it hands out GPUs by environment, or
    the guard cannot tell what it is); None when it is known to be plain or fenced.
    """

    names: frozenset[str] = frozenset()
    problem: str | None = "the guard does not know the engine's default runtime"


@dataclass(frozen=True)
class Policy:
    """What this node allows: the GPU majors, runtimes, and the most a hook request may ask for."""

    majors: frozenset[int] = STATIC_MAJORS
    #: runtimes a create may name besides the engine's default
    runtimes: frozenset[str] = FENCED_RUNTIMES
    default: DefaultRuntime = DefaultRuntime()
    #: the highest ``GPUMGR_REQUEST_PRIORITY`` a container asking through the runtime hook may carry
    hook_max_priority: int = 0
    #: the most ``GPUMGR_REQUEST_MEMORY`` it may ask (bytes); None: no limit beyond the manager's
    hook_max_memory: int | None = None
    #: capabilities a create or service may add: the node's ``policy.cap_add`` (ALL, SYS_ADMIN only by name)
    cap_add: frozenset[str] = frozenset()
    guarded: tuple[str, ...] = GUARDED


def gpu_majors(proc_devices: str = "/proc/devices") -> frozenset[int]:
    """The static GPU majors and those of every ``nvidia*`` character driver this host has loaded."""
    majors = set(STATIC_MAJORS)
    try:
        lines = Path(proc_devices).read_text().splitlines()
    except OSError:
        return frozenset(majors)
    for line in lines:
        number, _, name = line.strip().partition(" ")
        if name.startswith("nvidia") and number.isdigit():
            majors.add(int(number))
    return frozenset(majors)


def host_config(create: dict[str, Any]) -> dict[str, Any]:
    """The HostConfig the engine uses: the inner one if given (even empty), else the legacy top-level fields."""
    inner = create.get("HostConfig")
    if isinstance(inner, dict):
        return inner
    return {name: create[name] for name in HOST_FIELDS if name in create}


def create_reasons(create: dict[str, Any], policy: Policy, *, granted: bool = False) -> list[str]:
    """Why a container create asks for a GPU or reaches the guard (``granted``: it holds a ticket)."""
    host = host_config(create)
    reasons = [] if granted else [*env_reasons(create.get("Env"), "Env", policy),
                                  *label_reasons(create.get("Labels"), "Labels"),
                                  *requests_reasons(host.get("DeviceRequests"))]
    if host.get("Privileged") is True:
        reasons.append("HostConfig.Privileged gives the container every device of the host, GPUs included")
    reasons += runtime_reasons(str(host.get("Runtime") or ""), policy, granted=granted)
    reasons += devices_reasons(host.get("Devices"), policy)
    reasons += rules_reasons(host.get("DeviceCgroupRules"), policy)
    reasons += privilege.cap_reasons(host.get("CapAdd"), "HostConfig.CapAdd", policy.cap_add)
    reasons += privilege.security_opt_reasons(host.get("SecurityOpt"), host.get("CapAdd"), "HostConfig.SecurityOpt")
    reasons += binds_reasons(host.get("Binds"), policy)
    reasons += mounts_reasons(host.get("Mounts"), "HostConfig.Mounts", policy)
    return reasons


def self_reasons(create: dict[str, Any], policy: Policy) -> list[str]:
    """What an excepted image (``guard_allow``) is still refused: binds reaching the engine's or gpumgr's settings."""
    host = host_config(create)
    own = Policy(majors=frozenset(), guarded=tuple(path for path in policy.guarded if not path.startswith("/dev")))
    reasons = [*binds_reasons(host.get("Binds"), own), *mounts_reasons(host.get("Mounts"), "HostConfig.Mounts", own)]
    return [reason for reason in reasons if "GPU device" not in reason]


def runtime_reasons(runtime: str, policy: Policy, *, granted: bool = False) -> list[str]:
    """Why a create may not use ``runtime`` ('' is the engine's default): one that skips gpumgr's hook.

    Named outright, a runtime passes if it is fenced or listed (``policy.runtimes``) or is the engine's
    default in every state the guard may find it in; the default itself (named or not) passes for a
    container holding a grant, or when it is known to give no GPU by environment.
    """
    if runtime in policy.runtimes:
        return []
    default = policy.default
    if runtime and not (default.names and all(_same_runtime(runtime, name) for name in default.names)):
        return [f"HostConfig.Runtime {runtime!r} is neither the engine's default runtime ({_names(default)}) nor "
                f"one this node lists ({', '.join(sorted(policy.runtimes))}, guard_runtimes): it would skip "
                "gpumgr's runtime hook"]
    if granted or default.problem is None:
        return []
    return [f"HostConfig.Runtime {runtime or '(the default)'!r}: {default.problem}, so only a container holding a "
            "gpumgr grant may use it"]


def _same_runtime(a: str, b: str) -> bool:
    return a == b or (a in STOCK_RUNTIMES and b in STOCK_RUNTIMES)


def _names(default: DefaultRuntime) -> str:
    return ", ".join(sorted(default.names)) or "not known"


def update_reasons(update: dict[str, Any], policy: Policy) -> list[str]:
    """Why a container update asks for a GPU (its Resources carry devices)."""
    return [*requests_reasons(update.get("DeviceRequests")), *devices_reasons(update.get("Devices"), policy),
            *rules_reasons(update.get("DeviceCgroupRules"), policy)]


def exec_reasons(body: dict[str, Any]) -> list[str]:
    """Why an exec asks too much: a privileged exec."""
    return ["Privileged exec gives the command every capability"] if body.get("Privileged") is True else []


def service_reasons(spec: dict[str, Any], policy: Policy) -> list[str]:
    """Why a service create or update asks for a GPU without gpumgr."""
    template = spec.get("TaskTemplate") or {}
    container = template.get("ContainerSpec") or {}
    reasons = [*env_reasons(container.get("Env"), "TaskTemplate.ContainerSpec.Env", policy),
               *label_reasons(container.get("Labels"), "TaskTemplate.ContainerSpec.Labels"),
               *mounts_reasons(container.get("Mounts"), "TaskTemplate.ContainerSpec.Mounts", policy),
               *privilege.service_privilege_reasons(container, "TaskTemplate.ContainerSpec", policy.cap_add)]
    if template.get("PluginSpec") is not None or (template.get("Runtime") or "").lower() == "plugin":
        reasons.append("TaskTemplate.PluginSpec installs an engine plugin on every node")
    generic = ((template.get("Resources") or {}).get("Reservations") or {}).get("GenericResources") or []
    for resource in generic:
        for spec_name in ("NamedResourceSpec", "DiscreteResourceSpec"):
            kind = str(((resource or {}).get(spec_name) or {}).get("Kind") or "")
            if "gpu" in kind.lower():
                reasons.append(f"TaskTemplate.Resources.Reservations.GenericResources asks for {kind!r}")
    return reasons


def volume_reasons(body: dict[str, Any], policy: Policy) -> list[str]:
    """Why a volume create reaches a guarded host path (the local driver binds ``device``)."""
    device = (body.get("DriverOpts") or {}).get("device")
    problem = path_problem(device, policy) if isinstance(device, str) and device.startswith("/") else None
    return [f"DriverOpts.device {device!r} {problem}"] if problem else []


def env_reasons(env: Any, where: str, policy: Policy) -> list[str]:
    """Variables a GPU runtime reads, and GPU requests over this node's policy."""
    reasons = []
    values = {}
    for entry in env or []:
        name, _, value = str(entry).partition("=")
        values[name] = value
        if name in GPU_ENV or name.startswith(GPU_ENV_PREFIXES):
            reasons.append(f"{where} sets {name}, which a GPU runtime reads to hand out GPUs")
    priority = values.get(Env.REQUEST_PRIORITY)
    if priority is not None and not _at_most(priority, policy.hook_max_priority):
        reasons.append(f"{where} sets {Env.REQUEST_PRIORITY}={priority}: this node allows at most "
                       f"{policy.hook_max_priority}")
    memory = values.get(Env.REQUEST_MEMORY)
    if memory is not None and policy.hook_max_memory is not None and not _memory_ok(memory, policy.hook_max_memory):
        reasons.append(f"{where} sets {Env.REQUEST_MEMORY}={memory}: this node allows at most "
                       f"{policy.hook_max_memory} bytes")
    return reasons


def label_reasons(labels: Any, where: str) -> list[str]:
    """Labels only gpumgr and Swarm write."""
    return [f"{where} sets {name!r}, a label only gpumgr or Swarm may write" for name in (labels or {})
            if str(name).startswith(RESERVED_LABELS)]


def requests_reasons(requests: Any) -> list[str]:
    """Any device request: the NVIDIA driver answers ``gpu``, ``nvidia``, ``compute``, CDI and more."""
    return [f"HostConfig.DeviceRequests asks the {(request or {}).get('Driver') or 'default'!s} driver for devices"
            for request in requests or []]


def devices_reasons(devices: Any, policy: Policy) -> list[str]:
    """Devices that are (or hold) GPU nodes, or name a CDI GPU."""
    reasons = []
    for device in devices or []:
        path = str((device or {}).get("PathOnHost") or "")
        problem = _cdi_problem(path) or devpath.device_problem(path, policy.majors, GPU_NODE_PREFIXES)
        if problem:
            reasons.append(f"HostConfig.Devices {path!r} {problem}")
    return reasons


def rules_reasons(rules: Any, policy: Policy) -> list[str]:
    """Device cgroup rules that open a GPU major (or every device)."""
    reasons = []
    for rule in rules or []:
        match = RULE.match(str(rule))
        if match is None:
            reasons.append(f"HostConfig.DeviceCgroupRules {rule!r} cannot be read")
        elif match[1] == "a" or match[2] == "*" or int(match[2]) in policy.majors:
            reasons.append(f"HostConfig.DeviceCgroupRules {rule!r} opens GPU devices")
    return reasons


def binds_reasons(binds: Any, policy: Policy) -> list[str]:
    """Binds whose host side is, holds or sits inside a guarded path."""
    reasons = []
    for bind in binds or []:
        source = str(bind).split(":", 1)[0]
        problem = path_problem(source, policy) if source.startswith("/") else None
        if problem:
            reasons.append(f"HostConfig.Binds {bind!r} {problem}")
    return reasons


def mounts_reasons(mounts: Any, where: str, policy: Policy) -> list[str]:
    """Mounts binding a guarded path, directly or through a volume's ``device`` option."""
    reasons = []
    for mount in mounts or []:
        mount = mount or {}
        source = str(mount.get("Source") or "")
        options = (((mount.get("VolumeOptions") or {}).get("DriverConfig") or {}).get("Options") or {})
        device = str(options.get("device") or "")
        for path in (source, device):
            problem = path_problem(path, policy) if path.startswith("/") else None
            if problem:
                reasons.append(f"{where} {path!r} {problem}")
    return reasons


def path_problem(path: str, policy: Policy) -> str | None:
    """Why the host path ``path`` may not be bound into a container, or None; links are followed.

    A bound directory is not searched for GPU nodes: a node in it stays closed by the device rules.
    """
    if path.startswith(GPU_NODE_PREFIXES):
        return "is a GPU device"
    real = os.path.realpath(path)
    if real.startswith(GPU_NODE_PREFIXES):
        return f"is a GPU device ({real})"
    for guarded in policy.guarded:
        if real == guarded or guarded.startswith(real.rstrip("/") + "/"):
            return f"holds {guarded}" if real != guarded else "is guarded"
        if real.startswith(guarded + "/"):
            return f"is inside {guarded}"
    return devpath.dev_folder_problem(real) or _gpu_node(real, policy)


def _gpu_node(path: str, policy: Policy) -> str | None:
    try:
        info = os.stat(path)
    except OSError:
        return None  # nothing there: the engine makes an empty folder for a bind
    if stat.S_ISCHR(info.st_mode) and os.major(info.st_rdev) in policy.majors:
        return f"is a GPU device (major {os.major(info.st_rdev)})"
    return None


def _cdi_problem(path: str) -> str | None:
    # the engine turns a --device naming a CDI device (vendor.com/class=name) into a CDI request
    return "names a CDI GPU device" if "=" in path and "/" in path.split("=", 1)[0] else None


def _at_most(text: str, limit: int) -> bool:
    try:
        return int(text.strip() or "0") <= limit
    except ValueError:
        return False


def _memory_ok(text: str, limit: int) -> bool:
    from gpumgr.wire.units import parse_bytes

    try:
        return parse_bytes(text) <= limit
    except ValueError:
        return True  # not a size: the agent refuses it with its own reason
