"""Place+release decisions per second on the real cluster map (no I/O, no sockets).

Builds ``manager.cluster.Cluster`` with ``--nodes`` nodes of ``--gpus`` GPUs each, fills it to about
``--fill`` of its memory with a random mix of grants, then times loops of ``reserve()`` followed by
``finish(cid, State.EXITED)`` (one decision = one place + one release, with the event log and the
bounded list of finished records doing their real work) for ``spread`` and ``binpack``, interleaved,
``--reps`` times each. The pure ``manager.scheduler.place`` rate on the same index is reported for
reference, and so are the multi-GPU path (``gpus`` 2 and 4, any node), and the cost of one node's
heartbeat (8 GPU samples, no container reports) on the same map.

``--tree REV`` runs this script on the whole tree of git revision ``REV`` (every module of the map:
ledger, lifecycle, events, records; laid out from ``git archive``, old layouts included) and on this
tree, each in a process of its own, alternating ``--reps`` times, and reports both and their ratios.

``--against REV`` times the scheduler module of git revision ``REV`` (``manager/scheduler.py`` as it
was there) side by side in the same process: a second map is built with it, the same seeds, and every
measurement alternates between the two, so the ratios are of one run on one machine.

``--accounts N`` times the same workload on three maps side by side in the same process, built from
the same seeds, every measurement alternating between them: ``plain`` (no tenants, as above),
``tenants`` (2N tenants, no accounts) and ``accounts`` (the same tenants, two to an account, in N
accounts whose quotas add up to the capacity: issue 34's accounts). On the last two the fill's grants
and the timed requests are the tenants', in turn. Each median is printed, and the ratios to ``plain``
and of ``accounts`` to ``tenants`` (the goal: placing with accounts within 1.3× of without).

    python bench/scheduler.py [--nodes 1000] [--gpus 8] [--fill 0.8] [--reps 7] [--seconds 1.0]
                              [--against main | --tree cb6fc3b | --accounts 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, GiB, median, save, table
from gpumgr.manager.model.cluster import Cluster, PlacementSpec, State
from gpumgr.manager.placing import scheduler as new_scheduler
from gpumgr.wire import defaults
from gpumgr.wire.errors import Conflict, NoFit
from gpumgr.wire.protocol import GpuInfo, GpuSample

#: Single-GPU request sizes (GiB) of the timed mix: all fit on a GPU that is ~80% reserved.
MIX_GIB = (1, 1, 2, 2, 4, 8)
#: ``--accounts``: the maps timed side by side (no tenants; tenants only; tenants in accounts).
MODES = ("plain", "tenants", "accounts")


def build(nodes: int, gpus: int, size_gib: int, fill: float, seed: int, mode: str = "plain",
          accounts: int = 4) -> tuple[Cluster, float]:
    """A cluster of ``nodes`` × ``gpus`` filled to about ``fill`` of its memory; returns it and the real fill.

    ``mode`` (one of :data:`MODES`) puts tenants, and accounts, in force first (:func:`tenancy`); the
    fill's grants are then the tenants', in turn (:func:`tenants_of` reads them back).
    """
    cluster = Cluster()
    for n in range(nodes):
        name = f"node-{n:04d}"
        infos = [GpuInfo(uuid=f"GPU-{n:04d}-{i}", index=i, name="Sim", memory_total=size_gib * GiB)
                 for i in range(gpus)]
        cluster.register(name, name.encode(), "docker", infos, [])
    rng = random.Random(seed)
    total = nodes * gpus * size_gib * GiB
    who = tenancy(cluster, mode, accounts, total) or [None]
    reserved = 0
    misses = 0
    turns = itertools.count()
    while reserved < fill * total and misses < 20_000:
        count = rng.choice((1, 1, 1, 1, 2, 4))
        memory = rng.choice((1, 2, 4, 8, 12, 16)) * GiB
        placement = rng.choice(("spread", "binpack"))
        # multi-GPU grants are pinned to a node: unpinned ones scan every node (see the gpus=2|4 rows)
        node = f"node-{rng.randrange(nodes):04d}" if count > 1 else None
        try:
            cluster.reserve(PlacementSpec(memory=memory, count=count, placement=placement, image="img",
                                          command=["sleep", "300"], node=node), tenant=who[next(turns) % len(who)])
            reserved += memory * count
        except (NoFit, Conflict):  # (Conflict: an account past its quota, which the even turns never reach)
            misses += 1
    return cluster, reserved / total


def tenancy(cluster: Cluster, mode: str, accounts: int, capacity: int) -> list[Any]:
    """Put ``mode``'s tenants in force on ``cluster``: none (``plain``), ``2 × accounts`` tenants, and with
    ``accounts`` as many accounts, two tenants each, whose quotas add up to ``capacity``. Returns the tenants."""
    if mode == "plain":
        return []
    # imported here: the trees that --tree runs this script on may predate them
    from gpumgr.manager.tenancy.accounts import AccountConfig, build_accounts
    from gpumgr.manager.tenancy.tenants import Tenant, TenantBook
    tenants = [Tenant(f"tenant{i}", f"token-{i:04d}".encode() * 2, None, None, 0) for i in range(2 * accounts)]
    cluster.tenants = TenantBook({t.name: t for t in tenants}, "operator-token-0000")
    if mode == "accounts":
        quotas = {f"team{a}": AccountConfig(quota={"gpu_memory": capacity // accounts}) for a in range(accounts)}
        cluster.accounts = build_accounts(quotas, {t.name: f"team{i % accounts}" for i, t in enumerate(tenants)})
    return tenants


def tenants_of(cluster: Cluster) -> list[Any]:
    """The map's tenants, in the order :func:`tenancy` made them (none on a plain map)."""
    book = getattr(cluster, "tenants", None)  # (a map of a tree before tenants has none)
    return [] if book is None else sorted(book.all(), key=lambda t: int(t.name.removeprefix("tenant")))


