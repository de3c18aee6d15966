"""The ``gpumgr`` command: ``manager``, ``agent`` and ``up`` (both on one machine), and the set-up commands."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpumgr.agent.config import AgentSettings
from gpumgr.manager.config import ManagerSettings
from gpumgr.wire import defaults
from gpumgr.wire.config import load_settings, split_hostport
from gpumgr.wire.errors import GpumgrError

log = logging.getLogger("gpumgr")
DEFAULT_URL = f"http://{defaults.API_HOST}:{defaults.API_PORT}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpumgr`` console command."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.func(args)
        return status
    except (ValidationError, ValueError, OSError, GpumgrError) as exc:  # e.g. an etcd store that does not answer
        print(f"gpumgr: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumgr", description="GPU manager for Docker Engine and Docker Swarm.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    manager = sub.add_parser("manager", help="run the manager (REST API + agent link)")
    _manager_flags(manager, config_flag="--config")
    manager.set_defaults(func=run_manager_command)
    agent = sub.add_parser("agent", help="run an agent on this host")
    _agent_flags(agent, config_flag="--config")
    agent.set_defaults(func=run_agent_command)
    up = sub.add_parser("up", help="run a manager and a local agent together on this machine")
    _manager_flags(up, config_flag="--manager-config")
    _agent_flags(up, config_flag="--agent-config", with_endpoint=False)
    up.set_defaults(func=run_up_command)
    token = sub.add_parser("join-token", help="print the token agents join this manager with (last line)")
    token.add_argument("--state-dir", dest="state_dir", help="the manager's state directory")
    token.add_argument("--rotate", action="store_true", help="make a new secret: the old token admits no one")
    _store_flags(token)
    token.set_defaults(func=run_join_token_command)
    store = sub.add_parser("store", help="the etcd store several managers share")
    store_actions = store.add_subparsers(required=True, metavar="ACTION")
    store_status = store_actions.add_parser("status", help="the leader, its epoch, bindings and queue (JSON)")
    _store_flags(store_status)
    store_status.set_defaults(func=run_store_status_command)
    node = sub.add_parser("node", help="manage the nodes the manager knows")
    node_actions = node.add_subparsers(required=True, metavar="ACTION")
    node_rm = node_actions.add_parser("rm", help="forget a node that is down, and its agent's binding")
    node_rm.add_argument("name")
    node_rm.add_argument("--manager-url", help=f"the manager's REST API (default $GPUMGR_MANAGER or {DEFAULT_URL})")
    node_rm.set_defaults(func=run_node_rm_command)
    guard = sub.add_parser("guard", help="run the guard: the engine's authorization plugin refusing GPUs "
                           "taken without a grant (foreground)")
    guard.add_argument("--config", dest="agent_config", metavar="FILE", help="agent YAML settings (guard_*)")
    guard.add_argument("--socket", dest="guard_socket", help="plugin socket (default "
                       "/run/docker/plugins/gpumgr-guard.sock; the file name is the plugin's name)")
    guard.add_argument("--control", dest="guard_control", help="the agent's root-only ticket socket")
    guard.add_argument("--state", dest="guard_state", help="file remembering the containers gpumgr created")
    guard.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ...")
    guard.set_defaults(func=run_guard_command)
    from gpumgr.plugin.commands import add_plugin_commands
    from gpumgr.systemd import add_generate_commands

    add_plugin_commands(sub)
    add_generate_commands(sub)
    return parser


def _manager_flags(parser: argparse.ArgumentParser, config_flag: str) -> None:
    parser.add_argument(config_flag, dest="manager_config", metavar="FILE", help="manager YAML settings")
    parser.add_argument("--api", help=f"REST API HOST:PORT (default {defaults.API_HOST}:{defaults.API_PORT})")
    parser.add_argument("--agents", help=f"ZeroMQ endpoint agents connect to (default {defaults.AGENTS_ENDPOINT})")
    parser.add_argument("--token", help="bearer token required on the REST API (needed beyond loopback)")
    parser.add_argument("--placement", choices=["spread", "binpack"], help="default placement policy")
    parser.add_argument("--state-dir", dest="state_dir", help="keys, join secret and node bindings (default: "
                        "/var/lib/gpumgr as root, else ~/.local/state/gpumgr)")
    parser.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ...")
    _store_flags(parser)
    parser.add_argument("--advertise-api", dest="advertise_api", metavar="URL",
                        help="the URL other managers and clients reach this API at (with --store)")


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", metavar="URL", help="several managers on etcd, "
                        "etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (etcds:// for TLS)")
    parser.add_argument("--store-ca", dest="store_ca", metavar="FILE", help="CA bundle that verifies etcd")
    parser.add_argument("--store-cert", dest="store_cert", metavar="FILE", help="client certificate for etcd")
    parser.add_argument("--store-key", dest="store_key", metavar="FILE", help="client certificate's key")


def _agent_flags(parser: argparse.ArgumentParser, config_flag: str, with_endpoint: bool = True) -> None:
    parser.add_argument(config_flag, dest="agent_config", metavar="FILE", help="agent YAML settings")
    if with_endpoint:
        parser.add_argument("--manager", help=f"manager's agent endpoint (default {defaults.AGENTS_ENDPOINT})")
        parser.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ...")
        parser.add_argument("--join", dest="join_token", metavar="TOKEN",
                            help="join the manager with this token (first start only; env GPUMGR_JOIN_TOKEN)")
        parser.add_argument("--state-dir", dest="state_dir", help="this agent's key and the manager it joined")
    parser.add_argument("--node", help="node name (default: the host name)")
    parser.add_argument("--gpus", help="auto | nvml | sim:SPEC, e.g. sim:2x24GiB or sim:1x8GiB,1x24GiB")
    parser.add_argument("--runtime", choices=["auto", "docker", "process"], help="where containers run")
    parser.add_argument("--label", dest="labels", action="append", metavar="KEY=VALUE",  # issue 23
                        help="a label of this node (repeatable), for node.labels.KEY constraints")  # issue 23


def manager_settings(args: argparse.Namespace) -> ManagerSettings:
    """Manager settings from the parsed flags, the environment and the YAML file."""
    return load_settings(ManagerSettings, _existing(args.manager_config), api=args.api, agents=args.agents,
                         token=args.token, placement=args.placement, log_level=args.log_level,
                         state_dir=args.state_dir, store=args.store, store_ca=args.store_ca,
                         store_cert=args.store_cert, store_key=args.store_key, advertise_api=args.advertise_api)


def agent_settings(args: argparse.Namespace, manager: str | None = None) -> AgentSettings:
    """Agent settings from the parsed flags, the environment and the YAML file."""
    return load_settings(AgentSettings, _existing(args.agent_config), manager=manager or getattr(args, "manager", None),
                         node=args.node, gpus=args.gpus, runtime=args.runtime,
                         log_level=getattr(args, "log_level", None), join_token=getattr(args, "join_token", None),
                         state_dir=getattr(args, "state_dir", None),
                         labels=label_flags(getattr(args, "labels", None)))  # issue 23


def label_flags(given: list[str] | None) -> dict[str, str] | None:
    """``--label k=v`` flags as a dict (None: none given, the YAML's labels stand)."""
    if not given:
        return None
    bad = [item for item in given if not item.partition("=")[0] or "=" not in item]
    if bad:
        raise ValueError(f"--label takes KEY=VALUE, not {bad[0]!r}")
    return dict(item.split("=", 1) for item in given)  # issue 23


def run_manager_command(args: argparse.Namespace) -> int:
    """``gpumgr manager``."""
    settings = manager_settings(args)
    _logging(settings.log_level)
    server, manager = start_manager(settings)
    tune_for_latency()
    _serve_until_signal(server, manager, lambda: manager_settings(args))
    return 0


def tune_for_latency() -> None:
    """Keep the manager's threads from stalling each other: rarer collections, shorter GIL turns.

    A full collection of a 1,000-node map walks every record and took 90-100 ms on a busy 2-core
    machine, stalling the link and the REST threads alike (the p99 of a heartbeat's round trip);
    what exists once the manager has started lives as long as it does, so it is frozen out of
    collections, and young collections run ``GC_THRESHOLD`` apart. The GIL is handed over every
    ``SWITCH_INTERVAL`` instead of 5 ms, so a REST thread encoding JSON delays the link thread less.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*defaults.GC_THRESHOLD)
    sys.setswitchinterval(defaults.SWITCH_INTERVAL)


def run_agent_command(args: argparse.Namespace) -> int:
    """``gpumgr agent``."""
    settings = agent_settings(args)
    _logging(settings.log_level)
    agent = build_agent(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    print(f"gpumgr agent {settings.node}: {len(agent.devices)} {agent.source.kind} GPU(s), "
          f"{agent.runtime.kind} runtime, manager {settings.manager}", flush=True)
    try:
        agent.run()
    finally:
        agent.runtime.close()
        agent.source.close()
    if agent.failure is not None:
        print(f"gpumgr agent: {agent.failure}", file=sys.stderr)
        return 1
    return 0


def run_guard_command(args: argparse.Namespace) -> int:
    """``gpumgr guard``: serve the authorization plugin until SIGTERM or SIGINT."""
    from gpumgr.agent.guard.guard_server import GuardServer, build_guard

    settings = load_settings(AgentSettings, _existing(args.agent_config), guard_socket=args.guard_socket,
                             guard_control=args.guard_control, guard_state=args.guard_state,
                             log_level=args.log_level)
    _logging(settings.log_level)
    server = GuardServer(build_guard(settings), settings.guard_socket, settings.guard_control).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"gpumgr guard: plugin {Path(settings.guard_socket).stem} on {settings.guard_socket}, "
          f"tickets on {settings.guard_control}", flush=True)
    stop.wait()
    server.close()
    return 0


def run_up_command(args: argparse.Namespace) -> int:
    """``gpumgr up``: a manager and one local agent in this process."""
    settings = manager_settings(args)
    _logging(settings.log_level)
    server, manager = start_manager(settings)
    local = agent_settings(args, manager=manager.link.bound_endpoint)
    # the local agent keeps its key beside the manager's and joins with the manager's own token
    admission = manager.admission
    local = local.model_copy(update={"state_dir": str(admission.folder), "join_token": admission.token()})
    agent = build_agent(local)
    thread = threading.Thread(target=agent.run, name="agent", daemon=True)
    thread.start()
    print(f"gpumgr up: local agent {agent.node} with {len(agent.devices)} {agent.source.kind} GPU(s) "
          f"and the {agent.runtime.kind} runtime", flush=True)
    try:
        _serve_until_signal(server, manager, lambda: manager_settings(args))
    finally:
        agent.stop()
        thread.join(5)
        agent.runtime.close()
    return 0


def run_join_token_command(args: argparse.Namespace) -> int:
    """``gpumgr join-token``: works from the state directory whether or not the manager runs."""
    from gpumgr.manager.control.ha import read_only_store, rotating_store
    from gpumgr.manager.control.store_record import join_store
    from gpumgr.manager.link.admission import Admission

    opener = rotating_store if args.rotate else read_only_store
    folder = args.state_dir or ManagerSettings().state_dir
    # several managers: the secret is in etcd, and a rotation there reaches them all at once; without --store,
    # the store the directory's manager recorded (issue 33), or the directory itself
    store = (opener(args.store, ca=args.store_ca, cert=args.store_cert, key=args.store_key) if args.store
             else join_store(folder, opener))
    admission = Admission(folder, store=store)
    if args.rotate:
        admission.rotate()
        print("new join secret: the previous token admits no new agent (admitted agents stay)")
    token = admission.token()
    print(f"on each new host run:  gpumgr agent --manager tcp://THIS-HOST:9401 --join {token}")
    print(token)
    return 0


def run_store_status_command(args: argparse.Namespace) -> int:
    """``gpumgr store status``: what the etcd store holds, read without leading or writing anything."""
    import json

    from gpumgr.manager.control.ha import describe

    if not args.store:
        raise ValueError("gpumgr store status needs --store etcd://HOST:PORT[,...][/PREFIX]")
    print(json.dumps(describe(args.store, ca=args.store_ca, cert=args.store_cert, key=args.store_key), indent=2))
    return 0


def run_node_rm_command(args: argparse.Namespace) -> int:
    """``gpumgr node rm NAME``: ``DELETE /v1/nodes/NAME`` on the manager's API."""
    from gpumgr.plugin.docker_gpu import Manager as ApiClient
    from gpumgr.plugin.docker_gpu import PluginError

    try:
        ApiClient(args.manager_url).call("DELETE", f"/v1/nodes/{args.name}")
    except PluginError as exc:
        print(f"gpumgr node rm: {exc}", file=sys.stderr)
        return 1
    print(f"forgot node {args.name}; its agent must join again to come back")
    return 0


def start_manager(settings: ManagerSettings) -> tuple[Any, Any]:
    """Start the manager's link and build (not run) its WSGI server; refuses an open API without a token."""
    from waitress import create_server  # type: ignore[attr-defined]  # the stubs miss this public function

    from gpumgr.manager.api.app import create_app
    from gpumgr.manager.service import Manager

    host, port = split_hostport(settings.api, defaults.API_PORT)
    check_exposure(settings.api, settings.token)
    if settings.store and not settings.advertise_api:  # the others forward REST calls here when it leads
        public = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        settings = settings.model_copy(update={"advertise_api": f"http://{public}:{port}"})
    manager = Manager(settings)
    manager.start()
    server = create_server(create_app(manager), **server_options(host, port, settings.threads))
    server.channel_class = json_error_channel()
    print(f"gpumgr manager: API on http://{host}:{server.effective_port}, agents on {manager.link.bound_endpoint}",
          flush=True)
    return server, manager


#: The REST server is waitress: one process (the map lives in its memory), one event loop that reads
#: every request whole before a worker thread sees it, so idle and half-sent connections cost a file
#: descriptor each and no thread. Its defaults stop accepting at 100 connections and close idle ones
#: after 120 s, which let 100 idle clients block every request for minutes: these lift the limit to what
#: the open-file limit allows and close idle connections sooner.
API_CONNECTION_LIMIT = 10_000
#: Seconds a connection may sit idle (no request in progress, nothing received) before it is closed,
#: and how often that is checked.
API_IDLE_TIMEOUT = 30
API_IDLE_CHECK = 5
#: Connections the kernel queues while the server catches up.
API_BACKLOG = 2048
#: waitress buffers a request body whole before the app's 1 MiB bound (a JSON 413) reads it: cap that too.
API_MAX_BODY = 2 * 1024 * 1024
#: File descriptors kept for the agent link, the state files and the Docker client; each connection may
#: take up to three (its socket, and a spill file each way for a large body or answer).
FD_RESERVE = 256
FDS_PER_CONNECTION = 3
OPEN_FILES_WANTED = 65_536


def json_error_channel() -> type:
    """waitress's connection class, answering the errors waitress finds itself in the API's JSON shape.

    A request line with raw non-ASCII bytes, bad framing or a body over ``API_MAX_BODY`` never reaches
    the app; waitress answers those with plain text, which clients of a JSON API cannot read.
    """
    import json

    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask

    class JsonErrorTask(ErrorTask):
        def execute(self) -> None:
            parsed: Any = self.request  # the parser's request, whose error made waitress run this task
            error = parsed.error
            code = str(error.reason).lower().replace(" ", "_")
            body = json.dumps({"error": {"code": code, "message": f"{error.reason}: {error.body}"}}).encode()
            self.status = f"{error.code} {error.reason}"
            self.response_headers = [*self.response_headers, ("Content-Type", "application/json")]
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    class JsonErrorChannel(HTTPChannel):
        error_task_class = JsonErrorTask

    return JsonErrorChannel


def server_options(host: str, port: int, threads: int) -> dict[str, Any]:
    """waitress settings for the REST API: see ``API_CONNECTION_LIMIT``. Raises the open-file limit as needed."""
    files = _raise_open_files(OPEN_FILES_WANTED)
    limit = max(100, min(API_CONNECTION_LIMIT, (files - FD_RESERVE) // FDS_PER_CONNECTION))
    return {"host": host, "port": port, "threads": threads, "ident": "gpumgr", "connection_limit": limit,
            "channel_timeout": API_IDLE_TIMEOUT, "cleanup_interval": API_IDLE_CHECK, "backlog": API_BACKLOG,
            # poll(), not select(): select() fails outright on descriptors past 1023
            "asyncore_use_poll": True, "max_request_body_size": API_MAX_BODY}


def _raise_open_files(wanted: int) -> int:
    """Raise this process's soft open-file limit toward ``wanted`` (up to the hard limit); return the soft limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return wanted if soft == resource.RLIM_INFINITY else soft


def build_agent(settings: AgentSettings) -> Any:
    """Open the GPU source and the runtime and wire them into an agent."""
    from gpumgr.agent import procmap
    from gpumgr.agent.agent import Agent
    from gpumgr.agent.gpus.select import open_source
    from gpumgr.agent.identity import load_identity
    from gpumgr.agent.managers import local_address
    from gpumgr.agent.runtimes.choose import build_runtime
    from gpumgr.agent.runtimes.hook_limits import HookLimits

    procmap.set_root(settings.proc_root)
    source = open_source(settings.gpus, seed=settings.node)
    identity = load_identity(settings.state_dir, settings.node, settings.join_token)
    holder: list[Agent] = []
    runtime = build_runtime(settings.runtime, lambda m: holder[0].report_change(m), network_mode=settings.network_mode,
                            device_requests=settings.device_requests, gpu_kind=source.kind,
                            log_dir=settings.process_log_dir, mps=settings.mps, node=settings.node,
                            state_dir=identity.folder, guard_control=settings.guard_control,
                            hook_limits=HookLimits(settings.hook_tenant, settings.hook_max_priority,
                                                   settings.hook_max_memory),
                            policy=settings.policy, mps_pipe_directory=settings.mps_pipe_directory)
    hook = settings.hook_socket if runtime.kind == "docker" else None
    agent = Agent(settings.node, settings.manager, source, runtime, identity,
                  heartbeat_interval=settings.heartbeat_interval, enforcement=settings.enforcement(),
                  hook_socket=hook or None, join_timeout=settings.join_timeout,
                  labels=settings.labels, advertise_addr=settings.advertise_addr or local_address(settings.manager))
    holder.append(agent)
    return agent


def _serve_until_signal(server: Any, manager: Any, reread: Any = None) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads the tenants, quotas and tokens from ``reread()``."""
    def shutdown(*_: Any) -> None:
        # every connection too, not just the listening socket: with poll() the loop runs while any is open
        from waitress import wasyncore

        server.close()
        wasyncore.close_all(getattr(server, "_map", None) or getattr(server, "map", {}))

    def reload(*_: Any) -> None:
        # off the signal handler: reading files and validating must not run inside the server loop's frame
        threading.Thread(target=_reload, args=(manager, reread), name="reload", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, shutdown)
    if reread is not None:
        signal.signal(signal.SIGHUP, reload)
    try:
        server.run()
    except OSError:
        pass  # closing the listening socket from the signal handler ends run() this way
    finally:
        manager.stop()


def check_exposure(api: str, token: str | None) -> None:
    """ValueError if an API on ``api`` without ``token`` would let anyone act as the operator (start and on reload)."""
    host, _ = split_hostport(api, defaults.API_PORT)
    if not token and not _is_loopback(host):
        raise ValueError(f"the API on {host} would let anyone start containers: set a non-empty token (--token, "
                         "GPUMGR_TOKEN or 'token' in the config file) or listen on loopback")


def _reload(manager: Any, reread: Any) -> None:
    """Re-read the settings and put their tenants in force; a file the startup checks refuse keeps the settings.

    The API keeps its address on reload, so a configuration without a token is refused for an API bound
    beyond loopback exactly as at startup: otherwise one SIGHUP would open it to anyone.
    """
    try:
        settings = reread()
        check_exposure(manager.settings.api, settings.token)
        manager.reload_tenants(settings)
    except Exception as exc:  # a YAML syntax error, a bad field, an unreadable token file: say why, keep serving
        log.error("reload refused, the settings in force stay: %s", str(exc).replace("\n", " "))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _existing(path: str | None) -> str | None:
    if path is not None and not Path(path).is_file():
        raise ValueError(f"config file {path} does not exist")
    return path


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
