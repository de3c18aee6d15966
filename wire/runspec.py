"""How a container runs beyond its GPUs: mounts, ports, network, namespaces, limits, as docker-py names them.

One typed model, :class:`RunSpec`, read by the REST API (its fields sit at the top level of
``POST /v1/containers``), carried to the agent inside the create message and checked again there,
then mapped onto the Docker SDK's create call by the agent. Every field is validated on its own, so a
bad value is a 400 naming the field; what an operator may refuse (host paths, host namespaces,
capabilities, devices) is judged separately by :mod:`gpumgr.wire.policy`.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    model_validator,
)

from gpumgr.wire.units import MAX_BYTES, parse_docker_bytes

#: Docker's own rule for volume and network names.
NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,254}$")
USER = re.compile(r"^[a-zA-Z0-9_.][a-zA-Z0-9_.-]{0,255}(:[a-zA-Z0-9_.][a-zA-Z0-9_.-]{0,255})?$")
PORT_KEY = re.compile(r"^([0-9]{1,5})(/(tcp|udp|sctp))?$")
SIGNAL = re.compile(r"^(SIG)?[A-Z][A-Z0-9+-]{0,15}$|^[0-9]{1,2}$")
CAPABILITY = re.compile(r"^(CAP_)?[A-Z_]{1,32}$")
LOG_DRIVER = re.compile(r"^[a-z0-9][a-z0-9_.:/-]{0,127}$")
#: ``ulimit`` names Docker knows (``docker run --ulimit``).
ULIMITS = frozenset({"core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc",
                     "rss", "rtprio", "rttime", "sigpending", "stack"})
#: Fields of docker-py's ``containers.run`` that gpumgr refuses by name, and why.
REFUSED = {
    "restart_policy": "gpumgr decides what happens after an exit (the grant ends with the container)",
    "device_requests": "gpumgr pins the granted GPUs itself",
    "runtime": "the node's runtime is chosen by its operator",
    "security_opt": "security options are the node's, not the request's",
    "userns_mode": "user namespaces are the node's setting",
    "uts_mode": "host namespaces other than network, IPC and PID are not offered",
    "cgroup_parent": "the node's cgroups are its operator's",
    "volumes_from": "name each mount instead",
    "sysctls": "kernel parameters are the node's",
}
MAX_MOUNTS = 256
MAX_LIST = 256
MAX_PATH = 4096
#: Docker refuses a memory limit under 6 MiB.
MIN_MEM_LIMIT = 6 * 1024 * 1024
MAX_NANO_CPUS = 4096 * 10**9


def _absolute(value: str) -> str:
    if not value.startswith("/") or "\0" in value or len(value) > MAX_PATH:
        raise ValueError("must be an absolute path (starting with '/', no NUL, at most 4096 characters)")
    if ".." in value.split("/"):
        raise ValueError("must not hold a '..' component")
    return posixpath.normpath(value) if value != "//" else "/"


def _docker_size(value: Any) -> int:
    return parse_docker_bytes(value)


def _words(value: Any) -> Any:
    return shlex.split(value) if isinstance(value, str) else value


AbsPath = Annotated[StrictStr, AfterValidator(_absolute),
                    WithJsonSchema({"type": "string", "pattern": "^/", "maxLength": MAX_PATH})]
#: A size as ``docker run`` reads it (``1g`` is 2³⁰ bytes); 0 leaves the engine's default.
DockerSize = Annotated[int, BeforeValidator(_docker_size), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 0, "maximum": MAX_BYTES}, {"type": "string", "maxLength": 128}]})]
Word = Annotated[StrictStr, Field(max_length=MAX_PATH)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Mount(_Strict):
    """One mount, as ``docker run --mount`` and docker-py's ``Mount`` take it.

    ``bind``: ``source`` is an absolute host path, which must exist; ``volume``: a named volume
    (created on first use); ``tmpfs``: no source.
    """

    type: Literal["bind", "volume", "tmpfs"] = "volume"
    source: StrictStr | None = Field(None, max_length=MAX_PATH)
    target: AbsPath
    read_only: StrictBool = False

    @model_validator(mode="after")
    def _source_fits_type(self) -> Mount:
        if self.type == "bind":
            self.source = _absolute(self.source or "")
        elif self.type == "volume":
            if not self.source or not NAME.match(self.source):
                raise ValueError("a volume mount needs a source naming the volume (letters, digits, '_', '.', '-')")
        elif self.source:
            raise ValueError("a tmpfs mount has no source")
        return self


def parse_volume(text: str) -> Mount:
    """``SOURCE:TARGET[:ro|rw]`` (``docker run -v``) as a Mount; SOURCE absolute is a bind, else a named volume."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise ValueError(f"{text[:200]!r} is not SOURCE:TARGET[:ro|rw]")
    kind: Literal["bind", "volume"] = "bind" if parts[0].startswith("/") else "volume"
    return Mount(type=kind, source=parts[0], target=parts[1], read_only=len(parts) == 3 and parts[2] == "ro")


def _volume(value: Any) -> Any:
    if isinstance(value, str):
        parse_volume(value)
    return value


