"""The chaos suite: seeded schedules of network faults between the agents and a manager process, under load.

A ``gpumgr manager`` process (heartbeat 0.25 s, so a node is down after 0.75 s of silence), four scripted
agents and one real agent on the real Docker engine, each behind a chaos proxy of its own
(tests/chaos/harness.py). Each schedule cuts, silently partitions (one way or both) or slows some nodes'
connections while client threads POST, DELETE and PATCH containers on every node, heals, and checks:

- every call answered what its node's state allows, and no call that involved only healthy nodes took
  over 2 s (the only timing asserted here);
- once healed, polled until it holds or 15 s pass: every 201 is a container made exactly once that still
  runs unless DELETE'd, every DELETE'd one is gone within 10 s of the heal, nothing is mid-operation, and
  the map, the records and what each agent runs agree (tests/invariant.py over both kinds of agent).

The run's seed is printed at the start and in every failure; ``GPUMGR_CHAOS_SEED=N`` replays its schedules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumgr.wire import protocol
from tests.chaos.harness import (
    SEED_ENV,
    TEMPLATES,
    ChaosStack,
    History,
    call_summary,
    run_schedule,
    run_seed,
    say,
    schedule,
)
from tests.chaos.scripted import Scripted, ScriptedFleet

SEED = run_seed()
SCRIPTED = 4
#: a failure shows at most this many problems, then what is known of the grants they name
MAX_SHOWN = 30


class Stacks:
    """One stack for the module, started when first asked for, and replaced after a schedule that failed
    (so one failure does not leave its debris to the next schedule)."""

    def __init__(self, tmp: Path, docker_client: Any) -> None:
        self.tmp, self.docker = tmp, docker_client
        self.current: tuple[ChaosStack, History] | None = None

    def get(self) -> tuple[ChaosStack, History]:
        if self.current is None:
            started = time.monotonic()
            self.current = ChaosStack(self.tmp, SCRIPTED, docker_client=self.docker), History()
            say(f"stack of {len(self.current[0].nodes)} nodes ready in {time.monotonic() - started:.1f}s")
        return self.current

    def discard(self) -> None:
        if self.current is not None:
            self.current[0].stop()
            self.current = None


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory, docker_client: Any, test_image: str) -> Iterator[Stacks]:
    say(f"seed {SEED} (replay with {SEED_ENV}={SEED})")
    holder = Stacks(tmp_path_factory.mktemp("chaos"), docker_client)
    yield holder
    holder.discard()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_schedule_heals_with_nothing_lost_doubled_or_stuck(stacks: Stacks, test_image: str, name: str,
                                                          request: pytest.FixtureRequest) -> None:
    stack, history = stacks.get()
    outcome = run_schedule(stack, schedule(name, SEED, stack.nodes), history, test_image)
    say(f"{name}: {call_summary(outcome.calls, history)}; settled {outcome.settled_in:.1f}s after the load")
    if outcome.problems:
        stacks.discard()
        found = [p for p in outcome.problems if not p.startswith("about ")]
        about = [p for p in outcome.problems if p.startswith("about ")]
        pytest.fail(f"{outcome.schedule}\nreplay: {SEED_ENV}={SEED} pytest '{request.node.nodeid}' (or the whole "
                    f"file, for the schedules before it)\n  " + "\n  ".join(found[:MAX_SHOWN] + about), pytrace=False)


class Forgetful(ScriptedFleet):
    """Scripted agents that answer every Remove as done and keep the container running."""

    def _run(self, agent: Scripted, message: protocol.Create | protocol.Remove | protocol.Resize) -> protocol.Reply:
        if isinstance(message, protocol.Remove):
            return protocol.Reply(ok=True, result={"grant": message.grant})
        return super()._run(agent, message)


def test_the_checks_catch_agents_that_keep_what_they_removed(tmp_path: Path) -> None:
    """The checker itself can fail: agents that lie about removals leave DELETE'd containers running."""
    stack = ChaosStack(tmp_path, 2, fleet=Forgetful)
    try:
        outcome = run_schedule(stack, schedule("blip", SEED, stack.nodes), History(), "chaos-test", settle_within=2.0)
    finally:
        stack.stop()
    assert any("(DELETE'd) is still on" in p for p in outcome.problems), outcome.problems
    assert any("runs with no live grant" in p for p in outcome.problems), outcome.problems
