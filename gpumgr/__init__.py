"""gpumgr: a GPU manager for Docker Engine and Docker Swarm.

One import name for the whole project. The parts sit beneath it, mapped from the repository's
top-level folders: :mod:`gpumgr.manager`, :mod:`gpumgr.agent`, :mod:`gpumgr.plugin` and the shared
ground :mod:`gpumgr.wire`. This package root holds the ``gpumgr`` command, which composes them (nothing
below imports it), and the Python client of the REST API (:mod:`gpumgr.client`), which ``docker gpu``
uses too. ``gpumgr.Client`` is that client's class, imported only when first asked for, so the
commands' start-up does not pay for it.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: this module must stay free
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.3.0"


def __getattr__(name: str) -> Any:
    """``gpumgr.Client``: :class:`gpumgr.client.Client`, imported on first use."""
    if name == "Client":
        from gpumgr.client import Client

        return Client
    raise AttributeError(f"module 'gpumgr' has no attribute {name!r}")
