"""``GET /v1/nodes`` for the operator: the map encoded once per node, a version, and the changes since one.

At 1,000 nodes × 8 GPUs the map is 1.6 MB of JSON; building and encoding it whole for every poll
took milliseconds under the GIL and gave a poller at 20 Hz a p99 of about 100 ms. Here each node's
part of the body is kept encoded, and only the nodes whose figures changed are rebuilt: the ledger
names them (:attr:`~gpumgr.manager.model.ledger.Ledger.touched`: a grant, a release, a node joining, going
down or leaving, a heartbeat with other figures). The whole body is those parts joined.

Every rebuild that changes something gives the map a new *version* (``"<boot>-<n>"``, where ``boot``
is this process's own: a version of another manager process is never taken for ours). A client that
sends ``?since=<version>`` gets only the nodes changed after it and the names of the nodes removed
(``"full": false``); when that version is not ours or too old to answer, the whole map with
``"full": true``, which replaces what the client holds. ``last_seen`` alone does not make a node
change (every node heartbeats every second): a node is listed again once its ``last_seen`` is
:data:`SEEN_STEP` to 1.5 × that older than the one last listed, so it lags by at most that much.

Each answer carries an ETag: ``If-None-Match`` with it gets a bodiless 304 while nothing changed. A
client accepting gzip gets the body compressed (2-10% of the bytes), once per copy. A request takes
only what the ledger named (usually a few nodes, often none); the ``last_seen`` moves, the whole
comparison and the gzip copy of the whole map are made ahead by a background thread that runs while
someone polls. The ledger's lock is held only to copy the changed nodes' figures into dicts;
encoding, joining and compressing run after it, never on the link's thread.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import Request, Response

from gpumgr.manager.model.views import node_view
from gpumgr.wire.errors import InvalidRequest

if TYPE_CHECKING:
    from gpumgr.manager.model.cluster import Cluster

#: Bodies smaller than this go uncompressed: gzip would save less than it costs.
GZIP_MIN = 1400
#: gzip's fastest level: on the whole map at 1,000 × 8 it takes 2.6 ms against level 5's 9.3 ms, for
#: 17% more bytes (37 KB against 32 KB); the map changes often, so each copy is compressed afresh
GZIP_LEVEL = 1
#: A node is listed again once its ``last_seen`` moved this far (to 1.5 × this, spread by its name).
SEEN_STEP = 2.0
#: Every node's figures are compared whole this often while someone polls (a change no one named).
SCAN_EVERY = 10.0
#: The background thread stops once nobody has asked for this many seconds.
IDLE_AFTER = 5.0
#: Removals remembered for ``since``; an older ``since`` than the oldest forgotten gets the full map.
REMOVED_KEPT = 10_000
#: Answers of other ``since`` versions kept for the current version (pollers mostly send the last one).
DELTAS_KEPT = 8
#: What a version looks like: this process's boot id, a dash and a count.
VERSION = re.compile(r"[0-9a-f]{8}-[0-9]{1,19}")


@dataclass
class Copy:
    """One answer's body: the map's version it shows, the changes since which version (None: whole), gzip."""

    version: int
    since: int | None
    body: bytes
    etag: str
    gzipped: bytes | None = None


@dataclass
class _Part:
    """One node's part of the body: encoded, the version it changed at, and the ``last_seen`` it shows."""

    encoded: bytes
    changed: int
    seen: float
    #: how far ``last_seen`` may move before the node is listed again (spread by its name)
    step: float = field(default=SEEN_STEP)


