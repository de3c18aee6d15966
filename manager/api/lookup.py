"""Finding a container as ``docker`` does: by id, by name, or by a prefix of its id that only it has."""

from __future__ import annotations

from gpumgr.manager.model.cluster import Cluster
from gpumgr.manager.model.records import Container
from gpumgr.manager.tenancy.tenants import Principal
from gpumgr.wire.errors import Conflict, NotFound
from gpumgr.wire.names import State

#: Longest reference looked up; ids, names and engine ids are all shorter.
MAX_REF = 256


def resolve(cluster: Cluster, ref: str, principal: Principal) -> Container:
    """The record ``ref`` names among those ``principal`` may see; NotFound, or Conflict (409) if several match.

    In order: an exact grant id; an exact name (the live or newest-ended record of that name, ignoring
    removed ones unless only those have it); a unique prefix of a grant id or of an engine container id.
    """
    if not ref or len(ref) > MAX_REF:
        raise NotFound(f"no container named or with id {ref[:64]!r}")
    try:
        return cluster.get_for(ref, principal)
    except NotFound:
        pass
    records = cluster.containers(principal=principal)
    named = _by_name(records, ref)
    if named is not None:
        return named
    matches = [r for r in records if r.id.startswith(ref) or (r.container_id or "").startswith(ref)]
    if len(matches) > 1:
        raise Conflict(f"{ref!r} is ambiguous: it starts {len(matches)} containers' ids "
                       f"({', '.join(r.id for r in matches[:5])}{', ...' if len(matches) > 5 else ''}); "
                       "give more of the id, or the name")
    if not matches:
        raise NotFound(f"no container named or with id {ref[:64]!r}")
    return matches[0]


def _by_name(records: list[Container], name: str) -> Container | None:
    same = [r for r in records if r.name == name]
    kept = [r for r in same if r.state is not State.REMOVED] or same
    live = [r for r in kept if r.state in (State.QUEUED, State.CREATING, State.RUNNING)]
    if len(live) > 1:
        raise Conflict(f"{len(live)} live containers are named {name!r}; use an id")
    if live:
        return live[0]
    return max(kept, key=lambda r: r.created_at) if kept else None
