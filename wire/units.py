"""Byte sizes as people write them (``512MiB``, ``8GiB``, ``8G``) turned into integers and back."""

from __future__ import annotations

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
