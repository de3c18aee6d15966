"""Compute shares: the part of a GPU's SMs a request may use under MPS, at most 100 percent per GPU.

A request's ``compute_share`` (1-100) reaches each of its processes as ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
on a node whose agent runs with ``mps: true``. The scheduler keeps the shares of the live grants on each
GPU at or below :data:`~gpumgr.wire.defaults.MAX_COMPUTE_SHARE`, so the shared clients of one GPU never
crowd each other past what they were promised.

A request with a share is placed through the constrained path of the scheduler, with one more
constraint, :class:`ShareRoom` (an MPS GPU with the share still free); a request without one is placed
as before and pays nothing. A request **without** a share takes what is left, unshared: it counts
nothing against the 100 and gets no percentage, so MPS lets it use any SM (MPS's own rule for a client
without a cap). Shares are caps among the shared clients, not reservations against everyone.

Whether a request could *ever* fit (``never_fits``) asks only for an MPS GPU (:data:`MPS_ONLY`): an empty
GPU always has the room for any one share.
"""

from __future__ import annotations

from gpumgr.manager.placing.free_index import GpuSlot
from gpumgr.wire.constraints import GPU_MPS, Constraint, Constraints, ConstraintTarget, parse
from gpumgr.wire.defaults import MAX_COMPUTE_SHARE
from gpumgr.wire.errors import NoFit

#: What a request with a share asks of a GPU that could ever hold it: its node runs MPS.
MPS_ONLY = parse(f"{GPU_MPS}==true")


class ShareRoom(Constraint):
    """An MPS GPU whose live shares leave room for ``number[0]`` more percent (built by :func:`with_share`)."""

    __slots__ = ()

    def allows(self, gpu: ConstraintTarget) -> bool:
        """Whether ``gpu``'s node runs MPS and its shares have room for this one."""
        taken = getattr(gpu, "compute_shares", None)  # a slot of the map has it; nothing else is placed on
        return gpu.mps and taken is not None and taken + self.number[0] <= MAX_COMPUTE_SHARE


def with_share(constraints: Constraints, share: int) -> Constraints:
    """``constraints`` plus room for ``share`` percent on an MPS GPU (``constraints`` itself for no share)."""
    if not share:
        return constraints
    room = ShareRoom(f"compute_share {share}", GPU_MPS, "<=", number=(share,))
    return Constraints((*constraints.items, room))


def ever_fits(constraints: Constraints, share: int) -> Constraints:
    """What an empty GPU must satisfy to hold a request with ``share``: ``constraints``, on an MPS node."""
    return Constraints((*constraints.items, MPS_ONLY)) if share else constraints


def shares_problems(gpu: GpuSlot, shares: int) -> list[str]:
    """How ``gpu``'s shares break the invariant: its holders' shares (``shares``) are not what it shows, or pass 100."""
    found = []
    if gpu.compute_shares != shares:
        found.append(f"GPU {gpu.uuid} shows compute shares {gpu.compute_shares}; its holders hold {shares}")
    if shares > MAX_COMPUTE_SHARE:
        found.append(f"GPU {gpu.uuid} holds compute shares of {shares}%, over {MAX_COMPUTE_SHARE}")
    return found


def no_share_room(exc: NoFit, share: int) -> NoFit:
    """``exc`` (no room now) said for a request with ``share``: memory may not be all that is missing."""
    if not share:
        return exc
    return NoFit(f"{exc.message}; a compute_share of {share}% also needs an MPS GPU whose live shares leave "
                 f"{share}% free (each GPU's shares sum to at most {MAX_COMPUTE_SHARE}; GET /v1/nodes shows them)",
                 code=exc.code)
