"""An agent's retries of Join and Register are jittered, so a rack of agents does not retry in step."""

from __future__ import annotations

from gpumgr.agent.agent import jittered
from gpumgr.wire import defaults


def test_jittered_waits_spread_over_half_to_one_and_a_half_times() -> None:
    waits = [jittered(defaults.ANSWER_WAIT) for _ in range(2000)]
    assert all(0.5 * defaults.ANSWER_WAIT <= w < 1.5 * defaults.ANSWER_WAIT for w in waits)
    # spread, not in step: each tenth of the range gets some of them
    buckets = {int((w / defaults.ANSWER_WAIT - 0.5) * 10) for w in waits}
    assert buckets == set(range(10))


def test_the_first_wait_for_an_answer_is_not_the_reconnect_backoff() -> None:
    """Waiting 0.1 s for a manager admitting a rack made every agent ask five times."""
    assert defaults.ANSWER_WAIT >= 4 * defaults.RECONNECT_MIN
    assert jittered(max(defaults.RECONNECT_MIN, defaults.ANSWER_WAIT)) >= 0.5 * defaults.ANSWER_WAIT
