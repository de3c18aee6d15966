"""Reference server for bench/nodes_map.py: a hello-world Flask app on waitress, threaded like the manager.

    python bench/hello_waitress.py --port PORT [--threads 16] [--json-bytes N]

``GET /`` answers ``hello world``; ``GET /json`` answers a JSON list padded to about ``--json-bytes``
(serialized on every request, like the manager's views); ``GET /cached`` answers the same JSON
serialized once at start (the ceiling for a cached body of that size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys

from flask import Flask, Response, jsonify
from waitress import create_server


def build(json_bytes: int) -> Flask:
    app = Flask("hello")
    gpu = {"uuid": "GPU-node-000-0", "index": 0, "name": "Fake", "memory_total": 25769803776, "memory_used": 0,
           "memory_reserved": 0, "memory_unmanaged": 0, "memory_free": 25769803776, "containers": []}
    items = max(1, json_bytes // 190)

    @app.get("/")
    def hello() -> str:
        return "hello world"

    @app.get("/json")
    def payload():
        return jsonify({"items": [dict(gpu, index=i) for i in range(items)]})

    cached = json.dumps({"items": [dict(gpu, index=i) for i in range(items)]}, separators=(",", ":")).encode()

    @app.get("/cached")
    def cached_payload() -> Response:
        return Response(cached, mimetype="application/json")

    return app


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--json-bytes", type=int, default=150_000)
    args = parser.parse_args()
    server = create_server(build(args.json_bytes), host="127.0.0.1", port=args.port, threads=args.threads)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    print(f"hello on http://127.0.0.1:{server.effective_port} with {args.threads} threads", flush=True)
    with contextlib.suppress(OSError):  # closing the socket from the signal handler ends run() this way
        server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
