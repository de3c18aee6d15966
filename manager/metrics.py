"""Prometheus metrics at ``GET /metrics``: the map as gauges, what happened as counters, the API's latency.

A custom collector reads the map once per scrape, under its lock, as plain tuples (:meth:`Cluster.
metrics_snapshot`), and builds the metric families after the lock is released, so a scrape of a large
cluster never holds up a placement for longer than that copy; the accounts' figures are read the same way,
through :meth:`Cluster.accounts_view`, and only when accounts are configured. Each manager has its own registry
(tests run many in one process); the request-duration histogram lives there too. The exposition is
``prometheus_client``'s own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumgr.manager.tenancy.tenants import OPERATOR

if TYPE_CHECKING:
    from gpumgr.manager.model.cluster import Cluster

#: Outcomes of ``gpumgr_placements_total``, always exported (0 until they happen).
OUTCOMES = ("placed", "no_fit", "quota_exceeded", "failed")
#: Buckets of ``gpumgr_request_duration_seconds``: a GET of the map is milliseconds, a create is a Docker start.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: The accounts' gauges: metric name → the account view's field and its help (bytes × GPUs, as the API gives).
ACCOUNT_GAUGES = {
    "gpumgr_account_fair_share_bytes": ("fair_share", "GPU memory (bytes x GPUs) the account should hold now: its "
                                        "quota while it asks for it, and its part of what others leave idle"),
    "gpumgr_account_allocated_bytes": ("allocated", "GPU memory (bytes x GPUs) the account's live containers hold"),
    "gpumgr_account_requested_bytes": ("requested", "GPU memory (bytes x GPUs) the account holds and waits for"),
}


class MapCollector(Collector):
    """Everything ``GET /metrics`` says about the map, read under the map's lock once per scrape."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        """Build the families from one snapshot of the map."""
        snap = self.cluster.metrics_snapshot()
        gpu_labels = ["node", "gpu"]
        total = GaugeMetricFamily("gpumgr_gpu_memory_total_bytes", "GPU memory in all, as the node's NVML reads it",
                                  labels=["node", "gpu", "index", "model"])
        used = GaugeMetricFamily("gpumgr_gpu_memory_used_bytes", "GPU memory in use, every process included",
                                 labels=gpu_labels)
        reserved = GaugeMetricFamily("gpumgr_gpu_memory_reserved_bytes", "GPU memory granted to containers "
                                     "(creating or running)", labels=gpu_labels)
        unmanaged = GaugeMetricFamily("gpumgr_gpu_memory_unmanaged_bytes", "GPU memory in use that no managed "
                                      "container explains (other processes, the driver)", labels=gpu_labels)
        free = GaugeMetricFamily("gpumgr_gpu_memory_free_bytes", "GPU memory that can still be granted: total - "
                                 "reserved - unmanaged - headroom - burst - held for a gang", labels=gpu_labels)
        for node, uuid, index, model, t, u, r, m, f in snap.gpus:
            total.add_metric([node, uuid, str(index), model], t)
            used.add_metric([node, uuid], u)
            reserved.add_metric([node, uuid], r)
            unmanaged.add_metric([node, uuid], m)
            free.add_metric([node, uuid], f)
        burst = GaugeMetricFamily("gpumgr_gpu_memory_burst_bytes", "GPU memory containers use above their grants "
                                  "(bursters): taken, though no grant reserves it", labels=gpu_labels)
        for node, uuid, b in snap.bursts:
            burst.add_metric([node, uuid], b)
        held = GaugeMetricFamily("gpumgr_gpu_memory_reserved_for_gang_bytes", "GPU memory held for the waiting gang "
                                 "that waited longest (gang_reserve_after): nothing else takes it", labels=gpu_labels)
        for node, uuid, h in snap.gang_holds:
            held.add_metric([node, uuid], h)
        shares = GaugeMetricFamily("gpumgr_gpu_compute_shares_percent", "Percent of an MPS GPU's SMs its live "
                                   "grants' compute shares take (at most 100)", labels=gpu_labels)
        for node, uuid, s in snap.shares:
            shares.add_metric([node, uuid], s)
        healthy = GaugeMetricFamily("gpumgr_gpu_healthy", "1 while the GPU takes grants, 0 while its node reports it "
                                    "unhealthy (a fatal Xid, retired pages, ECC errors, heat)", labels=gpu_labels)
        for node, uuid, health in snap.health:
            healthy.add_metric([node, uuid], 0.0 if health else 1.0)
        container_labels = ["node", "gpu", "container", "name", "tenant"]
        grant = GaugeMetricFamily("gpumgr_container_memory_grant_bytes", "GPU memory granted to a container on "
                                  "one GPU", labels=container_labels)
        cused = GaugeMetricFamily("gpumgr_container_memory_used_bytes", "GPU memory a container uses on one GPU, "
                                  "from its node's last sample", labels=container_labels)
        for node, uuid, cid, name, tenant, g, u in snap.containers:
            grant.add_metric([node, uuid, cid, name, tenant], g)
            cused.add_metric([node, uuid, cid, name, tenant], u)
        up = GaugeMetricFamily("gpumgr_node_up", "1 while the node's agent heartbeats, 0 once it is down",
                               labels=["node"])
        for node, ready in snap.nodes:
            up.add_metric([node], 1.0 if ready else 0.0)
        kills = CounterMetricFamily("gpumgr_overrun_kills_total", "Containers killed for using more GPU memory "
                                    "than granted", labels=["node"])
        for node, count in sorted(snap.overrun_kills.items()):
            kills.add_metric([node], count)
        placements = CounterMetricFamily("gpumgr_placements_total", "Placement requests by outcome",
                                         labels=["outcome"])
        for outcome in OUTCOMES:
            placements.add_metric([outcome], snap.outcomes.get(outcome, 0))
        queue = GaugeMetricFamily("gpumgr_queue_length", "Requests waiting in the queue, by tenant (empty: the "
                                  "operator's)", labels=["tenant"])
        for tenant, count in sorted(snap.queued.items()):
            queue.add_metric([tenant], count)
        yield from (total, used, reserved, unmanaged, free, burst, held, shares, healthy, grant, cused, up, kills,
                    placements, queue)
        yield from account_families(self.cluster.accounts_view(OPERATOR) or [])