def time_reserve_release(cluster: Cluster, specs: list[PlacementSpec], seconds: float,
                         tenants: Sequence[Any] = ()) -> tuple[int, float]:
    """Run reserve()+finish() over ``specs`` (cycled; as ``tenants``, in turn) for about ``seconds``; return
    (decisions, elapsed)."""
    n, k = 0, len(specs)
    who = list(tenants) or [None]
    w = len(who)
    reserve, finish, exited = cluster.reserve, cluster.finish, State.EXITED
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(256):
            record = reserve(specs[n % k], tenant=who[n % w])
            finish(record.id, exited)
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def load_scheduler(rev: str) -> types.ModuleType:
    """``manager/scheduler.py`` as it was at git revision ``rev``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:manager/scheduler.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"scheduler_at_{rev}")
    module.__dict__["__name__"] = module.__name__
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is built
    exec(compile(source, f"{rev}:manager/scheduler.py", "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def using(module: types.ModuleType) -> Iterator[None]:
    """Make the cluster map build and consult its free index with ``module``'s scheduler meanwhile.

    Every manager module that imported one of the scheduler's names (the map, its ledger, the
    dispatcher, ...) gets ``module``'s instead, and its own back afterwards.
    """
    names = ("FreeIndex", "Placement", "Request", "place")
    saved = []
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("gpumgr.manager.") and m is not new_scheduler]:
        for name in names:
            if getattr(mod, name, None) is getattr(new_scheduler, name):
                saved.append((mod, name))
                setattr(mod, name, getattr(module, name))
    try:
        yield
    finally:
        for mod, name in saved:
            setattr(mod, name, getattr(new_scheduler, name))


def _index_of(cluster: Cluster) -> Any:
    """The map's free index (the ledger's; ``_index`` on the map before the cluster was split by idea)."""
    ledger = getattr(cluster, "ledger", None)
    return ledger.index if ledger is not None else cluster._index  # type: ignore[attr-defined]


def time_place(cluster: Cluster, requests: list, seconds: float, place: Callable) -> tuple[int, float]:
    """Run the pure ``place()`` over ``requests`` (cycled) on the cluster's index; return (decisions, elapsed)."""
    n, k, index = 0, len(requests), _index_of(cluster)
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(256):
            place(index, requests[n % k])
            n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def time_heartbeat(cluster: Cluster, nodes: int, gpus: int, seconds: float) -> tuple[int, float]:
    """Heartbeats (GPU samples, no container reports) over every node in turn; return (heartbeats, elapsed)."""
    beats = [(f"node-{n:04d}", [GpuSample(uuid=f"GPU-{n:04d}-{i}", memory_used=0, memory_unmanaged=0)
                                for i in range(gpus)]) for n in range(nodes)]
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        name, samples = beats[n % nodes]
        cluster.heartbeat(name, name.encode(), samples, [])
        n += 1
        now = time.perf_counter()
        if now >= deadline:
            return n, now - start