class NodesCache:
    """Serves the operator's view of the map of ``cluster``; see the module docstring."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._boot = os.urandom(4).hex()
        self._lock = threading.Lock()
        self._parts: dict[str, _Part] = {}
        self._order: list[str] = []
        self._removed: dict[str, int] = {}
        #: a ``since`` below this misses removals that were forgotten: it gets the full map
        self._floor = 0
        self._version = 0
        self._whole: Copy | None = None
        #: the parts were built once (the first answer builds them all)
        self._started = False
        self._whole_asked = 0.0
        self._deltas: dict[int, Copy] = {}
        self._checked = 0.0
        self._cursor = 0
        self._asked = 0.0
        self._gzip_wanted = False
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()

    # --- answers -------------------------------------------------------------------------------
    def response(self, request: Request) -> Response:
        """The map for ``request``: whole, or the changes since ``?since=``; 304 for its ETag; gzip if accepted."""
        since = self._since(request.args.get("since"))
        self._asked = time.monotonic()
        self._keep_fresh()
        copy = self.current(since)
        packed = request.accept_encodings["gzip"] > 0 and len(copy.body) >= GZIP_MIN
        # each encoding is its own representation, with its own strong ETag; either one names this copy
        etag = copy.etag + "-gzip" if packed else copy.etag
        if copy.etag in request.if_none_match or copy.etag + "-gzip" in request.if_none_match:
            reply = Response(status=304)
        elif packed:
            self._gzip_wanted = self._gzip_wanted or copy.since is None
            reply = Response(self._gzipped(copy), mimetype="application/json")
            reply.headers["Content-Encoding"] = "gzip"
        else:
            reply = Response(copy.body, mimetype="application/json")
        reply.set_etag(etag)
        reply.headers["Cache-Control"] = "no-cache"  # a browser revalidates with the ETag: a 304 while unchanged
        reply.vary.add("Accept-Encoding")
        return reply

    def version_token(self) -> str:
        """The map's version now, as an answer names it."""
        return self._token(self._version)

    def since_of(self, raw: str | None) -> int | None:
        """``?since=``'s version number if it is one of ours this cache can answer, else None (the whole map).

        Raises InvalidRequest when ``raw`` is not a version at all.
        """
        return self._since(raw)

    def current(self, since: int | None = None) -> Copy:
        """The answer for ``since`` (None: the whole map), the map's changes taken first."""
        self._refresh()
        with self._lock:
            if since is None or since < self._floor or since > self._version:
                self._whole_asked = time.monotonic()
                return self._whole_copy()
            copy = self._deltas.get(since)
            if copy is None:
                copy = self._delta(self._version, since)
                if len(self._deltas) >= DELTAS_KEPT:
                    self._deltas.pop(next(iter(self._deltas)))
                self._deltas[since] = copy
            return copy

    def _since(self, raw: str | None) -> int | None:
        if raw is None:
            return None
        if len(raw) > 28 or not VERSION.fullmatch(raw):
            shown = f", not {raw!r}" if len(raw) <= 28 else f" (at most 28 characters, got {len(raw)})"
            raise InvalidRequest(f"since must be a version from an earlier answer, like '0a1b2c3d-42'{shown}")
        boot, number = raw.split("-")
        return int(number) if boot == self._boot else None

    def _token(self, version: int) -> str:
        return f"{self._boot}-{version}"

    def _delta(self, version: int, since: int) -> Copy:
        changed = [self._parts[n].encoded for n in self._order if self._parts[n].changed > since]
        removed = [n for n, at in self._removed.items() if at > since]
        head = json.dumps({"version": self._token(version), "since": self._token(since), "full": False,
                           "removed": removed}, separators=(",", ":")).encode()
        body = head[:-1] + b',"nodes":[' + b",".join(changed) + b"]}"
        return Copy(version, since, body, f"{self._token(version)}.{since}")

    def _gzipped(self, copy: Copy) -> bytes:
        if copy.gzipped is None:
            copy.gzipped = gzip.compress(copy.body, GZIP_LEVEL, mtime=0)
        return copy.gzipped

    # --- keeping the parts -----------------------------------------------------------------------
    def _refresh(self, whole: bool = False) -> None:
        """Take the nodes the ledger named changed and re-encode their parts; a new version if any changed.

        ``whole`` (the background thread, every ``map_max_age``): also the nodes whose ``last_seen`` moved
        past their step, and a slice of all nodes compared whole, so that every node is compared at least
        every :data:`SCAN_EVERY` seconds while someone polls: a change no code path named still shows, late.
        """
        ledger = self.cluster.ledger
        if self._started and not ledger.touched and not whole:
            return
        with self._lock:
            now = time.monotonic()
            with ledger.lock:
                names = ledger.take_touched()
                nodes, parts = ledger.nodes, self._parts
                order = list(nodes)
                names.update(n for n in order if n not in parts)
                moved: dict[str, float] = {}
                if whole and order:
                    # a slice for the time since the last pass, a second's worth at most (after an idle spell
                    # the lock is not held for a whole map's views at once)
                    share = min(1.0, now - self._checked) / SCAN_EVERY
                    count = min(len(order), int(len(order) * share) + 1)
                    start = self._cursor % len(order)
                    names.update(order[start:start + count])
                    names.update(order[:max(0, start + count - len(order))])
                    self._cursor = start + count
                    # only last_seen moved (nothing named them): their parts get the new figure spliced in
                    moved = {n: node.last_seen for n, node in nodes.items() if n not in names
                             and (p := parts.get(n)) is not None and node.last_seen - p.seen >= p.step}
                views = {n: node_view(nodes[n]) for n in names if n in nodes}
            if whole:
                self._checked = now
            self._apply(views, moved, names - views.keys(), order)

    def _keep_fresh(self) -> None:
        """Start the background thread if it is not running."""
        with self._thread_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._while_asked, name="nodes-cache", daemon=True)
                self._thread.start()

    def _while_asked(self) -> None:
        """While someone polls: the ``last_seen`` moves and the whole comparison, and the gzip copy made ahead."""
        while time.monotonic() - self._asked < IDLE_AFTER:
            if time.monotonic() - self._checked >= self.cluster.map_max_age:
                self._refresh(whole=True)
            if time.monotonic() - self._whole_asked < IDLE_AFTER:  # whole answers are asked for: make it ahead
                with self._lock:
                    copy = self._whole_copy()
                if self._gzip_wanted:
                    self._gzipped(copy)
            time.sleep(max(0.01, min(0.1, self.cluster.map_max_age / 4)))

    def _apply(self, views: dict[str, dict[str, Any]], moved: dict[str, float], gone: set[str],
               order: list[str]) -> None:
        """Re-encode the parts of ``views`` that changed, give ``moved`` their new ``last_seen``, forget ``gone``.

        A new version if anything changed. A view that differs from its part only by a ``last_seen``
        within its step is no change.
        """
        version = self._version + 1
        changed = False
        for name, view in views.items():
            encoded, seen, part = _encode(view), view["last_seen"], self._parts.get(name)
            if part is not None and seen - part.seen < part.step and _with_seen(part.encoded, seen) == encoded:
                continue
            changed = True
            step = SEEN_STEP * (1 + (zlib.crc32(name.encode()) % 512) / 1024)
            self._parts[name] = _Part(encoded, version, seen, step)
            self._removed.pop(name, None)
        for name, seen in moved.items():
            part = self._parts[name]
            self._parts[name] = _Part(_with_seen(part.encoded, seen), version, seen, part.step)
            changed = True
        for name in gone:
            if self._parts.pop(name, None) is not None:
                changed = True
                self._removed[name] = version
        while len(self._removed) > REMOVED_KEPT:
            oldest = next(iter(self._removed))
            self._floor = max(self._floor, self._removed.pop(oldest))
        if not changed and self._started:
            return
        self._version, self._order, self._started = version, order, True
        self._whole, self._deltas = None, {}

    def _whole_copy(self) -> Copy:
        """The whole map at the current version, joined from the parts once per version. Call under ``_lock``."""
        if self._whole is None or self._whole.version != self._version:
            head = json.dumps({"version": self._token(self._version), "full": True, "removed": []},
                              separators=(",", ":")).encode()
            body = head[:-1] + b',"nodes":[' + b",".join(self._parts[n].encoded for n in self._order) + b"]}"
            self._whole = Copy(self._version, None, body, self._token(self._version))
        return self._whole


def _encode(view: dict[str, Any]) -> bytes:
    return json.dumps(view, separators=(",", ":")).encode()


_SEEN, _RUNTIME = b',"last_seen":', b',"runtime":'


def _with_seen(encoded: bytes, seen: float) -> bytes:
    """A node's encoded part with ``last_seen`` replaced (in JSON a key's quotes never occur inside a string)."""
    start = encoded.index(_SEEN) + len(_SEEN)
    return encoded[:start] + json.dumps(seen).encode() + encoded[encoded.index(_RUNTIME, start):]