def account_families(accounts: list[dict[str, Any]]) -> Iterator[Metric]:
    """The accounts' gauges, labelled ``account`` (its path); none at all without accounts configured."""
    if not accounts:
        return
    for name, (field, text) in ACCOUNT_GAUGES.items():
        family = GaugeMetricFamily(name, text, labels=["account"])
        for account in accounts:
            family.add_metric([account["name"]], account[field])
        yield family


class LinkCollector(Collector):
    """How the agent link keeps up: its loop's longest gap between two polls, and what waits on its lanes."""

    def __init__(self, lag: Callable[[], float], backlog: Callable[[], int]) -> None:
        self.lag, self.backlog = lag, backlog

    def collect(self) -> Iterator[Metric]:
        """The longest gap since the last scrape, and the messages waiting to be handled now."""
        yield GaugeMetricFamily("gpumgr_link_loop_lag_seconds", "The agent link loop's longest gap between two "
                                "polls since the last scrape: how late a frame may have been read or sent",
                                value=self.lag())
        yield GaugeMetricFamily("gpumgr_link_backlog", "Messages from agents received and waiting to be handled",
                                value=self.backlog())


class Metrics:
    """One manager's registry: the map's collector and the API's request-duration histogram."""

    def __init__(self, cluster: Cluster) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MapCollector(cluster))
        self.request_duration = Histogram(
            "gpumgr_request_duration_seconds", "REST API requests by route (the URL rule) and method",
            ["route", "method"], registry=self.registry, buckets=DURATION_BUCKETS)

    def watch_link(self, lag: Callable[[], float], backlog: Callable[[], int]) -> None:
        """Export the agent link's loop lag and backlog (the manager calls this once its link exists)."""
        self.registry.register(LinkCollector(lag, backlog))

    def observe(self, route: str, method: str, started: float) -> None:
        """Record one request that began at ``started`` (``time.perf_counter()``)."""
        self.request_duration.labels(route, method).observe(time.perf_counter() - started)
