"""What adds up to ``--privileged`` without the word: added capabilities and lifted confinement.

With ``CAP_SYS_ADMIN`` (or ``--cap-add ALL``), and no AppArmor profile to stop ``mount``, a container
can mount the cgroup tree read-write: on cgroup v1 it writes its own ``devices.allow`` or moves into
the host's root cgroup, then ``mknod``\\s and opens ``/dev/nvidia*``. So the guard judges, on every
container create (plain or holding a ticket) and every service:

- each added capability against the node's ``policy.cap_add``; ``ALL`` and ``SYS_ADMIN`` pass only
  when that list names them (``ALL`` there lets every other capability pass);
- an unconfined seccomp, AppArmor or SELinux setting together with any added capability: the
  confinement is what keeps the default capabilities harmless.

The engine reads a capability case-insensitively, with or without ``CAP_``; a security option as
``KEY=VALUE`` or the older ``KEY:VALUE``. Both are read that way here. Pure functions, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from typing import Any

#: Capabilities that pass only when the node's ``policy.cap_add`` lists them by name.
BY_NAME_ONLY = frozenset({"ALL", "SYS_ADMIN"})
#: seccomp default actions that allow every syscall no rule names: such a profile confines nothing.
ALLOWING_ACTIONS = frozenset({"SCMP_ACT_ALLOW", "SCMP_ACT_LOG"})


def capability(name: str) -> str:
    """``name`` as the engine reads it, without ``CAP_``: ``sys_admin`` and ``CAP_SYS_ADMIN`` are ``SYS_ADMIN``."""
    return name.upper().removeprefix("CAP_")


def cap_reasons(added: Any, where: str, allowed: frozenset[str]) -> list[str]:
    """Capabilities in ``added`` that the node's ``allowed`` (its ``policy.cap_add``) does not let through."""
    allowed = frozenset(capability(name) for name in allowed)
    reasons = []
    for entry in _strings(added):
        name = capability(entry)
        if name in allowed or (name not in BY_NAME_ONLY and "ALL" in allowed):
            continue
        why = "every capability" if name == "ALL" else f"CAP_{name}"
        reasons.append(f"{where} adds {why} ({entry!r}), which this node's policy.cap_add does not list"
                       + (" by name" if name in BY_NAME_ONLY and "ALL" in allowed else ""))
    return reasons


def security_opt_reasons(options: Any, added: Any, where: str) -> list[str]:
    """Security options that lift the container's confinement while ``added`` capabilities are asked for."""
    if not _strings(added):
        return []
    return [f"{where} {_short(option)!r} {problem} while capabilities are added"
            for option in _strings(options) if (problem := _option_problem(option))]


def service_privilege_reasons(container: dict[str, Any], where: str, allowed: frozenset[str]) -> list[str]:
    """A service's ``CapabilityAdd`` and ``Privileges`` (seccomp, AppArmor), judged as a container's."""
    added = container.get("CapabilityAdd")
    reasons = cap_reasons(added, f"{where}.CapabilityAdd", allowed)
    if not _strings(added):
        return reasons
    privileges = container.get("Privileges") or {}
    seccomp = privileges.get("Seccomp") or {}
    mode = str(seccomp.get("Mode") or "").lower()
    if mode == "unconfined" or (mode == "custom" and _profile_problem(_profile_text(seccomp.get("Profile")))):
        reasons.append(f"{where}.Privileges.Seccomp (mode {mode!r}) lifts the seccomp profile while "
                       "capabilities are added")
    if str((privileges.get("AppArmor") or {}).get("Mode") or "").lower() == "disabled":
        reasons.append(f"{where}.Privileges.AppArmor (mode 'disabled') lifts the AppArmor profile while "
                       "capabilities are added")
    return reasons


def _option_problem(option: str) -> str | None:
    key, value = _split_option(option)
    key = key.lower()
    if key in ("apparmor", "seccomp") and value.strip().lower() == "unconfined":
        return f"lifts the {'AppArmor' if key == 'apparmor' else 'seccomp'} profile"
    if key == "label" and value.strip().lower() == "disable":
        return "lifts the SELinux labels"
    if key == "seccomp" and (problem := _profile_problem(value)):
        return problem
    return None


def _split_option(option: str) -> tuple[str, str]:
    """``(key, value)`` as the engine splits a security option: at the first ``=``, else at the first ``:``."""
    separator = "=" if "=" in option else ":"
    key, _, value = option.partition(separator)
    return key, value


def _profile_problem(text: str) -> str | None:
    """Why a custom seccomp profile confines nothing (it allows by default), or cannot be read; None if it confines."""
    if text.strip().lower() in ("", "builtin", "default"):
        return None
    try:
        profile = json.loads(text)
    except ValueError:
        return "is a seccomp profile the guard cannot read"
    action = profile.get("defaultAction") if isinstance(profile, dict) else None
    if not isinstance(action, str) or action.upper() in ALLOWING_ACTIONS:
        return f"is a seccomp profile whose default action ({action!r}) allows every syscall"
    return None


def _profile_text(profile: Any) -> str:
    """A service's custom profile: the engine's JSON carries its bytes in base64."""
    try:
        return base64.b64decode(str(profile or ""), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return "not base64"


def _short(option: str) -> str:
    return option if len(option) <= 80 else option[:77] + "..."


def _strings(values: Any) -> list[str]:
    return [str(value) for value in values] if isinstance(values, Iterable) and not isinstance(values, str) \
        else [str(values)] if isinstance(values, str) else []
