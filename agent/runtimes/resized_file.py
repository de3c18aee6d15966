"""What an agent keeps of the grants resized after their containers were created, so a restart re-adopts them.

A container's labels hold its grant as it was created and cannot change; a PATCH's new figure (and a
burstable grant's new limit) is kept in the state directory's resized file, beside the figures of the
other resized grants, for as long as the container is tracked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpumgr.wire import security

log = logging.getLogger(__name__)


def read_resized(path: Path | None) -> tuple[dict[str, int], dict[str, int]]:
    """``(grant → bytes per GPU, grant → burst limit)`` kept in ``path``; nothing if it is absent or unreadable."""
    if path is None or not path.exists():
        return {}, {}
    try:
        kept = security.read_private(path)
        grants = {str(k): int(v) for k, v in kept.get("grants", {}).items() if int(v) > 0}
        limits = {str(k): max(0, int(v)) for k, v in kept.get("limits", {}).items()}
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring the resized grants file: %s", exc)
        return {}, {}
    return grants, limits
