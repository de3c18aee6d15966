"""``gpumgr plugin ...`` subcommands (filled in by the Swarm work)."""

from __future__ import annotations

import argparse


def add_plugin_commands(sub: argparse._SubParsersAction) -> None:
    """Register the plugin's subcommands on the ``gpumgr`` parser (none yet)."""
