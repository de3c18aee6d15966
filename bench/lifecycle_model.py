"""The lifecycle's model-based test, run long: the real manager against misbehaving scripted agents.

Runs ``tests/test_lifecycle_model.py``'s state machine for ``--examples`` examples of ``--steps`` steps
each (rules and invariant as in CI, where it runs 500 examples of 40 steps), counts the steps taken,
and reports steps per second and whether any example broke the invariant (hypothesis then prints the
shrunk sequence and this exits 1).

    python bench/lifecycle_model.py [--examples 1000] [--steps 50] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from bench.harness import save
from tests.test_lifecycle_model import LifecycleMachine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the agents' troubles are logged by the manager on every step
    counted = {"steps": 0, "examples": 0}
    original = LifecycleMachine.the_invariant_holds

    def counting(self: LifecycleMachine) -> None:
        counted["steps"] += 1
        original(self)

    LifecycleMachine.the_invariant_holds = counting  # type: ignore[method-assign]
    LifecycleMachine._hypothesis_internal_use_seed = args.seed  # type: ignore[attr-defined]
    start = time.perf_counter()
    failed = False
    try:
        run_state_machine_as_test(LifecycleMachine, settings=settings(
            max_examples=args.examples, stateful_step_count=args.steps, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
    except Exception as exc:  # the shrunk failing sequence was printed by hypothesis
        print(f"INVARIANT BROKEN: {type(exc).__name__}: {exc}")
        failed = True
    elapsed = time.perf_counter() - start
    result = {"examples": args.examples, "max_steps": args.steps, "steps": counted["steps"],
              "seconds": round(elapsed, 1), "steps_per_second": round(counted["steps"] / elapsed, 1),
              "broken": failed}
    print(f"{counted['steps']:,} steps checked in {elapsed:.1f}s ({counted['steps'] / elapsed:,.0f}/s) over "
          f"{args.examples} examples of up to {args.steps} steps: invariant {'BROKEN' if failed else 'held'}")
    save(args.json, "lifecycle_model", args, **result)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
