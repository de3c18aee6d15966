"""Tenants and what they may ask for: tokens and quotas (:mod:`.tenants`), the policy a request answers to
(:mod:`.policy`), and the tenant a runtime hook's grant counts against (:mod:`.hook_policy`).

May import :mod:`gpumgr.wire` only: the model, the service and the API all read it.
"""