def _port_binding(value: Any) -> Any:
    """A host side of a published port: a port, None (any free port) or ``[host_ip, port]``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise ValueError("a host port is a number, null (any free port) or [host_ip, port]")
    if isinstance(value, int):
        if not 1 <= value <= 65535:
            raise ValueError("a host port is between 1 and 65535")
        return value
    if len(value) != 2 or not isinstance(value[0], str) or not re.fullmatch(r"[0-9a-fA-F.:]{2,45}", value[0]):
        raise ValueError("a host binding is [host_ip, port], e.g. [\"127.0.0.1\", 8080]")
    _port_binding(value[1])
    return [value[0], value[1]]


def _port_key(value: str) -> str:
    match = PORT_KEY.match(value)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise ValueError("a container port is PORT or PORT/tcp|udp|sctp, PORT between 1 and 65535")
    return value if "/" in value else value + "/tcp"


def _namespace(value: str) -> str:
    if value in ("", "private", "shareable", "none", "host", "bridge", "default"):
        return value
    if value.startswith("container:") and NAME.match(value.removeprefix("container:")):
        return value
    if NAME.match(value):
        return value
    raise ValueError("must be a mode such as host, none, private, or container:NAME, or a network's name")


def _capability(value: str) -> str:
    upper = value.upper()
    if not CAPABILITY.match(upper):
        raise ValueError("a capability is a name such as SYS_PTRACE (with or without CAP_)")
    return upper.removeprefix("CAP_")


def _device(value: str) -> str:
    host = value.split(":", 1)[0]
    _absolute(host)
    if len(value.split(":")) > 3:
        raise ValueError("a device is HOST_PATH[:CONTAINER_PATH[:PERMISSIONS]]")
    return value


PortKey = Annotated[StrictStr, AfterValidator(_port_key)]
PortValue = Annotated[Any, BeforeValidator(_port_binding), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 1, "maximum": 65535}, {"type": "null"},
    {"type": "array", "minItems": 2, "maxItems": 2}]})]
Namespace = Annotated[StrictStr, Field(max_length=300), AfterValidator(_namespace)]
Capability = Annotated[StrictStr, Field(max_length=40), AfterValidator(_capability)]
Device = Annotated[StrictStr, Field(max_length=MAX_PATH), AfterValidator(_device),
                   WithJsonSchema({"type": "string", "pattern": "^/", "maxLength": MAX_PATH})]
Volume = Annotated[StrictStr, Field(max_length=2 * MAX_PATH + 3), AfterValidator(_volume)]


class Ulimit(_Strict):
    """A resource limit (``--ulimit memlock=-1``); -1 is unlimited."""

    name: Literal[tuple(sorted(ULIMITS))]  # type: ignore[valid-type]
    soft: StrictInt = Field(ge=-1, le=MAX_BYTES)
    hard: StrictInt | None = Field(None, ge=-1, le=MAX_BYTES)


class LogConfig(_Strict):
    """Where the engine sends the container's output (``--log-driver`` and ``--log-opt``)."""

    type: StrictStr = Field(pattern=LOG_DRIVER.pattern)
    config: dict[Annotated[StrictStr, Field(max_length=128)], Annotated[StrictStr, Field(max_length=MAX_PATH)]] = \
        Field(default_factory=dict, max_length=64)


class RunSpec(_Strict):
    """What a container needs besides its image, command and GPUs; every field optional, named as docker-py names it."""

    volumes: list[Volume] = Field(default_factory=list, max_length=MAX_MOUNTS,
                                  description="SOURCE:TARGET[:ro|rw]; SOURCE an absolute host path or a volume's name")
    mounts: list[Mount] = Field(default_factory=list, max_length=MAX_MOUNTS)
    ports: dict[PortKey, PortValue] = Field(default_factory=dict, max_length=MAX_LIST,
                                            description='container port → host port, e.g. {"80/tcp": 8080}')
    network: Namespace | None = Field(None, description="a network's name, none, host or container:NAME; "
                                      "wins over the node's default")
    shm_size: DockerSize | None = Field(None, description="size of /dev/shm as docker run --shm-size reads it, e.g. "
                                        "'1g' (2³⁰ bytes); 0: the engine's default (64 MiB)")
    ipc_mode: Namespace | None = None
    pid_mode: Namespace | None = None
    working_dir: AbsPath | None = None
    user: StrictStr | None = Field(None, pattern=USER.pattern, description="USER[:GROUP], names or ids")
    entrypoint: Annotated[list[Word] | None, BeforeValidator(_words)] = Field(None, max_length=4096)
    nano_cpus: StrictInt | None = Field(None, ge=1, le=MAX_NANO_CPUS, description="CPU quota in 1e-9 CPUs")
    mem_limit: DockerSize | None = Field(None, description="host memory limit as docker run -m reads it, e.g. '16g' "
                                         "(16 × 2³⁰ bytes); 0: no limit")
    ulimits: list[Ulimit] = Field(default_factory=list, max_length=len(ULIMITS))
    cap_add: list[Capability] = Field(default_factory=list, max_length=64)
    devices: list[Device] = Field(default_factory=list, max_length=MAX_LIST,
                                  description="HOST_PATH[:CONTAINER_PATH[:PERMISSIONS]]")
    privileged: StrictBool = False
    auto_remove: StrictBool = Field(False, description="the engine removes the container when it ends")
    stop_signal: StrictStr | None = Field(None, pattern=SIGNAL.pattern)
    log_config: LogConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_by_name(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in REFUSED.items():
                if name in data:
                    raise ValueError(f"{name} is not offered: {why}")
        return data

    @model_validator(mode="after")
    def _check_together(self) -> RunSpec:
        if self.mem_limit and self.mem_limit < MIN_MEM_LIMIT:
            raise ValueError("mem_limit: Docker needs at least 6MiB")
        targets = [m.target for m in self.all_mounts()]
        if len(targets) != len(set(targets)):
            raise ValueError("volumes and mounts: two mounts share a target")
        return self

    def all_mounts(self) -> list[Mount]:
        """``volumes`` and ``mounts`` as one list of mounts."""
        return [parse_volume(v) for v in self.volumes] + list(self.mounts)

    def given(self) -> dict[str, Any]:
        """The fields a request set, as JSON (what the manager keeps and sends on)."""
        return self.model_dump(mode="json", exclude_defaults=True)


RUN_FIELDS = frozenset(RunSpec.model_fields)
