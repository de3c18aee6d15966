"""``gpumgr plugin ...``: set up a host for GPU Swarm services."""

from __future__ import annotations

import argparse

from gpumgr.plugin import install


def add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gpumgr plugin install`` on the ``gpumgr`` parser."""
    plugin = sub.add_parser("plugin", help="set up the docker gpu CLI plugin and the Swarm runtime hook")
    actions = plugin.add_subparsers(required=True, metavar="ACTION")
    setup = actions.add_parser("install", help="install the CLI plugin and the OCI runtime hook on this host")
    install.add_arguments(setup)
    setup.set_defaults(func=install.install)
