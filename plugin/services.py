"""``docker gpu service``: every replica of a Swarm service placed on a GPU with room (create, ps), and the
options a grant gives a service, which stacks reuse.
"""

from __future__ import annotations

from typing import Any

from gpumgr.plugin.cli_base import (
    Manager,
    PluginError,
    _count,
    _docker,
    _docker_json,
    _memory,
    _print_table,
    _take_options,
)
from gpumgr.plugin.placement import NOTHING, Wanted, allowed_sizes, swarm_constraints, take_constraints
from gpumgr.wire import defaults
from gpumgr.wire.constraints import GPU_MPS, NO_CONSTRAINTS, Constraints, parse
from gpumgr.wire.names import LIVE, Env, Label
from gpumgr.wire.units import format_bytes

#: Swarm expands these templates per task; the runtime hook reads them when the task's container is created.
TASK_TEMPLATES = {Env.TASK: "{{.Task.ID}}", Env.TASK_NAME: "{{.Task.Name}}",
                  Env.SERVICE: "{{.Service.Name}}", Env.SLOT: "{{.Task.Slot}}"}


# --- service ---------------------------------------------------------------------------------
#: A service with a compute share runs only where the nodes run MPS (the manager's implicit filter, checked here too).
MPS = parse(f"{GPU_MPS}==true")


def service(client: Manager, argv: list[str]) -> int:
    """``docker gpu service ...``: create and ps are ours, everything else is plain ``docker service``."""
    if argv[:1] == ["create"]:
        return service_create(client, argv[1:])
    if argv[:1] == ["ps"] and len(argv) >= 2:
        return service_ps(client, argv[1:])
    return _docker(["service", *argv])


#: ``docker gpu service create``'s own options: name → whether it takes a value. The rest go to Docker.
SERVICE_OPTIONS = {"--gpu-memory": True, "--gpu-memory-limit": True, "--gpus": True, "--on-overrun": True,
                   "--priority": True, "--preemptible": False, "--queue": False, "--compute-share": True}


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
    share = _share(ours.get("--compute-share"))
    if share:  # Swarm, too, sends its tasks only to MPS nodes (the label their agents write)
        constraints = constraints._replace(gpu=Constraints((*constraints.gpu.items, MPS)))
    _check_fits_somewhere(client, memory, count, constraints.gpu)
    extra = [f"--env={k}={v}" for k, v in TASK_TEMPLATES.items()] + swarm_constraints(constraints)
    extra += [f"--env=GPUMGR_REQUEST_MEMORY={memory}", f"--env=GPUMGR_REQUEST_GPUS={count}",
              f"--label=gpumgr.gpu-memory={memory}", f"--label=gpumgr.gpus={count}"]
    if "--gpu-memory-limit" in ours:  # a burstable grant: the hook asks for the limit beside the request
        limit = _memory(ours["--gpu-memory-limit"])
        if limit < memory:
            raise PluginError("--gpu-memory-limit must be at least --gpu-memory")
        extra.append(f"--env={Env.REQUEST_MEMORY_LIMIT}={limit}")
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
    if share:
        extra += [f"--env={Env.REQUEST_COMPUTE_SHARE}={share}", f"--label=gpumgr.compute-share={share}"]
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


def _share(given: str | None) -> int:
    """``--compute-share``: a whole percentage of each GPU's SMs, 1-100 (0: none given)."""
    if given is None:
        return 0
    if not (given.isascii() and given.isdigit()) or not 1 <= int(given) <= defaults.MAX_COMPUTE_SHARE:
        raise PluginError(f"--compute-share must be a whole percentage from 1 to 100, not {given!r}")
    return int(given)


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

