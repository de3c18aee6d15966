"""Byte sizes as people write them (``512MiB``, ``8GiB``, ``8G``) turned into integers and back.

Two readings, because two conventions meet here: :func:`parse_bytes` reads gpumgr's own sizes (``gpu_memory``:
``G`` is 10⁹, ``GiB`` is 2³⁰), and :func:`parse_docker_bytes` reads the sizes gpumgr takes from ``docker run``
(``--shm-size``, ``-m``) exactly as the Docker CLI reads them, where ``k``, ``m`` and ``g`` are powers of 1024.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

#: The largest size accepted: what a signed 64-bit integer holds (msgpack, JSON clients, Docker all take it).
MAX_BYTES = 2**63 - 1
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}
#: Docker's multipliers (go-units' ``binaryMap``): every letter is a power of 1024, ``kb`` and ``kib`` alike.
_DOCKER_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "p": 1024**5}
# The numbers Go's strconv.ParseFloat takes (the Docker CLI's reading), decimal or hexadecimal with a 'p' exponent;
# '_' only between digits (or after 0x), as Go allows. Python's float() then checks the decimal ones' underscores.
_GO_DECIMAL = re.compile(r"[+-]?[0-9_]*\.?[0-9_]*(?:[eE][+-]?[0-9_]+)?", re.ASCII)
_GO_HEX = re.compile(r"([+-]?)0[xX]((?:_?[0-9a-fA-F])*)(?:\.((?:[0-9a-fA-F](?:_?[0-9a-fA-F])*)?))?"
                     r"[pP]([+-]?[0-9](?:_?[0-9])*)", re.ASCII)
# ASCII only: ``\d`` and ``str.isdigit`` take any script's digits (``１``, ``²``, ``①``), which nothing else reads.
_SIZE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]{0,3})\s*", re.ASCII)


def parse_bytes(value: object) -> int:
    """Return ``value`` in bytes: an int, or a string with an optional unit.

    Decimal units (``G``, ``GB``) are powers of 1000 and binary ones (``GiB``) powers of 1024,
    as Docker and Kubernetes read them; digits are ASCII only and the value is read exactly (no
    float rounding). Raises ``ValueError`` for anything that is not a whole, positive number of
    bytes up to ``MAX_BYTES``, so callers can turn it into a 400.
    """
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string such as '8GiB', not a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value) if len(value) <= 128 else None
        unit = match.group(3).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read {_short(value)} as a size; write bytes or e.g. '512MiB', '8GiB', '8G'")
        whole, fraction = match.group(1), match.group(2) or ""
        number = Fraction(int(whole + fraction), 10 ** len(fraction)) * _UNITS[unit]
        if number.denominator != 1:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        size = int(number)
    else:
        raise ValueError(f"a size must be an integer or a string, not {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"a size must be positive, got {_short(value)}")
    if size > MAX_BYTES:
        raise ValueError(f"a size must be at most {MAX_BYTES} bytes (2**63 - 1), got {_short(value)}")
    return size


def parse_docker_bytes(value: object) -> int:
    """Return ``value`` in bytes as ``docker run --shm-size`` and ``--memory`` read it; 0 means the engine's default.

    A port of go-units' ``RAMInBytes``, which the Docker CLI uses for both flags: a number as Go's ``ParseFloat``
    reads it (``1.5``, ``.5``, ``1e3``), then optionally one space, then a case-free suffix ``b``, or one of
    ``k m g t p`` (powers of 1024) alone or followed by ``b`` or ``ib``; the product is truncated to whole bytes
    (``0.3m`` is 314572). An int is bytes. Raises ``ValueError`` for what the Docker CLI refuses, for a negative
    size, and for anything over ``MAX_BYTES``, so callers can turn it into a 400.
    """
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string such as '1g', not a boolean")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        size = _docker_size(value) if len(value) <= 128 else -1
        if size < 0:
            raise ValueError(f"cannot read {_short(value)} as a size as docker run does; write bytes or e.g. '512m', "
                             "'1g' (k, m, g: powers of 1024)")
    else:
        raise ValueError(f"a size must be an integer or a string, not {type(value).__name__}")
    if size < 0:
        raise ValueError(f"a size must not be negative, got {_short(value)}")
    if size > MAX_BYTES:
        raise ValueError(f"a size must be at most {MAX_BYTES} bytes (2**63 - 1), got {_short(value)}")
    return size


def _docker_size(text: str) -> int:
    """go-units' ``parseSize`` with the binary map; -1 where it returns an error."""
    cut = max(text.rfind(c) for c in "0123456789. ")
    if cut < 0:
        return -1
    number, suffix = (text[:cut], text[cut + 1:]) if text[cut] == " " else (text[:cut + 1], text[cut + 1:])
    size = _go_float(number)
    suffix = suffix.lower()
    if size is None or size < 0 or len(suffix) > 3:
        return -1
    if suffix[:1] in _DOCKER_UNITS and suffix[1:] in ("", "b", "ib"):
        size *= _DOCKER_UNITS[suffix[0]]
    elif suffix not in ("", "b"):
        return -1
    return int(size) if size <= MAX_BYTES else MAX_BYTES + 1


def _go_float(text: str) -> float | None:
    """``text`` as Go's ``strconv.ParseFloat(text, 64)`` reads it, or None where Go refuses it (out of range too)."""
    hexadecimal = _GO_HEX.fullmatch(text)
    try:
        if hexadecimal and (hexadecimal[2] or hexadecimal[3]):
            sign, whole, fraction, exponent = hexadecimal.groups()
            number = float.fromhex(f"{sign}0x{whole.replace('_', '') or '0'}.{(fraction or '').replace('_', '')}"
                                   f"p{exponent.replace('_', '')}")
        elif _GO_DECIMAL.fullmatch(text) and re.search("[0-9]", text):
            number = float(text)
        else:
            return None
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _short(value: object) -> str:
    """``value``'s repr, cut so that an error message never echoes a huge input."""
    text = repr(value)
    return text if len(text) <= 64 else f"{text[:48]}... ({len(text)} characters)"


def format_bytes(size: int) -> str:
    """Return ``size`` in the largest binary unit that keeps it readable, e.g. ``'7.5GiB'``."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(size) >= factor:
            return f"{size / factor:.4g}{unit}"
    return f"{size}B"
