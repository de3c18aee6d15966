"""``docker gpu``: a Docker CLI plugin that puts GPU memory grants on containers and Swarm services.

Docker runs ``docker-gpu gpu ARGS`` for ``docker gpu ARGS`` (and ``docker-gpu
docker-cli-plugin-metadata`` to learn about it). The manager is found from ``--manager``,
``GPUMGR_MANAGER`` or ``~/.config/gpumgr/plugin.yaml``; its token from ``GPUMGR_TOKEN`` or that file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gpumgr import client_keyed
from gpumgr.client import Client, ManagerUnreachable, Stream
from gpumgr.plugin.placement import NOTHING, Wanted, allowed_sizes, swarm_constraints, take_constraints
from gpumgr.wire import defaults
from gpumgr.wire.constraints import NO_CONSTRAINTS, Constraints
from gpumgr.wire.errors import GpumgrError, OutcomeUnknown
from gpumgr.wire.names import LIVE, Env, Label
from gpumgr.wire.units import format_bytes, parse_bytes

METADATA = {"SchemaVersion": "0.1.0", "Vendor": "gpumgr", "Version": "0.2.0",
            "ShortDescription": "GPU memory grants for containers and Swarm services"}
DEFAULT_MANAGER = "http://127.0.0.1:9400"
CONFIG_PATH = "~/.config/gpumgr/plugin.yaml"
TIMEOUT = defaults.CLI_TIMEOUT
#: ``docker gpu run`` when nobody knows whether the container was created: ``docker run``'s own failure code.
EXIT_UNKNOWN = 125
#: Swarm expands these templates per task; the runtime hook reads them when the task's container is created.
TASK_TEMPLATES = {Env.TASK: "{{.Task.ID}}", Env.TASK_NAME: "{{.Task.Name}}",
                  Env.SERVICE: "{{.Service.Name}}", Env.SLOT: "{{.Task.Slot}}"}


class PluginError(Exception):
    """Something the user must fix; printed as one line, exit status ``status`` (1; ``docker gpu run``: 125)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``docker-gpu``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["docker-cli-plugin-metadata"]:
        print(json.dumps(METADATA))
        return 0
    if argv[:1] == ["gpu"]:
        argv = argv[1:]
    try:
        return run(argv)
    except PluginError as exc:
        print(f"docker gpu: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:  # Ctrl-C before anything was started: quietly, with the shell's status for it
        return 128 + 2


def run(argv: list[str]) -> int:
    """Dispatch ``docker gpu [--manager URL] COMMAND ...``."""
    manager_url = None
    while argv[:1] and argv[0].startswith("--manager"):
        flag = argv.pop(0)
        manager_url = flag.split("=", 1)[1] if "=" in flag else (argv.pop(0) if argv else None)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] == "guard":  # issue 22: what the node's guard refuses, answered without the manager
        print(GUARD_HELP)
        return 0
    client = Manager(manager_url)
    command, rest = argv[0], argv[1:]
    if command in ("stats", "nodes"):
        from gpumgr.plugin import stats  # rich is loaded only for these: the other commands start fast

        return stats.stats(client, rest, PluginError) if command == "stats" else stats.nodes(client, rest)
    if command in CONTAINER_COMMANDS:
        from gpumgr.plugin import run_cli

        try:
            return int(getattr(run_cli, CONTAINER_COMMANDS[command])(client, rest, PluginError))
        except PluginError as exc:
            if command == "run" and exc.status == 1:
                exc.status = run_cli.EXIT_FAILED  # docker run's own failures exit 125
            raise
    if command == "ps":
        return show_containers(client)
    if command == "service":
        return service(client, rest)
    if command == "stack":
        from gpumgr.plugin import stack  # YAML is read only here

        return stack.stack(client, rest)
    raise PluginError(f"unknown command {command!r}; try 'docker gpu --help'")


