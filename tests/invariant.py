"""The one invariant of gpumgr, checked over the manager's model and the engines' truth.

For every GPU the live grants sum to at most its memory minus the headroom (and to exactly what the
map shows as reserved), and so do they with what containers use above their grants there (bursts, once a
sample has been taken: the manager grants no byte a burster holds, and the agent stops a burster that grew
into granted bytes); every live grant belongs to exactly one container that exists in the engine,
or is still being created with a deadline; every container that runs under gpumgr holds exactly one
live grant; every record that ended carries its final state, reason, ``finished_at`` (and exit code,
where it exited or was killed) and exactly one final event; and no gang is partly placed (a waiting gang
has no members, a placed one has every member). Every fault test ends with
:func:`settles`, which waits at most two heartbeats for it to hold.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Any

from gpumgr.manager.model.ledger import burst_on
from gpumgr.wire import defaults
from gpumgr.wire.names import Label

LIVE = {"creating", "running"}
ENDED = {"exited", "killed", "failed", "removed", "expired", "preempted"}
#: Engine states in which a container's processes may hold GPU memory.
ENGINE_ALIVE = {"running", "paused", "restarting"}
SETTLE = 2 * defaults.HEARTBEAT_INTERVAL


def violations(manager: Any, docker_client: Any, nodes: set[str]) -> list[str]:
    """Every way the manager's model of ``nodes`` and their engine disagree with the invariant (empty: it holds).

    ``manager`` is a running manager (``tests.procs.ManagerProc``); ``docker_client`` reads the one
    engine the nodes' agents drive. Containers of other nodes on that engine are not looked at.
    """
    found: list[str] = []
    node_list = manager.get("/v1/nodes").json()["nodes"]
    records = manager.get("/v1/containers").json()["containers"]
    events = manager.get("/v1/events").json()["events"]
    mine = [r for r in records if r["node"] in nodes]
    # 0. a queued request holds nothing: no GPU, no container; every tenant's count is its records' sum
    for record in records:
        if record["state"] == "queued" and (record["gpus"] or record["container_id"] or record["node"]):
            found.append(f"queued request {record['id']} holds {record['gpus']} / {record['container_id']}")
    tenants = manager.get("/v1/tenants").json()["tenants"]
    for tenant in tenants:
        held = sum(r["gpu_memory"] * r["gpu_count"] for r in records
                   if r["tenant"] == tenant["name"] and r["state"] in LIVE)
        if held != tenant["in_use"]["gpu_memory"]:
            found.append(f"tenant {tenant['name']} shows {tenant['in_use']['gpu_memory']} bytes in use, its live "
                         f"grants sum to {held}")
    known = {r["container_id"] for r in mine if r["container_id"]}
    # the engine's own list (one call, no per-container inspect that a concurrent removal could race)
    engine = [_Engine(c) for c in docker_client.api.containers(all=True)]
    engine = [c for c in engine if c.labels.get(Label.NODE) in nodes or c.id in known]
    by_id = {c.id: c for c in engine}
    by_grant: dict[str, list[Any]] = defaultdict(list)
    for container in engine:
        if (grant := _grant_of(container)) is not None:
            by_grant[grant].append(container)
    live = [r for r in mine if r["state"] in LIVE]

    # 1. memory: per GPU, live grants fit and the map's figures are their sum
    per_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in live:
        for gpu in record["gpus"]:
            per_gpu[gpu["uuid"]].append(record)
    for node in node_list:
        if node["name"] not in nodes:
            continue
        for gpu in node["gpus"]:
            holders = per_gpu.pop(gpu["uuid"], [])
            granted = sum(r["gpu_memory"] for r in holders)
            if granted > gpu["memory_total"] - gpu["memory_headroom"]:
                found.append(f"GPU {gpu['uuid']} is over-granted: {granted} of {gpu['memory_total']} "
                             f"(headroom {gpu['memory_headroom']})")
            bursts = sum(max(0, r["gpu_memory_used"] - r["gpu_memory_held"]) for r in holders if r["gpu_count"] == 1)
            if all(r["gpu_count"] == 1 for r in holders) and gpu["memory_burst"] != bursts:
                found.append(f"GPU {gpu['uuid']} shows {gpu['memory_burst']} burst, its holders use {bursts} above "
                             "their grants")
            if granted + gpu["memory_burst"] > gpu["memory_total"] - gpu["memory_headroom"]:
                found.append(f"GPU {gpu['uuid']} reserves {granted} and bursters use {gpu['memory_burst']} more: "
                             f"past its {gpu['memory_total']} (headroom {gpu['memory_headroom']})")
            if gpu["memory_reserved"] != granted:
                found.append(f"GPU {gpu['uuid']} shows {gpu['memory_reserved']} reserved, its live grants sum to "
                             f"{granted}")
            shares = sum(r["compute_share"] for r in holders)  # issue 36: at most 100 percent of its SMs
            if shares > defaults.MAX_COMPUTE_SHARE or gpu["compute_shares"] != shares:
                found.append(f"GPU {gpu['uuid']} shows compute shares {gpu['compute_shares']}, its live grants' "
                             f"sum to {shares} (at most {defaults.MAX_COMPUTE_SHARE})")
            if sorted(gpu["containers"]) != sorted(r["id"] for r in holders):
                found.append(f"GPU {gpu['uuid']} lists holders {gpu['containers']}, live grants on it are "
                             f"{sorted(r['id'] for r in holders)}")
    for uuid, holders in per_gpu.items():
        if any(r["state"] == "running" for r in holders):
            found.append(f"live grants {[r['id'] for r in holders]} hold GPU {uuid}, which is on no node's map")

    # 2. every live grant: exactly one container in the engine, or a create in progress with a deadline
    engine_ids = Counter(r["container_id"] for r in live if r["container_id"])
    for record in live:
        containers = {c.id: c for c in by_grant.get(record["id"], [])}
        if record["container_id"] in by_id:
            containers[record["container_id"]] = by_id[record["container_id"]]
        if record["state"] == "creating":
            if record.get("confirm_by") is None:
                found.append(f"grant {record['id']} is creating with no deadline")
            if len(containers) > 1:
                found.append(f"creating grant {record['id']} has {len(containers)} containers")
            continue
        alive = [c for c in containers.values() if c.status in ENGINE_ALIVE]
        if len(alive) != 1:
            found.append(f"running grant {record['id']} has {len(alive)} live engine containers "
                         f"({ {c.short_id: c.status for c in containers.values()} })")
        if record["container_id"] and engine_ids[record["container_id"]] > 1:
            found.append(f"container {record['container_id'][:12]} holds {engine_ids[record['container_id']]} grants")

    # 3. every container that runs under gpumgr holds exactly one live grant
    live_ids = {r["id"] for r in live}
    live_containers = {r["container_id"] for r in live if r["container_id"]}
    for container in engine:
        if container.status not in ENGINE_ALIVE:
            continue
        grant = _grant_of(container)
        if container.id not in live_containers and (grant is None or grant not in live_ids):
            found.append(f"container {container.short_id} ({container.name}, grant {grant}) runs with no live grant")

    # 4. every ended record is complete, with exactly one final event
    oldest_event = events[0]["time"] if len(events) >= defaults.EVENTS_KEPT else 0.0
    finals = Counter(e["container"] for e in events if e.get("final"))
    for record in mine:
        if record["state"] in LIVE:
            if finals[record["id"]]:
                found.append(f"live grant {record['id']} already has a final event")
            continue
        if record["state"] not in ENDED:
            found.append(f"record {record['id']} has unknown state {record['state']!r}")
        missing = [k for k in ("reason", "finished_at") if not record[k]]
        if record["state"] in ("exited", "killed") and record["exit_code"] is None and record["container_id"]:
            missing.append("exit_code")
        if missing:
            found.append(f"{record['state']} record {record['id']} lacks {', '.join(missing)}")
        if record["finished_at"] and record["finished_at"] >= oldest_event and finals[record["id"]] != 1:
            found.append(f"{record['state']} record {record['id']} has {finals[record['id']]} final events")
    # 6. no gang is partly placed: a waiting gang has no members, a placed one every member, none queued
    by_id = {r["id"]: r for r in records}
    for gang in manager.get("/v1/gangs").json()["gangs"]:
        if gang["state"] == "queued" and gang["members"]:
            found.append(f"waiting gang {gang['id']} has members {gang['members']}")
        elif gang["state"] in LIVE:
            placed = [m for m in gang["members"] if m in by_id and by_id[m]["state"] != "queued"]
            if len(placed) != gang["replicas"]:
                found.append(f"gang {gang['id']} ({gang['state']}) is partly placed: {len(placed)} of "
                             f"{gang['replicas']}")
    return found


def settles(manager: Any, docker_client: Any, nodes: set[str], within: float = SETTLE,
            after: float = 0.0) -> None:
    """Fail unless the invariant holds within ``within`` seconds (two heartbeats), after an optional pause.

    ``after`` is for faults whose effect is only visible once a detector has run (a node marked down,
    a deadline passed): the settling time is counted from there.
    """
    time.sleep(after)
    deadline = time.monotonic() + within
    while True:
        problems = violations(manager, docker_client, nodes)
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("invariant broken:\n  " + "\n  ".join(problems))
        time.sleep(0.1)


class _Engine:
    """One entry of the engine's container list, with the few fields the invariant reads."""

    def __init__(self, summary: dict[str, Any]) -> None:
        self.id: str = summary["Id"]
        self.short_id = self.id[:12]
        self.labels: dict[str, str] = summary.get("Labels") or {}
        self.status: str = summary.get("State") or ""
        self.name: str = (summary.get("Names") or ["?"])[0].lstrip("/")


