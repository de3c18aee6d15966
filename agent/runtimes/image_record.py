"""What a hook-created container's own create asked for, told apart from what its image brought.

The engine merges an image's ``ENV`` and ``LABEL`` into the container's configuration, and it resolves
the image's tag after the guard has judged the create (a ``docker tag`` can swap it in between). So an
image could carry ``GPUMGR_REQUEST_MEMORY=20GiB`` or Swarm's task label past every check on the request.
The agent reads the container's record, where the image is exact (its ID), and the image's own
configuration at that ID from the engine's data root on disk (never through the engine: the hook
runs while the engine holds the container's lock). A ``GPUMGR_*`` variable whose ``NAME=VALUE`` the
image holds is the image's, and is ignored; Swarm's task label is trusted only when the image holds
no such label or another value. An image configuration that cannot be read refuses the request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpumgr.agent.runtimes.hook_limits import SWARM_TASK_LABEL
from gpumgr.wire.constraints import parse_all
from gpumgr.wire.errors import InvalidRequest
from gpumgr.wire.names import Env

#: The variables gpumgr reads from a hook container's environment (its request and its task identity).
OWN_ENV_PREFIX = "GPUMGR_"
IMAGE_ID = re.compile(r"^sha256:([0-9a-f]{64})$")
DRIVER = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def requested(record: dict[str, Any], engine_root: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``(environment, labels)`` of the container ``record`` (its ``config.v2.json``) that its create set.

    Raises InvalidRequest when the image's configuration cannot be read, or when the GPU memory asked
    for comes from the image alone.
    """
    image = image_config(record, engine_root)
    config = record.get("Config") or {}
    image_env = set(image.get("Env") or [])
    env, from_image = {}, set()
    for item in config.get("Env") or []:
        name, sep, value = str(item).partition("=")
        if not sep:
            continue
        if name.startswith(OWN_ENV_PREFIX) and item in image_env:
            from_image.add(name)
        else:
            env[name] = value
    if Env.REQUEST_MEMORY in from_image:
        raise InvalidRequest(f"{Env.REQUEST_MEMORY} comes from the container's image, not from its create: an "
                             f"image cannot ask for a GPU; set it with -e (or use 'docker gpu run')")
    return env, trusted_labels(config.get("Labels") or {}, image.get("Labels") or {})


def trusted_labels(labels: dict[str, Any], image_labels: dict[str, Any]) -> dict[str, Any]:
    """``labels`` without Swarm's task label when the image holds it with the same value (the image set it)."""
    if SWARM_TASK_LABEL in labels and image_labels.get(SWARM_TASK_LABEL) == labels[SWARM_TASK_LABEL]:
        return {name: value for name, value in labels.items() if name != SWARM_TASK_LABEL}
    return dict(labels)


def image_config(record: dict[str, Any], engine_root: str) -> dict[str, Any]:
    """The ``config`` of the image the container was created from, read from the engine's image store."""
    image, driver = str(record.get("Image") or ""), str(record.get("Driver") or "")
    match = IMAGE_ID.match(image)
    if match is None or DRIVER.match(driver) is None:
        raise InvalidRequest(f"the engine's record names no image ID and storage driver ({image!r}, {driver!r})")
    path = Path(engine_root, "image", driver, "imagedb", "content", "sha256", match[1])
    try:
        document = json.loads(path.read_text())
        config = document.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError("its config is not an object")
    except (OSError, ValueError, AttributeError) as exc:
        raise InvalidRequest(f"cannot read the configuration of image {image[:19]} ({exc}); an agent in a "
                             "container needs the engine's image folder mounted") from None
    return config


def task_constraints(given: str | None) -> list[str]:
    """A task's constraints from its environment (a JSON list); ValueError naming what cannot be read."""
    if not given:
        return []
    try:
        texts = json.loads(given)
    except ValueError:
        raise ValueError(f"{Env.REQUEST_CONSTRAINTS} must be a JSON list of constraints") from None
    if not isinstance(texts, list):
        raise ValueError(f"{Env.REQUEST_CONSTRAINTS} must be a JSON list of constraints")
    parse_all(texts)
    return [str(t) for t in texts]
