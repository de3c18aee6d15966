"""Gangs: one job of several members placed all or none, handed its rendezvous, and ended as one.

``spec`` holds what a gang is (its request, its record, its members' environment); ``core`` the
:class:`Gangs` on the map (placing, ending, each dispatch, reads); ``waiting`` what a waiting gang does
(its journal entry, its reservation, its preemption, its account's and tenant's room).
"""

from gpumgr.manager.model.gangs.core import Gangs as Gangs
from gpumgr.manager.model.gangs.spec import GANG_ENDED as GANG_ENDED
from gpumgr.manager.model.gangs.spec import LABEL as LABEL
from gpumgr.manager.model.gangs.spec import RESERVED_ENV as RESERVED_ENV
from gpumgr.manager.model.gangs.spec import Gang as Gang
from gpumgr.manager.model.gangs.spec import GangSpec as GangSpec
from gpumgr.manager.model.gangs.spec import gang_env as gang_env
