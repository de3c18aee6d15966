"""``gpumgr generate systemd PART``: a systemd unit that runs one part of gpumgr, printed as ``podman generate
systemd`` prints one.

The unit names the command by absolute path (this installation's ``gpumgr``, or its Python with ``-m gpumgr``),
restarts it on failure, gives it a state directory that systemd creates with mode 0700 (``StateDirectory``),
and stops it with SIGTERM, on which every part shuts down cleanly. ``KillMode=mixed`` sends that SIGTERM to
the main process only: containers are the engine's children, not the unit's, so they keep running while
the agent is stopped or restarted, and the agent re-adopts them when it comes back.

Each part is one entry of :data:`PARTS`: another part needs only its own entry.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

#: Seconds systemd waits for a restart after a failure, and for a stop before SIGKILL.
RESTART_SEC = 2
STOP_TIMEOUT = 30
UNIT_DIR = "/etc/systemd/system"


@dataclass(frozen=True)
class Part:
    """One part of gpumgr as a systemd service."""

    description: str
    #: The subcommand and its fixed arguments.
    command: tuple[str, ...]
    #: Under /var/lib: the ``--state-dir`` the unit passes.
    state_directory: str
    #: Units it starts after (and wants started): the network, the engine it drives.
    after: tuple[str, ...] = ("network-online.target",)
    #: Whether SIGHUP re-reads its settings (``systemctl reload``).
    reloads: bool = False
    #: Units that must wait for it (the guard starts before the engine that calls it).
    before: tuple[str, ...] = ()
    #: A part that keeps one state file instead of a folder: ``--state DIR/FILE``.
    state_file: str | None = None
    restart: str = "on-failure"
    #: Targets (or units) whose start pulls it in.
    wanted_by: tuple[str, ...] = ("multi-user.target",)


PARTS: dict[str, Part] = {
    "manager": Part("gpumgr manager: the REST API, the GPU map and the agent link", ("manager",), "gpumgr",
                    reloads=True),
    "agent": Part("gpumgr agent: runs, meters and enforces GPU containers on this host", ("agent",), "gpumgr-agent",
                  after=("network-online.target", "docker.service")),
    # the engine calls it on every request: it starts first and always comes back (see plugin/guard_install.py)
    "guard": Part("gpumgr guard: the Docker engine's authorization plugin refusing GPUs taken without a grant",
                  ("guard", "--socket", "/run/docker/plugins/gpumgr-guard.sock"), "gpumgr-guard",
                  after=("local-fs.target",), before=("docker.service",), state_file="guard-state.json",
                  restart="always", wanted_by=("multi-user.target", "docker.service")),
}


def add_generate_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gpumgr generate systemd PART`` on the ``gpumgr`` parser."""
    generate = sub.add_parser("generate", help="print files that run gpumgr under a service manager")
    kinds = generate.add_subparsers(required=True, metavar="KIND")
    systemd = kinds.add_parser("systemd", help="print a systemd unit for one part of gpumgr",
                               description="Print a systemd unit; install it with: gpumgr generate systemd PART > "
                                           f"{UNIT_DIR}/gpumgr-PART.service && systemctl daemon-reload && "
                                           "systemctl enable --now gpumgr-PART")
    systemd.add_argument("part", choices=sorted(PARTS), help="which part the unit runs")
    systemd.add_argument("--config", help="the part's YAML settings file (made absolute)")
    systemd.add_argument("--state-dir", help="its state directory (default: /var/lib/ + the part's own folder, "
                                             "which systemd creates)")
    systemd.add_argument("--env-file", help="a file of GPUMGR_... settings the unit reads (EnvironmentFile), "
                                            "e.g. GPUMGR_MANAGER=tcp://HOST:9401 and, for a first join, "
                                            "GPUMGR_JOIN_TOKEN=...; keep it mode 0600")
    systemd.set_defaults(func=run_generate_systemd)


def run_generate_systemd(args: argparse.Namespace) -> int:
    """Print the unit."""
    print(unit(args.part, config=args.config, state_dir=args.state_dir, env_file=args.env_file), end="")
    return 0


def command_path() -> list[str]:
    """The absolute command that runs this installation's gpumgr: its console script, else its Python ``-m``."""
    script = Path(sys.executable).parent / "gpumgr"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script.absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "gpumgr"]


def unit(name: str, config: str | None = None, state_dir: str | None = None, env_file: str | None = None,
         command: tuple[str, ...] | None = None) -> str:
    """The text of the systemd unit for part ``name``: settings come from ``config`` and ``env_file``.

    ``command`` replaces the part's subcommand and fixed arguments (``plugin install --guard`` names
    the socket it was given).
    """
    part = PARTS[name]
    folder = state_dir or f"/var/lib/{part.state_directory}"
    argv = [*command_path(), *(command or part.command), *(["--state", f"{folder}/{part.state_file}"] if part.state_file
                                                else ["--state-dir", folder])]
    if config:
        argv += ["--config", str(Path(config).absolute())]
    after = " ".join(part.after)
    lines = [f"# gpumgr-{name}.service, written by: gpumgr generate systemd {name}",
             f"# install: save as {UNIT_DIR}/gpumgr-{name}.service, then systemctl daemon-reload && "
             f"systemctl enable --now gpumgr-{name}",
             "[Unit]", f"Description={part.description}", f"After={after}", f"Wants={after}",
             *([f"Before={' '.join(part.before)}"] if part.before else []), "",
             "[Service]", "Type=simple", f"ExecStart={shlex.join(argv)}"]
    if part.reloads:
        lines.append("ExecReload=/bin/kill -HUP $MAINPID")
    if state_dir is None:
        lines += [f"StateDirectory={part.state_directory}", "StateDirectoryMode=0700"]
    if env_file:
        lines.append(f"EnvironmentFile={Path(env_file).absolute()}")
    lines += ["Environment=PYTHONUNBUFFERED=1", f"Restart={part.restart}", f"RestartSec={RESTART_SEC}",
              "KillSignal=SIGTERM", "KillMode=mixed", f"TimeoutStopSec={STOP_TIMEOUT}", "",
              "[Install]", f"WantedBy={' '.join(part.wanted_by)}", ""]
    return "\n".join(lines)
