"""``GET /v1/nodes`` for the operator: one encoded map shared by every poller, with an ETag and a gzip copy.

At 1,000 nodes × 8 GPUs the map is 1.6 MB of JSON and takes milliseconds to build and encode. Built
on the request path every time the previous copy aged out, it gave a poller at 20 Hz a p99 of over
100 ms. Here a background thread rebuilds the copy before it ages out while someone polls, so a
request usually finds a fresh one; a grant or a node changing (the map's version) still makes the
next request see the change at once. The thread rebuilds only for pollers that asked since its last
build, so a burst of placements does not make it rebuild at every grant. Each copy carries an
ETag: a client sending it back in ``If-None-Match`` gets a bodiless 304 while the map has not
changed. A client accepting gzip gets the copy compressed (2-10% of the bytes), once per copy.
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flask import Request, Response

if TYPE_CHECKING:
    from gpumgr.manager.cluster import Cluster

#: A copy is rebuilt in the background once it is this share of ``map_max_age`` old.
REBUILD_AT = 0.6
#: The background thread stops once nobody has asked for this many seconds.
IDLE_AFTER = 5.0
#: Bodies smaller than this go uncompressed: gzip would save less than it costs.
GZIP_MIN = 1400
GZIP_LEVEL = 5


@dataclass
class Copy:
    """One encoded map: the version it was built at, when, its body, ETag and gzip copy (made on demand)."""

    version: int
    built: float
    body: bytes
    etag: str
    gzipped: bytes | None = None


class NodesCache:
    """Serves the operator's view of the map of ``cluster``; see the module docstring."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._copy: Copy | None = None
        self._build_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._asked = 0.0
        #: a request came since the last build: only then is a rebuild worth its cost
        self._wanted = False
        self._gzip_wanted = False
        self._count = 0
        self._boot = os.urandom(4).hex()  # ETags of another manager process never match ours

    def response(self, request: Request) -> Response:
        """The map for ``request``: 304 if it holds the current ETag, else the body (gzipped if accepted)."""
        self._asked, self._wanted = time.monotonic(), True
        self._keep_fresh()
        copy = self.current()
        if copy.etag in request.if_none_match:
            reply = Response(status=304)
        elif request.accept_encodings["gzip"] > 0 and len(copy.body) >= GZIP_MIN:
            self._gzip_wanted = True
            reply = Response(self._gzipped(copy), mimetype="application/json")
            reply.headers["Content-Encoding"] = "gzip"
        else:
            reply = Response(copy.body, mimetype="application/json")
        reply.set_etag(copy.etag)
        reply.headers["Cache-Control"] = "no-cache"  # a browser revalidates with the ETag: a 304 while unchanged
        reply.vary.add("Accept-Encoding")
        return reply

    def current(self) -> Copy:
        """A copy of the map no older than ``map_max_age`` and of the map's current version."""
        copy = self._copy
        if copy is not None and self._fresh(copy, 1.0):
            return copy
        with self._build_lock:
            copy = self._copy
            if copy is not None and self._fresh(copy, 1.0):
                return copy  # another request built it while this one waited
            return self._build()

    def _fresh(self, copy: Copy, share: float) -> bool:
        return copy.version == self.cluster.ledger.version and \
            time.monotonic() - copy.built < self.cluster.map_max_age * share

    def _build(self) -> Copy:
        self._wanted = False
        version = self.cluster.ledger.version  # read first: a change during the build makes the copy stale at once
        view = self.cluster.nodes_view()
        self._count += 1
        body = json.dumps({"nodes": view}, separators=(",", ":")).encode()
        self._copy = Copy(version, time.monotonic(), body, f"{self._boot}-{self._count}")
        return self._copy

    def _gzipped(self, copy: Copy) -> bytes:
        if copy.gzipped is None:
            copy.gzipped = gzip.compress(copy.body, GZIP_LEVEL, mtime=0)
        return copy.gzipped

    def _keep_fresh(self) -> None:
        """Start the background rebuilder if it is not running."""
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._rebuild_while_asked, name="nodes-cache", daemon=True)
                self._thread.start()

    def _rebuild_while_asked(self) -> None:
        while time.monotonic() - self._asked < IDLE_AFTER:
            copy = self._copy
            # only for a poller that came since the last build: while grants change many times a
            # second, rebuilding at each change would cost a core for copies nobody reads
            if self._wanted and (copy is None or not self._fresh(copy, REBUILD_AT)):
                with self._build_lock:
                    copy = self._build()
                if self._gzip_wanted:
                    self._gzipped(copy)
            time.sleep(self.cluster.map_max_age * (1 - REBUILD_AT) / 4)
