"""``gpumgr plugin ...``: set up a host for GPU Swarm services, and take that set-up away again."""

from __future__ import annotations

import argparse

from gpumgr.plugin.install import guard_install, install


def add_plugin_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``gpumgr plugin install``, ``uninstall`` and ``status`` on the ``gpumgr`` parser."""
    plugin = sub.add_parser("plugin", help="set up the docker gpu CLI plugin and the Swarm runtime hook")
    actions = plugin.add_subparsers(required=True, metavar="ACTION")
    setup = actions.add_parser("install", help="install the CLI plugin and the OCI runtime hook on this host")
    install.add_arguments(setup)
    install.add_dry_run_argument(setup)
    guard_install.add_arguments(setup, installing=True)  # issue 22
    setup.set_defaults(func=guard_install.install_command)
    remove = actions.add_parser("uninstall", help="put the Docker engine back as it was before install and "
                                                  "remove the CLI plugin and the runtime hook")
    install.add_path_arguments(remove)
    install.add_dry_run_argument(remove)
    guard_install.add_arguments(remove, installing=False)  # issue 22
    remove.set_defaults(func=guard_install.uninstall_command)
    check = actions.add_parser("status", help="what is installed, whether the engine took it, and whether the "
                                              "launchers' Python is still there (exit 1 on any problem)")
    install.add_path_arguments(check, reload=False)
    check.set_defaults(func=install.status)