#: Commands on one container, in ``run_cli``: command → function.
CONTAINER_COMMANDS = {"run": "run_container", "logs": "logs", "wait": "wait", "kill": "kill", "rm": "remove"}
USAGE = """Usage: docker gpu [--manager URL] COMMAND

Commands:
  service create --gpu-memory SIZE [--gpus N] [--on-overrun kill|stop|report] [--constraint C ...]
                 [--priority N] [--preemptible] [--queue]
                 [docker service create options] IMAGE [CMD]
  service ps SERVICE      each replica: node, GPU, grant, usage, or why it waits
  service rm SERVICE...   (any other 'service' command is passed to 'docker service' unchanged)
  stack deploy -c FILE [-c FILE...] [docker stack deploy options] STACK
                          each service's x-gpumgr block (gpu_memory, gpus, priority, preemptible, queue,
                          constraints, on_overrun; a top-level x-gpumgr gives defaults) becomes every
                          replica's grant, as 'service create' gives it; the rest goes to 'docker stack deploy'
  stack ps STACK          each replica: node, GPU, grant, usage, or why it waits
  stack rm|ls ...         passed to 'docker stack' unchanged
  run --gpu-memory SIZE [--gpus N] [--node NODE] [--constraint C ...] [--placement P] [--on-overrun A]
      [--priority N] [--preemptible] [--queue [--queue-timeout S]]
      [docker run options: -d --rm --name -e --env-file -l -v --mount --tmpfs -p --network --shm-size
       --ipc --pid -w -u --entrypoint --cpus -m --ulimit --cap-add --device --privileged --stop-signal
       --log-driver --log-opt] IMAGE [CMD]
                          like 'docker run': attached, it streams the output and exits with the
                          container's exit code (125 when docker gpu itself fails)
  logs [-f] [--tail N] CONTAINER      its output, from whichever node runs it
  wait CONTAINER...       block until each ends; print its exit code
  kill [-s SIGNAL] CONTAINER...
  rm [-f] CONTAINER...    remove (-f: even while running); its grant is freed
                          CONTAINER: an id, a name, or a prefix of an id that only it has
  ps                      containers known to the manager
  stats [-a] [--no-stream] [--format table|json] [CONTAINER...]
                          GPU memory of live containers (-a: all), refreshed every second until Ctrl-C
                          like 'docker stats'; --format json prints one JSON array per line each second
  nodes                   the machine x GPU map, a memory bar per GPU
  guard                   what a node's guard refuses, and how to get a GPU or an exception"""

GUARD_HELP = """On a node with the gpumgr guard, the engine gives GPUs only to containers holding a gpumgr grant.

Refused without a grant (403, "authorization denied by plugin gpumgr-guard: gpumgr guard: <field> ..."):
  --gpus, --device-request, CDI devices (nvidia.com/gpu=...), --runtime nvidia (any runtime but runc/gpumgr),
  -e NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES / DOCKER_RESOURCE_*, --device /dev/nvidia*, /dev/dri,
  /dev/char/195:*, --device-cgroup-rule for major 195 or every device, --privileged, binds of /, /dev or
  the engine's and gpumgr's settings, gpumgr.* and com.docker.swarm.* labels, GPUMGR_REQUEST_PRIORITY above
  the node's limit, engine plugin changes, and docker start/restart of a container whose gpumgr grant ended.
Get a GPU instead:
  docker gpu run --gpu-memory 4GiB IMAGE CMD          (or POST /v1/containers, or a Swarm service through
  docker gpu service create --gpu-memory ...)         'docker gpu service create')
  docker run -e GPUMGR_REQUEST_MEMORY=4GiB IMAGE CMD  (a grant through the runtime hook, at priority 0)
Exceptions: the operator lists image IDs under guard_allow in the agent's YAML; run them by that ID
  (docker run --gpus all sha256:...). Each use is logged."""


class Manager:
    """The manager's REST API through the Python client (:mod:`gpumgr.client`), its errors as PluginError."""

    def __init__(self, url: str | None) -> None:
        settings = _settings()
        urls = url or os.environ.get(Env.MANAGER) or settings.get("manager") or DEFAULT_MANAGER
        token = os.environ.get(Env.TOKEN) or settings.get("token")
        try:
            self.client = Client(str(urls), str(token) if token else None, TIMEOUT)
        except GpumgrError as exc:
            raise PluginError(f"{exc.message}; set --manager or GPUMGR_MANAGER") from None
        self.url = self.client.api.url

    def call(self, method: str, path: str, *, params: dict[str, str] | None = None, json_body: Any = None) -> Any:
        """One REST call; its JSON answer."""
        try:
            return self.client.api.call(method, path, params=params, body=json_body)
        except GpumgrError as exc:
            raise _plugin_error(exc) from None

    def create(self, body: dict[str, Any]) -> Any:
        """``POST /v1/containers`` run at most once (an ``Idempotency-Key``, resent while the outcome is unknown).

        When it stays unknown, the PluginError (exit 125) tells the user to look before running it again.
        """
        try:
            return client_keyed.create(self.client.api, body)
        except OutcomeUnknown as exc:
            which = f"a container named {body['name']!r}" if body.get("name") else "a new container"
            raise PluginError(f"{exc.message}. The manager may have started {which}: check with 'docker gpu ps' "
                              "(or 'docker gpu logs NAME') before running it again (outcome_unknown)",
                              EXIT_UNKNOWN) from None
        except GpumgrError as exc:
            raise _plugin_error(exc) from None

    def stream(self, path: str, params: dict[str, str], accept: str) -> Stream:
        """A streamed GET (no read timeout: a quiet container may say nothing for hours), for ``with``."""
        try:
            return self.client.api.stream(path, params, accept)
        except GpumgrError as exc:
            raise _plugin_error(exc) from None


