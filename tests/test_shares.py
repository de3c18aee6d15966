"""Compute shares in the scheduler and the model (issue 36): at most 100 percent per GPU, on MPS GPUs only.

The scheduler is checked on small maps against what the rule says; the model (a real :class:`Cluster`,
no processes) on grants, releases, the queue, preemption and its own invariant check.
"""

from __future__ import annotations

import pytest

from gpumgr.manager.model.cluster import Cluster, PlacementSpec
from gpumgr.manager.placing.scheduler import FreeIndex, GpuSlot, Request, place
from gpumgr.manager.placing.shares import MPS_ONLY, ShareRoom, ever_fits, with_share
from gpumgr.wire.constraints import NO_CONSTRAINTS, parse, parse_all
from gpumgr.wire.errors import NoFit
from gpumgr.wire.protocol import GpuInfo

G = 1 << 30


def index_of(*slots: GpuSlot) -> FreeIndex:
    index = FreeIndex()
    for each in slots:
        index.add(each)
    return index


def gpu(node: str, i: int, mps: bool, shares: int = 0, free: int = 24 * G) -> GpuSlot:
    return GpuSlot(f"GPU-{node}-{i}", node, i, 24 * G, reserved=24 * G - free, mps=mps, compute_shares=shares)


def test_a_share_goes_only_to_an_mps_gpu_with_room_though_others_have_more_memory() -> None:
    plain, full, roomy = gpu("a", 0, False), gpu("b", 0, True, 80, free=20 * G), gpu("c", 0, True, 20, free=2 * G)
    index = index_of(plain, full, roomy)
    assert place(index, Request(G)) == [plain]  # without a share: by memory alone, MPS or not
    assert place(index, Request(G, constraints=with_share(NO_CONSTRAINTS, 80))) == [roomy]
    assert place(index, Request(G, constraints=with_share(NO_CONSTRAINTS, 20))) == [full]  # 80 + 20 is 100
    with pytest.raises(NoFit):
        place(index, Request(G, constraints=with_share(NO_CONSTRAINTS, 81)))
    with pytest.raises(NoFit):  # the roomy GPU lacks the bytes, the other the share
        place(index, Request(3 * G, constraints=with_share(NO_CONSTRAINTS, 30)))


def test_a_multi_gpu_share_needs_room_on_each_of_its_gpus_and_keeps_other_constraints() -> None:
    index = index_of(gpu("a", 0, True, 50), gpu("a", 1, True, 70), gpu("b", 0, True, 0), gpu("b", 1, True, 40),
                     gpu("c", 0, False), gpu("c", 1, False))
    chosen = place(index, Request(G, 2, constraints=with_share(NO_CONSTRAINTS, 40)))
    assert {s.node for s in chosen} == {"b"}
    assert place(index, Request(G, 2, constraints=with_share(NO_CONSTRAINTS, 30)))[0].node in ("a", "b")
    with pytest.raises(NoFit):
        place(index, Request(G, 2, constraints=with_share(parse_all(["node.name==a"]), 40)))
    assert place(index, Request(G, 2, node="b", constraints=with_share(NO_CONSTRAINTS, 60)))[0].node == "b"


def test_gpu_mps_constraint_and_the_share_rooms_own_reading() -> None:
    on, off = gpu("a", 0, True, 100), gpu("b", 0, False)
    assert parse("gpu.mps==true").allows(on) and not parse("gpu.mps==TRUE").allows(off)
    assert parse("gpu.mps!=true").allows(off) and parse("gpu.mps==false").allows(off)
    for bad in ("gpu.mps>=true", "gpu.mps==yes"):
        with pytest.raises(ValueError, match=r"gpu\.mps"):
            parse(bad)
    room = ShareRoom("compute_share 1", "gpu.mps", "<=", number=(1,))
    assert not room.allows(on) and not room.allows(off) and room.allows(gpu("c", 0, True, 99))
    assert ever_fits(NO_CONSTRAINTS, 0) is NO_CONSTRAINTS and ever_fits(NO_CONSTRAINTS, 5).items == (MPS_ONLY,)


def cluster(mps: dict[str, bool]) -> Cluster:
    model = Cluster()
    for name, on in mps.items():
        model.register(name, name.encode(), "docker", [GpuInfo(uuid=f"GPU-{name}", index=0, name="sim",
                                                               memory_total=24 * G)], [], mps=on)
    return model


def spec(share: int = 0, **extra: object) -> PlacementSpec:
    return PlacementSpec(memory=G, count=1, placement="spread", image="img", command=[], compute_share=share,
                         **extra)  # type: ignore[arg-type]


def test_the_model_counts_shares_per_gpu_releases_them_and_its_check_sees_a_wrong_sum() -> None:
    model = cluster({"m": True, "p": False})
    with pytest.raises(NoFit) as never:
        cluster({"p": False}).submit(spec(10), queue=True)
    assert never.value.code == "never_fits" and "mps: true" in never.value.message
    first = model.reserve(spec(60))
    assert first.node == "m" and model.ledger.gpus["GPU-m"].compute_shares == 60
    with pytest.raises(NoFit) as no_room:
        model.reserve(spec(60))
    assert no_room.value.code == "no_fit" and "compute_share of 60%" in no_room.value.message
    assert model.reserve(spec(0, node="m")).node == "m"  # unshared: it takes what is left, counting nothing
    waiting, _ = model.submit(spec(60), queue=True)
    assert waiting.state == "queued"
    with pytest.raises(NoFit, match="wait for room first"):  # nothing jumps the line, unshared or not
        model.reserve(spec(0, node="m"))
    assert model.check() == []
    model.finish(first.id, "exited", reason="exited", exit_code=0)
    model.dispatch()
    assert waiting.state == "creating" and model.ledger.gpus["GPU-m"].compute_shares == 60
    model.ledger.gpus["GPU-m"].compute_shares = 70
    assert any("compute shares 70" in p for p in model.check())


