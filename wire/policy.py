"""The operator's policy: which parts of a :class:`~gpumgr.wire.runspec.RunSpec` a tenant may ask for.

By default a tenant gets none of what reaches beyond its container: no host paths, no host or other
containers' namespaces, no extra capabilities, no devices, no privileged mode, only the ``none``
network or the node's default. The manager checks each request against its tenant's policy (``policy:``
in its YAML, or ``tenants.NAME.policy``) before placing it; the agent checks again on its node,
against the policy the manager sent and its own, with every host path resolved (``realpath``) so a
symlink cannot lead outside an allowed prefix. The operator's own requests carry no policy.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gpumgr.wire.errors import PolicyDenied
from gpumgr.wire.runspec import Mount, RunSpec

#: Log drivers a tenant may pick when the policy names none: the ones ``docker gpu logs`` can read.
DEFAULT_LOG_DRIVERS = ("json-file", "local")
#: Networks every request may name: no network at all.
ALWAYS_NETWORKS = frozenset({"none"})


class Policy(BaseModel):
    """What a tenant may ask for beyond its container (YAML ``policy:``); everything off by default."""

    model_config = ConfigDict(extra="forbid")

    bind_paths: dict[str, Literal["ro", "rw"]] = Field(
        default_factory=dict, description="host path prefixes a bind mount may come from, each ro or rw")
    named_volumes: bool = Field(True, description="named volumes (the engine's, not host paths)")
    networks: list[str] = Field(default_factory=list, description="networks a request may join, besides none")
    host_network: bool = False
    host_ipc: bool = False
    host_pid: bool = False
    container_namespaces: bool = Field(False, description="join another container's network, IPC or PID "
                                       "namespace (container:NAME)")
    cap_add: list[str] = Field(default_factory=list, description="capabilities that may be added; ALL for any")
    privileged: bool = False
    devices: list[str] = Field(default_factory=list, description="host device paths that may be passed in")
    log_drivers: list[str] = Field(default_factory=lambda: list(DEFAULT_LOG_DRIVERS))

    @field_validator("bind_paths")
    @classmethod
    def _absolute_prefixes(cls, value: dict[str, str]) -> dict[str, str]:
        for prefix in value:
            if not prefix.startswith("/") or ".." in prefix.split("/"):
                raise ValueError(f"bind_paths: {prefix!r} is not an absolute path without '..'")
        return {posixpath.normpath(k) if k != "//" else "/": v for k, v in value.items()}

    @field_validator("cap_add")
    @classmethod
    def _capabilities(cls, value: list[str]) -> list[str]:
        return [c.upper().removeprefix("CAP_") for c in value]


def check(run: RunSpec, policy: Policy | None, resolve: Callable[[str], str] = posixpath.normpath) -> RunSpec:
    """``run`` if ``policy`` allows it (None allows everything); raises PolicyDenied naming the rule.

    ``resolve`` turns a host path into the one that would really be mounted (``os.path.realpath`` on
    the node); the result has every bind source and device replaced by what it resolved to, so the
    path checked is the path mounted.
    """
    mounts = [_resolved(m, resolve) for m in run.all_mounts()]
    devices = [_resolved_device(d, resolve) for d in run.devices]
    if policy is not None:
        for index, mount in enumerate(mounts):
            _check_mount(index, mount, policy)
        _check_namespaces(run, policy)
        _check_privileges(run, devices, policy)
    return run.model_copy(update={"volumes": [], "mounts": mounts, "devices": devices})


def on_node(path: str) -> str:
    """``path`` as this host resolves it, symlinks followed (the agent's ``resolve``)."""
    return os.path.realpath(path)


def _resolved(mount: Mount, resolve: Callable[[str], str]) -> Mount:
    if mount.type != "bind" or mount.source is None:
        return mount
    return mount.model_copy(update={"source": resolve(mount.source)})


def _resolved_device(device: str, resolve: Callable[[str], str]) -> str:
    host, sep, rest = device.partition(":")
    return resolve(host) + sep + rest if sep else f"{resolve(host)}:{host}"


def _check_mount(index: int, mount: Mount, policy: Policy) -> None:
    where = f"mounts[{index}] ({mount.source or mount.type} on {mount.target})"
    if mount.type == "volume" and not policy.named_volumes:
        raise PolicyDenied(f"{where}: named volumes are not allowed", rule="named_volumes")
    if mount.type != "bind":
        return
    source = mount.source or ""
    prefix = _longest_prefix(source, policy.bind_paths)
    if prefix is None:
        allowed = ", ".join(sorted(policy.bind_paths)) or "none"
        raise PolicyDenied(f"{where}: host path {source} is outside the allowed bind paths ({allowed})",
                           rule="bind_paths")
    if policy.bind_paths[prefix] == "ro" and not mount.read_only:
        raise PolicyDenied(f"{where}: {prefix} may only be mounted read-only; add :ro (or read_only: true)",
                           rule="bind_paths")


def _longest_prefix(path: str, prefixes: Mapping[str, str]) -> str | None:
    matching = [p for p in prefixes if path == p or path.startswith(p.rstrip("/") + "/")]
    return max(matching, key=len) if matching else None


def _check_namespaces(run: RunSpec, policy: Policy) -> None:
    asked = {"network": run.network, "ipc_mode": run.ipc_mode, "pid_mode": run.pid_mode}
    rules = {"network": "host_network", "ipc_mode": "host_ipc", "pid_mode": "host_pid"}
    for field, mode in asked.items():
        if mode == "host" and not getattr(policy, rules[field]):
            raise PolicyDenied(f"{field}: the host's namespace is not allowed", rule=rules[field])
        if mode is not None and mode.startswith("container:") and not policy.container_namespaces:
            raise PolicyDenied(f"{field}: joining another container's namespace is not allowed",
                               rule="container_namespaces")
    network = run.network
    if network is not None and network != "host" and not network.startswith("container:") \
            and network not in ALWAYS_NETWORKS and network not in policy.networks:
        allowed = ", ".join(sorted({*ALWAYS_NETWORKS, *policy.networks}))
        raise PolicyDenied(f"network: {network!r} is not an allowed network ({allowed})", rule="networks")


def _check_privileges(run: RunSpec, devices: list[str], policy: Policy) -> None:
    if run.privileged and not policy.privileged:
        raise PolicyDenied("privileged: privileged containers are not allowed", rule="privileged")
    for cap in run.cap_add:
        if cap not in policy.cap_add and "ALL" not in policy.cap_add:
            raise PolicyDenied(f"cap_add: capability {cap} is not allowed", rule="cap_add")
    for device in devices:
        host = device.split(":", 1)[0]
        if host not in policy.devices:
            raise PolicyDenied(f"devices: host device {host} is not allowed", rule="devices")
    if run.log_config is not None and run.log_config.type not in policy.log_drivers:
        raise PolicyDenied(f"log_config: log driver {run.log_config.type!r} is not allowed "
                           f"({', '.join(policy.log_drivers) or 'none'})", rule="log_drivers")

