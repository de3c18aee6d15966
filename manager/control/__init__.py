"""The control plane's storage and leadership: the store (state directory or etcd), the small etcd
client, the election on an etcd lease, the control plane a manager asks (:mod:`.ha`) and where
``Idempotency-Key`` entries live.

May import the model (the queue's journal) and :mod:`gpumgr.wire`; never the API, the link or the service.
"""