def side_by_side(rates: dict[str, list[float]]) -> dict[str, float]:
    """``--accounts``: each measurement's medians on the three maps, and their ratios (printed, and returned
    as ``"<mode>/<mode> <measurement>"``)."""
    names = [name.removeprefix("plain ") for name in rates if name.startswith("plain ")]
    ratios: dict[str, float] = {}
    rows = []
    for name in names:
        plain, tenants, accounts = (median(rates[f"{mode} {name}"]) for mode in MODES)
        ratios |= {f"tenants/plain {name}": plain / tenants, f"accounts/plain {name}": plain / accounts,
                   f"accounts/tenants {name}": tenants / accounts}
        rows.append([name, plain, tenants, accounts, plain / accounts, tenants / accounts])
    table([("medians, same run (ratios: time per op)", "42"), ("plain/s", "11,.0f"), ("tenants/s", "11,.0f"),
           ("accounts/s", "11,.0f"), ("acc/plain", "10.3f"), ("acc/ten", "8.3f")], rows, lead="\n")
    return ratios


def measure(cluster: Cluster, module: types.ModuleType, args: argparse.Namespace,
            rates: dict[str, list[float]], label: str) -> None:
    """One repetition of every measurement on ``cluster`` with ``module``'s scheduler, into ``rates``."""
    rng = random.Random(args.seed + 1)
    tenants = tenants_of(cluster)
    sizes = [rng.choice(MIX_GIB) * GiB for _ in range(997)]
    counts = [2, 4] * 500
    for p in ("spread", "binpack"):  # interleaved, so drift and noise hit both alike
        single = [PlacementSpec(memory=m, count=1, placement=p, image="img", command=["sleep", "300"]) for m in sizes]
        multi = [PlacementSpec(memory=m, count=c, placement=p, image="img", command=["sleep", "300"])
                 for m, c in zip(sizes, counts, strict=False)]
        requests = [module.Request(m, 1, None, module.Placement(p)) for m in sizes]
        multi_requests = [module.Request(m, c, None, module.Placement(p)) for m, c in zip(sizes, counts, strict=False)]
        with using(module):
            n, dt = time_reserve_release(cluster, single, args.seconds, tenants)
            rates.setdefault(f"{label}reserve+finish {p}", []).append(n / dt)
            n, dt = time_place(cluster, requests, args.seconds / 2, module.place)
            rates.setdefault(f"{label}place() only {p}", []).append(n / dt)
            n, dt = time_reserve_release(cluster, multi, args.multi_seconds, tenants)
            rates.setdefault(f"{label}reserve+finish {p} gpus=2|4", []).append(n / dt)
            n, dt = time_place(cluster, multi_requests, args.multi_seconds, module.place)
            rates.setdefault(f"{label}place() only {p} gpus=2|4", []).append(n / dt)
    with using(module):
        n, dt = time_heartbeat(cluster, args.nodes, args.gpus, args.multi_seconds)
    rates.setdefault(f"{label}heartbeat() of one node", []).append(n / dt)


def spread_of_ties(module: types.ModuleType, nodes: int, gpus: int, requests: int) -> int:
    """How many nodes ``requests`` two-GPU spread requests land on, on a map of empty nodes."""
    with using(module):
        cluster, _ = build(nodes, gpus, 80, 0.0, 1)
        used = {cluster.reserve(PlacementSpec(memory=GiB, count=2, placement="spread", image="img",
                                              command=["sleep", "300"])).node for _ in range(requests)}
    return len(used)


