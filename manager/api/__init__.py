"""The REST API: the Flask app and its routes, the OpenAPI document, ``GET /v1/nodes``' cache, logs,
wait and kill, lookups by name, the dashboard (with its ``static/`` files) and metrics, and
``Idempotency-Key`` on creates.

May import the service layer (:mod:`gpumgr.manager.service` and its siblings), the control plane, the
link, the model and :mod:`gpumgr.wire`. Nothing below imports it.
"""
