"""``docker gpu``: a Docker CLI plugin that puts GPU memory grants on containers and Swarm services.

Docker runs ``docker-gpu gpu ARGS`` for ``docker gpu ARGS`` (and ``docker-gpu
docker-cli-plugin-metadata`` to learn about it). The manager is found from ``--manager``,
``GPUMGR_MANAGER`` or ``~/.config/gpumgr/plugin.yaml``; its token from ``GPUMGR_TOKEN`` or that file.
"""

from __future__ import annotations

import json
import sys

from gpumgr.plugin.cli_base import EXIT_UNKNOWN as EXIT_UNKNOWN
from gpumgr.plugin.cli_base import Manager as Manager
from gpumgr.plugin.cli_base import PluginError as PluginError
from gpumgr.plugin.cli_base import _format, _print_table
from gpumgr.plugin.services import service
from gpumgr.wire.units import format_bytes

METADATA = {"SchemaVersion": "0.1.0", "Vendor": "gpumgr", "Version": "0.3.0",
            "ShortDescription": "GPU memory grants for containers and Swarm services"}




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
    if command == "accounts":
        return show_accounts(client, rest)
    if command == "gang":
        from gpumgr.plugin import gangs_cli

        return gangs_cli.gang(client, rest)
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
                 [--priority N] [--preemptible] [--queue] [--compute-share PCT]
                 [docker service create options] IMAGE [CMD]
  service ps SERVICE      each replica: node, GPU, grant, usage, or why it waits
  service rm SERVICE...   (any other 'service' command is passed to 'docker service' unchanged)
  stack deploy -c FILE [-c FILE...] [docker stack deploy options] STACK
                          each service's x-gpumgr block (gpu_memory, gpus, priority, preemptible, queue,
                          compute_share, constraints, on_overrun; a top-level x-gpumgr gives defaults) becomes every
                          replica's grant, as 'service create' gives it; the rest goes to 'docker stack deploy'
  stack ps STACK          each replica: node, GPU, grant, usage, or why it waits
  stack rm|ls ...         passed to 'docker stack' unchanged
  run --gpu-memory SIZE [--gpus N] [--node NODE] [--constraint C ...] [--placement P] [--on-overrun A]
      [--priority N] [--preemptible] [--queue [--queue-timeout S]] [--compute-share PCT]
      [docker run options: -d --rm --name -e --env-file -l -v --mount --tmpfs -p --network --shm-size
       --ipc --pid -w -u --entrypoint --cpus -m --ulimit --cap-add --device --privileged --stop-signal
       --log-driver --log-opt] IMAGE [CMD]
                          like 'docker run': attached, it streams the output and exits with the
                          container's exit code (125 when docker gpu itself fails)
  run --gang N --gpu-memory SIZE [--no-one-per-node] [--restart-gang N] [--queue] [run options] IMAGE [CMD]
                          N members placed all at once or none, each told GPUMGR_GANG_RANK and torchrun's
                          PET_* rendezvous; always detached: prints the gang's id
  gang ps [--format table|json]       every gang: state, replicas, grant, restarts, master
  gang logs [-f] [--tail N] GANG      every member's output, each line prefixed with its rank: [0] ...
  gang rm GANG...                     end it: every member is stopped and removed
  logs [-f] [--tail N] CONTAINER      its output, from whichever node runs it
  wait CONTAINER...       block until each ends; print its exit code
  kill [-s SIGNAL] CONTAINER...
  rm [-f] CONTAINER...    remove (-f: even while running); its grant is freed
                          CONTAINER: an id, a name, or a prefix of an id that only it has
  ps                      containers known to the manager
  accounts [--format table|json]
                          each account's quota, limit, weight and priority, its fair share, and what it
                          holds, requests and waits for (bytes x GPUs)
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


def show_accounts(client: Manager, argv: list[str]) -> int:
    """``docker gpu accounts [--format table|json]``: each account's fair share against what it holds."""
    form = _format(argv, "docker gpu accounts [--format table|json]")
    accounts = client.call("GET", "/v1/accounts")["accounts"]
    if form == "json":  # the API's objects as they are: a script reads [] when no accounts are configured
        print(json.dumps(accounts))
        return 0
    if not accounts:
        print("no accounts are configured (the manager's YAML has no accounts: section)")
        return 0
    rows = [("NAME", "PARENT", "QUOTA", "LIMIT", "WEIGHT", "PRIORITY", "FAIR SHARE", "ALLOCATED", "REQUESTED",
             "WAITING")]
    for a in accounts:
        limit = a["limit"]["gpu_memory"]
        rows.append((a["name"], a["parent"] or "-", format_bytes(a["quota"]["gpu_memory"]),
                     "-" if limit is None else format_bytes(limit), f"{a['over_quota_weight']:g}", str(a["priority"]),
                     format_bytes(a["fair_share"]), format_bytes(a["allocated"]), format_bytes(a["requested"]),
                     format_bytes(a["waiting"])))
    _print_table(rows)
    return 0


















if __name__ == "__main__":
    # run the imported module's main, not this __main__ copy's: then one PluginError class is raised and caught
    from gpumgr.plugin.docker_gpu import main as _main

    sys.exit(_main())