def _grant_of(container: Any) -> str | None:
    grant: str | None = container.labels.get(Label.GRANT)
    return grant


def model_violations(manager: Any, engines: dict[str, dict[str, tuple[str, int]]] | None = None) -> list[str]:
    """The same invariant over an in-process manager's model (no REST, no engine calls), for generated tests.

    ``manager`` is a :class:`gpumgr.manager.service.Manager`; its model's own check
    (:meth:`gpumgr.manager.model.cluster.Cluster.check`: grants add up and fit, every live grant is held,
    ended records hold nothing and have their reason and time, tenants' counts add up) comes first.
    ``engines`` is each node's engine truth, ``{node: {grant: (state, enforced bytes)}}``: a container
    alive on a node on the map must hold a live grant of at least the bytes its agent enforces.
    """
    found = list(manager.cluster.check())
    ledger = manager.cluster.ledger
    with ledger.lock:
        for node, containers in (engines or {}).items():
            if node not in ledger.nodes:
                continue
            for grant, (state, enforced) in containers.items():
                if state not in ENGINE_ALIVE:
                    continue
                record = ledger.records.get(grant)
                if record is None or str(record.state) not in LIVE:
                    found.append(f"container of grant {grant} runs on {node} with no live grant "
                                 f"({record.state if record is not None else 'unknown'})")
                elif record.held < enforced:
                    found.append(f"container of grant {grant} enforces {enforced} on {node}; the map holds "
                                 f"{record.held}")
        for gpu in ledger.gpus.values():  # the bursts the map shows are its holders' use above their grants
            if gpu.burst != burst_on(gpu, ledger.records):
                found.append(f"GPU {gpu.uuid} shows {gpu.burst} burst, its holders use "
                             f"{burst_on(gpu, ledger.records)} above their grants")
        found += gang_violations(manager.cluster)
    return found


def gang_violations(cluster: Any) -> list[str]:
    """No gang is partly placed: a waiting gang has no members; a placed one has every member, none queued;
    an ended one keeps no member running that is not being stopped. Call under the map's lock."""
    found = []
    records = cluster.ledger.records
    for gang in cluster.gangs.gangs.values():
        members = [records.get(m) for m in gang.members]
        if gang.state == "queued" and members:
            found.append(f"waiting gang {gang.id} has members {gang.members}")
        elif gang.state in ("creating", "running"):
            placed = [m for m in members if m is not None and str(m.state) != "queued"]
            if len(placed) != gang.spec.replicas:
                found.append(f"gang {gang.id} ({gang.state}) is partly placed: {len(placed)} of {gang.spec.replicas}")
        else:
            running = [m.id for m in members if m is not None and str(m.state) in LIVE and str(m.desired) == "running"]
            if running:
                found.append(f"gang {gang.id} is {gang.state} but members {running} are meant to run on")
    return found
