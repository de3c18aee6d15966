"""When reclaim may move room from one account to another: Kueue's ``LessThanOrEqualToFinalShare``.

Reclaim compares two siblings under their lowest common parent: ``mine`` (the side of the account that
waits) and ``theirs`` (the side of the victims). With shares measured as allocated over fair share,
room may move only if ``mine``'s share *with the request* is at most ``theirs`` *after the victims
stop*. Why this cannot loop (the docs' proof, in short): before a reclaim ``theirs`` is above its fair
share and ``mine`` below, and after it both shares are at most ``theirs``' old one, one of them
strictly below it; so the largest share among the accounts that take part only falls, and the sorted
vector of all shares falls lexicographically at every reclaim. A finite cluster has finitely many
allocations, so reclaims end; in particular room never moves back and forth between two accounts.
"""

from __future__ import annotations

from gpumgr.manager.fairshare.shares import Shares, share_ratio


def allowed(shares: Shares, mine: str, need: float, theirs: str, taken: float) -> bool:
    """Whether ``mine`` may take ``taken`` bytes from ``theirs`` to run a request of ``need`` bytes."""
    after_mine = share_ratio(shares.allocated.get(mine, 0.0) + need, shares.fair.get(mine, 0.0))
    after_theirs = share_ratio(shares.allocated.get(theirs, 0.0) - taken, shares.fair.get(theirs, 0.0))
    return after_mine <= after_theirs