def _plugin_error(exc: GpumgrError) -> PluginError:
    """The client's error as one line: the manager's message and code, or why no manager could be reached."""
    if isinstance(exc, ManagerUnreachable):
        return PluginError(f"{exc.message}; set --manager or GPUMGR_MANAGER")
    return PluginError(f"{exc.message} ({exc.code})")


# --- service ---------------------------------------------------------------------------------
def service(client: Manager, argv: list[str]) -> int:
    """``docker gpu service ...``: create and ps are ours, everything else is plain ``docker service``."""
    if argv[:1] == ["create"]:
        return service_create(client, argv[1:])
    if argv[:1] == ["ps"] and len(argv) >= 2:
        return service_ps(client, argv[1:])
    return _docker(["service", *argv])


#: ``docker gpu service create``'s own options: name → whether it takes a value. The rest go to Docker.
SERVICE_OPTIONS = {"--gpu-memory": True, "--gpus": True, "--on-overrun": True, "--priority": True,
                   "--preemptible": False, "--queue": False}


def service_create(client: Manager, argv: list[str]) -> int:
    """Check the request against the map, then create the service with the task templates added."""
    constraints, argv = constraints_of(argv)
    ours, passthrough = _take_options(argv, SERVICE_OPTIONS)
    return _docker(["service", "create", *grant_args(client, ours, constraints), *passthrough])


def constraints_of(argv: list[str]) -> tuple[Wanted, list[str]]:
    """The ``--constraint`` options of ``argv``, parsed, and the rest; a PluginError names one that cannot be read."""
    try:
        return take_constraints(argv)
    except ValueError as exc:
        raise PluginError(str(exc)) from None


def grant_args(client: Manager, ours: dict[str, str], constraints: Wanted = NOTHING) -> list[str]:
    """``docker service create`` options that give each replica the grant ``ours`` asks for (also used by stacks).

    The request travels in the task's environment, which the runtime hook reads when the node creates the
    task's container, with Swarm's templates naming the task; the service's labels say it for people.
    ``constraints``: ``node.*`` ones go to Swarm, ``gpu.*`` ones to the hook (``plugin.placement``).
    """
    if "--gpu-memory" not in ours:
        raise PluginError("--gpu-memory is required, e.g. --gpu-memory 6GiB")
    memory, count = _memory(ours["--gpu-memory"]), _count(ours.get("--gpus", "1"))
    _check_fits_somewhere(client, memory, count, constraints.gpu)
    extra = [f"--env={k}={v}" for k, v in TASK_TEMPLATES.items()] + swarm_constraints(constraints)
    extra += [f"--env=GPUMGR_REQUEST_MEMORY={memory}", f"--env=GPUMGR_REQUEST_GPUS={count}",
              f"--label=gpumgr.gpu-memory={memory}", f"--label=gpumgr.gpus={count}"]
    if "--on-overrun" in ours:
        if ours["--on-overrun"] not in ("kill", "stop", "report"):
            raise PluginError("--on-overrun must be kill, stop or report")
        extra.append(f"--env=GPUMGR_REQUEST_ON_OVERRUN={ours['--on-overrun']}")
    if "--priority" in ours:
        try:
            priority = int(ours["--priority"])
        except ValueError:
            raise PluginError(f"--priority must be an integer, not {ours['--priority']!r}") from None
        extra.append(f"--env={Env.REQUEST_PRIORITY}={priority}")
    if "--preemptible" in ours:
        extra.append(f"--env={Env.REQUEST_PREEMPTIBLE}=1")
    if "--queue" in ours:
        # a replica with no room waits in its create, shown as pending by 'docker gpu service ps'
        extra.append(f"--env={Env.REQUEST_QUEUE}=1")
    return extra


def service_ps(client: Manager, argv: list[str]) -> int:
    """Each task of the service with its grant and usage, or the reason it has none."""
    name = argv[-1]
    tasks = _docker_json(["service", "ps", "--no-trunc", "--format", "{{json .}}", name])
    print_tasks(tasks, client.call("GET", "/v1/containers", params={"service": name})["containers"])
    return 0