def test_preemption_frees_share_room_for_a_queued_share_of_higher_priority() -> None:
    model = cluster({"m": True})
    low = model.reserve(spec(70, preemptible=True, priority=0))
    model.started(low.id, _report(low))
    high, _ = model.submit(spec(50, priority=5), queue=True)
    model.dispatch()
    assert high.state == "queued" and low.desired == "preempted"


def _report(record):  # what the agent says once the container runs
    from gpumgr.wire.protocol import ContainerReport

    return ContainerReport(grant=record.id, container_id=f"c-{record.id}", state="running", gpus=record.gpus,
                           gpu_memory=record.gpu_memory)


def test_the_cli_the_stack_and_stats_carry_the_share() -> None:
    from gpumgr.plugin import run_flags, services, stack, stats
    from gpumgr.plugin.cli_base import PluginError

    args = run_flags.parser(PluginError).parse_args(["--gpu-memory", "1GiB", "--compute-share", "25", "img"])
    assert run_flags.build_request(args, PluginError)["compute_share"] == 25
    assert "compute_share" not in run_flags.build_request(
        run_flags.parser(PluginError).parse_args(["--gpu-memory", "1GiB", "img"]), PluginError)
    assert stack.grant_request("t", {"compute_share": 50}, {"gpu_memory": "1GiB"}) == [
        "--compute-share", "50", "--gpu-memory", "1GiB"]
    assert services.SERVICE_OPTIONS["--compute-share"] and services._share("100") == 100
    for bad in ("0", "101", "x", "2.5"):
        with pytest.raises(PluginError, match="compute-share"):
            services._share(bad)
    row = {"id": "a", "container_id": None, "name": "n", "node": "m", "gpus": [], "gpu_memory": G, "gpu_count": 1,
           "gpu_memory_used": 0, "gpu_memory_peak": 0, "state": "running", "compute_share": 25}
    assert stats.stats_row(row)["compute_share"] == 25
    assert stats.share_text(25) == "25%" and stats.share_text(0) == "-"


def test_what_a_container_of_an_mps_node_gets() -> None:
    from docker.types import Mount

    from gpumgr.agent.runtimes import mps
    from gpumgr.agent.runtimes.runtime import Managed, grant_env, managed_from_labels, task_env
    from gpumgr.wire.protocol import ContainerSpec

    spec = ContainerSpec(grant="g", name="n", gpus=["u0", "u1"], gpu_memory=2 * G, compute_share=25)
    assert grant_env(spec, mps=True)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert grant_env(spec, mps=True)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M,1=2048M"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in grant_env(spec, mps=False)  # no MPS: it means nothing
    hooked = Managed(grant="g", container_id="c", name="n", gpus=["u0"], gpu_memory=G, compute_share=40)
    assert task_env(hooked, "node", mps=True)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    labels = {"gpumgr.grant": "g", "gpumgr.gpu": "u0", "gpumgr.memory": str(G)}
    assert managed_from_labels("c", {**labels, "gpumgr.compute_share": "30"}, "img", "running").compute_share == 30
    assert managed_from_labels("c", {**labels, "gpumgr.compute_share": "300"}, "img", "running").compute_share == 0
    asked = {"mounts": [Mount(target="/tmp/nvidia-mps", source="/home/x")], "shm_size": 1 << 30, "ipc_mode": None}
    given = mps.docker_options(asked, "/tmp/nvidia-mps")
    assert given["ipc_mode"] == "host" and "shm_size" not in given
    assert [(m["Source"], m["Target"], m["ReadOnly"]) for m in given["mounts"]] == [
        ("/tmp/nvidia-mps", "/tmp/nvidia-mps", False)]


def test_the_guard_lets_an_agents_mps_create_through(tmp_path) -> None:
    """The agent's own additions on an MPS node (the pipe directory bound, host IPC) pass its ticketed create."""
    import base64
    import json

    from gpumgr.agent.guard.guard import TICKET_LABEL, Guard, GuardState
    from gpumgr.wire.engine import gpudev

    guard = Guard(gpudev.Policy(default=gpudev.DefaultRuntime(frozenset({"runc"}), None)),
                  GuardState(tmp_path / "guard.json"))
    guard.state.add_ticket("t" * 32)
    body = {"Image": "x", "Labels": {TICKET_LABEL: "t" * 32},
            "Env": ["NVIDIA_VISIBLE_DEVICES=GPU-1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                    "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"],
            "HostConfig": {"IpcMode": "host", "Mounts": [{"Type": "bind", "Source": "/tmp/nvidia-mps",
                                                          "Target": "/tmp/nvidia-mps"}]}}
    request = {"RequestMethod": "POST", "RequestUri": "/v1.41/containers/create?name=job", "RequestHeaders": {},
               "RequestBody": base64.b64encode(json.dumps(body).encode()).decode()}
    decision = guard.request(request)
    assert decision.allow, decision.message
    guard.state.add_ticket("u" * 32)  # the same create binding a guarded path is judged, ticket or not
    body["Labels"] = {TICKET_LABEL: "u" * 32}
    body["HostConfig"]["Mounts"][0]["Source"] = "/etc/docker"  # type: ignore[index]
    request["RequestBody"] = base64.b64encode(json.dumps(body).encode()).decode()
    assert not guard.request(request).allow
