"""Decode a JSON request body the way the Docker engine's Go ``encoding/json`` does.

The engine decodes ``POST /containers/create`` and its kin into Go structs, and Go differs from a
plain ``json.loads`` in three ways an attacker can use to hide a field from a checker:

- a struct field matches its key exactly or, failing that, case-insensitively under Unicode simple
  folding: ``"privileged"``, ``"PRIVILEGED"`` and ``"Bindſ"`` (long s) all fill their field;
- a key given twice, in any spelling, decodes into the *same* field again: a nested struct or map is
  merged (``"HostConfig": {...}, "hostconfig": {...}`` fills one HostConfig from both), an array is
  decoded element by element into the elements already there, and a scalar is replaced;
- ``null`` clears a pointer, slice or map, and leaves a bool, number or string as it was.

Keys of a map (``Labels``) are exact and the last one wins, as in Go. :func:`decode` turns a body into
plain dicts and lists under each field's canonical name, after those rules, so a checker reads one
field once. A body that is not exactly one JSON value, or whose value has the wrong type where a
schema expects a struct, list or map, raises :class:`BodyError`: the guard then refuses the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any


class BodyError(ValueError):
    """The body cannot be decoded as the engine would; the message says why."""


@dataclass(frozen=True)
class Scalar:
    """A bool, number or string: replaced by a new value, untouched by ``null``."""

    kind: type | tuple[type, ...] = object


@dataclass(frozen=True)
class Struct:
    """A Go struct (or pointer to one): keys fold onto ``fields``; unknown keys are ignored."""

    fields: dict[str, Any] = field(default_factory=dict)
    #: the struct is reached through a pointer, so ``null`` clears it (embedded values are not)
    pointer: bool = True


@dataclass(frozen=True)
class Slice:
    """A Go slice of ``item``."""

    item: Any
    #: a lone string is a slice of one and a repeated key replaces the whole (Go's ``strslice.StrSlice``)
    lone: bool = False


@dataclass(frozen=True)
class Map:
    """A Go map from string to ``value``: exact keys, merged into the map already there."""

    value: Any


#: No field name is longer; a longer key is no field (and is not folded, however long it is).
MAX_KEY = 64
BOOL = Scalar(bool)
STR = Scalar(str)
ANY = Scalar()


@lru_cache(maxsize=4096)
def fold(name: str) -> str:
    """``name`` under Go's simple case folding (what ``bytes.EqualFold`` compares)."""
    return name.upper() if name.isascii() else "".join(_fold_char(char) for char in name)


@lru_cache(maxsize=4096)
def _fold_char(char: str) -> str:
    if char.isascii():
        return char.upper()
    folded = char.casefold()
    # only single-rune foldings are simple ones (ß → ss is a full folding, which Go does not apply), and
    # only the long s and the Kelvin sign fold onto ASCII letters (a dotless ı does not: its upper case
    # is I, but it is no case variant of i)
    return folded.upper() if len(folded) == 1 and folded.isascii() else folded if len(folded) == 1 else char


def parse(raw: bytes) -> Any:
    """The one JSON value in ``raw``, objects kept as ``(key, value)`` pairs in order; BodyError otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"the body is not UTF-8: {exc}") from None
    try:
        return json.loads(text, object_pairs_hook=_Pairs, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise BodyError(f"the body is not one JSON value: {exc}") from None


def decode(raw: bytes, schema: Struct) -> dict[str, Any]:
    """Decode ``raw`` into ``schema`` as the engine does; a body of ``null`` gives an empty struct."""
    value = parse(raw)
    if value is None:
        return {}
    result = into(None, value, schema)
    return result if isinstance(result, dict) else {}


def into(current: Any, value: Any, schema: Any) -> Any:
    """Decode ``value`` into ``current`` (what the field holds already) as Go does for ``schema``."""
    if value is None:
        return current if isinstance(schema, Scalar) or (isinstance(schema, Struct) and not schema.pointer) \
            else None
    if isinstance(schema, Struct):
        return _struct(current if isinstance(current, dict) else {}, value, schema)
    if isinstance(schema, Map):
        return _map(current if isinstance(current, dict) else {}, value, schema)
    if isinstance(schema, Slice):
        return _slice(current if isinstance(current, list) else [], value, schema)
    if isinstance(value, (_Pairs, list)) or not isinstance(value, schema.kind):
        raise BodyError(f"a value of the wrong type: {_kind(value)}")
    return value


def _struct(current: dict[str, Any], value: Any, schema: Struct) -> dict[str, Any]:
    if not isinstance(value, _Pairs):
        raise BodyError(f"an object was expected, not {_kind(value)}")
    fields = schema.fields
    names = _names(schema)
    for key, item in value:
        name = key if key in fields else names.get(fold(key)) if len(key) <= MAX_KEY else None
        if name is not None:
            current[name] = into(current.get(name), item, schema.fields[name])
    return current


def _map(current: dict[str, Any], value: Any, schema: Map) -> dict[str, Any]:
    if not isinstance(value, _Pairs):
        raise BodyError(f"an object was expected, not {_kind(value)}")
    for key, item in value:
        current[key] = into(None, item, schema.value)  # Go decodes each map value into a fresh one
    return current


def _slice(current: list[Any], value: Any, schema: Slice) -> list[Any]:
    if schema.lone:
        return [into(None, value, schema.item)] if isinstance(value, str) else _slice([], value, Slice(schema.item))
    if not isinstance(value, list) or isinstance(value, _Pairs):
        raise BodyError(f"an array was expected, not {_kind(value)}")
    # Go decodes element i into the element already at i (a struct keeps the fields the new one omits)
    return [into(current[i] if i < len(current) else None, item, schema.item) for i, item in enumerate(value)]


@lru_cache(maxsize=64)
def _names_cached(fields: tuple[str, ...]) -> dict[str, str]:
    names: dict[str, str] = {}
    for name in fields:
        names.setdefault(fold(name), name)  # Go takes the first field (in order) that folds to the key
    return names


def _names(schema: Struct) -> dict[str, str]:
    return _names_cached(tuple(schema.fields))


def _kind(value: Any) -> str:
    if isinstance(value, _Pairs):
        return "an object"
    return {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as its ``(key, value)`` pairs, duplicates and order kept."""
