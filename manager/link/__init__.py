"""The manager's end of the agent link: the CURVE ROUTER socket (:mod:`.link`) and admission (joins
and node bindings).

May import the control plane (bindings live in the store) and :mod:`gpumgr.wire`; never the API or the service.
"""