#: Runs this script on a staged tree: ``python -c DRIVER TREE ROOT LAYOUT ARGS...``. A tree of the old
#: layout (top-level ``manager``, ``wire``) is imported under the names this script uses.
DRIVER = """
import importlib, sys, types
tree, root, old, argv = sys.argv[1], sys.argv[2], sys.argv[3] == "old", sys.argv[4:]
sys.path.insert(0, tree)
if old:
    sys.modules["gpumgr"] = types.ModuleType("gpumgr")
    sys.modules["gpumgr"].__path__ = []
    for name in ("manager", "wire", "manager.scheduler", "manager.cluster", "wire.defaults", "wire.errors",
                 "wire.protocol"):
        sys.modules["gpumgr." + name] = importlib.import_module(name)
else:
    import gpumgr.manager.model.cluster
sys.path.insert(1, root)
import bench.scheduler
sys.exit(bench.scheduler.main(argv))
"""


def stage_tree(rev: str, into: Path) -> tuple[Path, str]:
    """Git revision ``rev`` laid out for import; returns the path to put first and its layout (new or old)."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    if not (tree / "gpumgr" / "__init__.py").exists():
        return tree, "old"
    package = into / "path" / "gpumgr"
    package.mkdir(parents=True)
    for file in (tree / "gpumgr").glob("*.py"):
        (package / file.name).symlink_to(file)
    for part in ("manager", "agent", "plugin", "wire"):
        (package / part).symlink_to(tree / part)
    return into / "path", "new"


def trees(args: argparse.Namespace, argv: list[str]) -> int:
    """``--tree REV``: this script on REV's tree and on this one, each in its own process, alternating."""
    passed = [a for a in argv if not a.startswith("--tree") and a != args.tree]
    passed = [a for i, a in enumerate(passed) if a != "--reps" and (i == 0 or passed[i - 1] != "--reps")]
    passed = [a for i, a in enumerate(passed) if a != "--json" and (i == 0 or passed[i - 1] != "--json")]
    rates: dict[str, dict[str, list[float]]] = {f"before ({args.tree})": {}, "after (this tree)": {}}
    with tempfile.TemporaryDirectory(prefix="gpumgr-sched-tree-") as tmp:
        path, layout = stage_tree(args.tree, Path(tmp))
        commands = {f"before ({args.tree})": [sys.executable, "-P", "-c", DRIVER, str(path), str(ROOT), layout],
                    "after (this tree)": [sys.executable, str(Path(__file__).resolve())]}
        for rep in range(args.reps):
            for name in list(commands) if rep % 2 == 0 else list(commands)[::-1]:
                out = Path(tmp) / "rep.json"
                env = {**os.environ, "PYTHONPATH": ""}
                subprocess.run([*commands[name], *passed, "--reps", "1", "--json", str(out)], check=True, env=env,
                               stdout=subprocess.DEVNULL)
                for row in json.loads(out.read_text())["results"]:
                    rates[name].setdefault(row["name"], []).append(row["median_per_s"])
                print(f"  rep {rep + 1}/{args.reps}: {name} done", file=sys.stderr)
    before, after = rates.values()
    names = [n for n in after if n in before]
    rows = [[n, median(before[n]), median(after[n]), median(after[n]) / median(before[n])] for n in names]
    table([("measurement (medians of --reps runs)", "42"), ("before/s", "12,.0f"), ("after/s", "12,.0f"),
           ("after/before", "12.2f")], rows, lead="\n")
    print(f"load average now: {os.getloadavg()}")
    save(args.json, "scheduler-trees", args, tree=args.tree, rates=rates,
         ratios={r[0]: r[3] for r in rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--gpu-size", type=int, default=80, help="GiB per GPU")
    parser.add_argument("--fill", type=float, default=0.8, help="fraction of memory reserved before timing")
    parser.add_argument("--reps", type=int, default=7, help="repetitions of each measurement")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of one repetition")
    parser.add_argument("--multi-seconds", type=float, default=0.5, help="length of one multi-GPU repetition")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", type=float, default=50_000, help="place+release/s target")
    parser.add_argument("--against", metavar="REV", help="also time the scheduler of this git revision, side by side")
    parser.add_argument("--tree", metavar="REV", help="run this script on the whole tree of this revision and on "
                        "this one, alternating, each in its own process")
    parser.add_argument("--accounts", type=int, metavar="N", help="time three maps side by side: no tenants, 2N "
                        "tenants, and the tenants in N accounts whose quotas add up to the capacity")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tree:
        return trees(args, list(sys.argv[1:] if argv is None else argv))

    variants: list[tuple[str, types.ModuleType, str]] = [("", new_scheduler, "plain")]
    if args.against:
        variants = [("before ", load_scheduler(args.against), "plain"), ("after ", new_scheduler, "plain")]
    elif args.accounts:
        variants = [(f"{mode} ", new_scheduler, mode) for mode in MODES]
    maps = {}
    for label, module, mode in variants:
        t0 = time.perf_counter()
        with using(module):
            maps[label], filled = build(args.nodes, args.gpus, args.gpu_size, args.fill, args.seed, mode,
                                        args.accounts or 4)
        live = len(maps[label].containers(state="creating"))
        print(f"{label}map: {args.nodes} nodes x {args.gpus} GPUs x {args.gpu_size} GiB, {filled:.1%} reserved by "
              f"{live} live grants (built in {time.perf_counter() - t0:.1f}s); FINISHED_KEPT={defaults.FINISHED_KEPT}")
        with using(module):  # warm-up: fills the finished-record list so the timed loops pay for forgetting
            for p in ("spread", "binpack"):
                spec = PlacementSpec(memory=GiB, count=1, placement=p, image="img", command=["sleep", "300"])
                time_reserve_release(maps[label], [spec], 0.2, tenants_of(maps[label]))

    rates: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for label, module, _ in variants if rep % 2 == 0 else variants[::-1]:  # who goes first alternates
            measure(maps[label], module, args, rates, label)
        print(f"  rep {rep + 1}/{args.reps} done", file=sys.stderr)

    rows = [{"name": name, "median_per_s": median(values), "min_per_s": min(values), "max_per_s": max(values),
             "us_per_op": 1e6 / median(values), "samples": values} for name, values in rates.items()]
    table([("measurement", "42"), ("median/s", "12,.0f"), ("min/s", "12,.0f"), ("max/s", "12,.0f"), ("us/op", "9.2f")],
          [[r["name"], r["median_per_s"], r["min_per_s"], r["max_per_s"], r["us_per_op"]] for r in rows], lead="\n")
    ratios = {}
    if args.against:
        names = [name.removeprefix("after ") for name in rates if name.startswith("after ")]
        ratios = {name: median(rates[f"after {name}"]) / median(rates[f"before {name}"]) for name in names}
        table([("after / before (medians, same run)", "42"), ("ratio", "10.2f")],
              [[name, ratio] for name, ratio in ratios.items()], lead="\n")
        ties = {label.strip(): spread_of_ties(module, args.nodes, args.gpus, 200) for label, module, _ in variants}
        print(f"\n200 two-GPU spread requests on {args.nodes} empty nodes land on: "
              + ", ".join(f"{n} nodes ({label})" for label, n in ties.items()))
    if args.accounts:
        ratios = side_by_side(rates)
    last = variants[-1][0]
    after = _index_of(maps[last])
    still = sum(s.reserved for _, s in after.by_free) / (args.nodes * args.gpus * args.gpu_size * GiB)
    worst = min(median(rates[f"{last}reserve+finish {p}"]) for p in ("spread", "binpack"))
    met = worst >= args.target
    print(f"\nreserved after timing: {still:.1%}; target >= {args.target:,.0f} place+release/s "
          f"(single-GPU mix, worse placement): {worst:,.0f}/s -> {'MET' if met else 'MISSED'}")
    save(args.json, "scheduler", args, fill_after=still, results=rows, ratios=ratios,
         target_per_s=args.target, worst_single_gpu_median_per_s=worst, target_met=met)
    return 0


if __name__ == "__main__":
    sys.exit(main())
