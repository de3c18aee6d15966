"""gpumgr: a GPU manager for Docker Engine and Docker Swarm.

One import name for the whole project. The parts sit beneath it, mapped from the repository's
top-level folders: :mod:`gpumgr.manager`, :mod:`gpumgr.agent`, :mod:`gpumgr.plugin` and the shared
ground :mod:`gpumgr.wire`. This package root holds only the ``gpumgr`` command, which composes them;
nothing below imports it.
"""

__version__ = "0.1.0"
