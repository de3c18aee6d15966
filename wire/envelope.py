"""The wire framing under :mod:`wire.protocol`: one bounded msgpack map ``{v, type, id, reply_to, body[, epoch]}``.

Kept free of validation libraries so that short-lived processes (the OCI runtime hook, started for
every GPU container) can speak the protocol without paying for importing them.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

import msgpack

from gpumgr.wire import defaults
from gpumgr.wire.errors import ProtocolError

VERSION = 1
MAX_FIELD = defaults.MAX_FIELD_BYTES
MAX_ITEMS = defaults.MAX_ITEMS
#: Frames up to this size are within every per-field bound by their size alone (each item is >= 1 byte).
_FIELD_BOUNDS_FROM = min(MAX_FIELD, MAX_ITEMS)
#: On plain stream sockets (the runtime hook's) each frame is preceded by its length.
FRAME_HEADER = struct.Struct(">I")


def new_id() -> str:
    """A fresh message id: unique enough to tie a reply to its request across restarts."""
    return uuid.uuid4().hex


def pack(kind: str, body: dict[str, Any], *, msg_id: str | None = None, reply_to: str | None = None,
         epoch: list[int] | None = None) -> bytes:
    """One frame; raises ProtocolError if it is over a bound that :func:`unpack` enforces on the other side.

    ``epoch`` (a leader's :class:`~gpumgr.wire.epoch.Epoch` in wire form) is added only when given, so a
    single manager's frames are what they always were and a peer that predates epochs reads them.
    """
    header: dict[str, Any] = {"v": VERSION, "type": kind, "id": msg_id or new_id(), "reply_to": reply_to,
                              "body": body}
    if epoch is not None:
        header["epoch"] = epoch
    try:
        frame: bytes = msgpack.packb(header, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. an integer msgpack cannot carry
        raise ProtocolError(f"{kind} message cannot be encoded: {exc}") from exc
    if len(frame) > defaults.MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{kind} message of {len(frame)} bytes is over the {defaults.MAX_MESSAGE_BYTES} bound")
    if len(frame) > _FIELD_BOUNDS_FROM:
        # what we send must be what every receiver accepts: the same bounds, checked by the same decoder.
        # A smaller frame cannot hold a string over MAX_FIELD bytes or a container over MAX_ITEMS items.
        try:
            unpack(frame)
        except ProtocolError as exc:
            raise ProtocolError(f"{kind} message would be refused by its receiver: {exc}") from exc
    return frame


def unpack(frame: bytes) -> Any:
    """The raw map of one frame (not yet validated); raises ProtocolError for oversized or undecodable input."""
    if len(frame) > defaults.MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {defaults.MAX_MESSAGE_BYTES} bound")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=MAX_FIELD,
                               max_str_len=MAX_FIELD, max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable frame: {exc}") from exc


def frame(data: bytes) -> bytes:
    """``data`` preceded by its length, for a stream socket (ZeroMQ sockets keep message bounds themselves)."""
    return FRAME_HEADER.pack(len(data)) + data