def print_tasks(tasks: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Swarm's ``tasks`` (``docker service ps`` JSON lines) as a table with each one's grant from ``records``."""
    grants = {r["labels"].get(Label.TASK): r for r in records}
    rows = [("TASK", "NODE", "STATE", "GPU", "GRANT", "USED", "NOTE")]
    for task in tasks:
        record: Any = grants.get(task["ID"])  # a record from the manager's JSON, or None
        live = record and record["state"] in LIVE
        gpu = ",".join(str(g.get("index")) for g in record["gpus"]) if live else "-"
        note = "" if live else (task.get("Error") or (f"grant {record['state']}" if record else ""))
        state = task["CurrentState"]
        if record and record["state"] == "queued" and task.get("DesiredState") == "Running":
            place = record["queue"]
            state = "Pending (queued for room)"
            note = (f"queued at position {place['position']} of {place['length']} for "
                    f"{format_bytes(record['gpu_memory'])} x {record['gpu_count']} GPU(s), "
                    f"waited {place['waited']:.0f}s")
        rows.append((task["Name"], task["Node"], state, gpu,
                     format_bytes(record["gpu_memory"]) if live else "-",
                     format_bytes(record["gpu_memory_used"]) if live else "-", note))
    _print_table(rows)


def _check_fits_somewhere(client: Manager, memory: int, count: int, constraints: Constraints = NO_CONSTRAINTS) -> None:
    nodes = [n for n in client.call("GET", "/v1/nodes")["nodes"] if n["state"] == "ready"]
    if not nodes:
        raise PluginError("no gpumgr agent is ready; start 'gpumgr agent' on the swarm's GPU nodes")
    best = max((sorted(sizes, reverse=True)[count - 1] for sizes in allowed_sizes(nodes, constraints)
                if len(sizes) >= count), default=0)
    if best < memory:
        which = f" that {', '.join(constraints.texts)} allow" if constraints else ""
        raise PluginError(f"no node has {count} GPU(s){which} of {format_bytes(memory)}: the largest that could "
                          f"ever hold this is {format_bytes(best)}; nothing was created")


# --- containers and nodes --------------------------------------------------------------------
def show_containers(client: Manager) -> int:
    """The manager's containers as a table."""
    rows = [("ID", "NAME", "TENANT", "NODE", "GPU", "GRANT", "USED", "PEAK", "STATE", "REASON")]
    for r in client.call("GET", "/v1/containers")["containers"]:
        state = r["state"] if r["queue"] is None else f"queued #{r['queue']['position']}"
        rows.append((r["id"], r["name"], r["tenant"] or "-", r["node"] or "-",
                     ",".join(str(g["index"]) for g in r["gpus"]) or "-", format_bytes(r["gpu_memory"]),
                     format_bytes(r["gpu_memory_used"]), format_bytes(r["gpu_memory_peak"]), state,
                     r["reason"] or ""))
    _print_table(rows)
    return 0


# --- helpers ---------------------------------------------------------------------------------
def _take_options(argv: list[str], wanted: dict[str, bool]) -> tuple[dict[str, str], list[str]]:
    """Pull our options out of a docker command line (before the image), leaving the rest as it was."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        name, has_value, value = arg.partition("=")
        if name in wanted and not wanted[name]:  # a flag
            ours[name] = value if has_value else "1"
        elif name in wanted:
            if not has_value:
                if index + 1 >= len(argv):
                    raise PluginError(f"{name} needs a value")
                index, value = index + 1, argv[index + 1]
            ours[name] = value
        else:
            rest.append(arg)
        index += 1
    return ours, rest


def _memory(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise PluginError(f"invalid --gpu-memory: {exc}") from None


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise PluginError(f"--gpus must be a positive integer, not {text!r}")
    return int(text)


def _docker(args: list[str]) -> NoReturn:
    """Become ``docker ARGS``: its exit status is ours, and no Python is left to wait and tear down.

    ``docker gpu service create`` ends here; its time to the service's first task is the Python's
    start-up plus this hand-over, so ``subprocess`` is not even imported on this path.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp("docker", ["docker", *args])
    except OSError as exc:
        raise PluginError(f"cannot run docker: {exc}") from None


def _docker_call(args: list[str]) -> int:
    """Run ``docker ARGS`` and return its exit status (for a caller with work after it)."""
    import subprocess

    return subprocess.call(["docker", *args])


def _docker_json(args: list[str]) -> list[dict[str, Any]]:
    import subprocess

    result = subprocess.run(["docker", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise PluginError(result.stderr.strip() or f"docker {' '.join(args)} failed")
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _settings() -> dict[str, Any]:
    path = os.path.expanduser(CONFIG_PATH)
    if not os.path.exists(path):
        return {}
    import yaml  # only when there is a file to read: this CLI should start fast

    try:
        with open(path) as handle:
            loaded = yaml.safe_load(handle.read())
    except (OSError, yaml.YAMLError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


if __name__ == "__main__":
    # run the imported module's main, not this __main__ copy's: then one PluginError class is raised and caught
    from gpumgr.plugin.docker_gpu import main as _main

    sys.exit(_main())
