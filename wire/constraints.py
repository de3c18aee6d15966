"""Placement constraints in Swarm's syntax: where a request may run, by node and by GPU.

A constraint is ``ATTRIBUTE OP VALUE`` with ``OP`` one of ``==`` and ``!=`` (as Swarm has them) or
``>=`` and ``<=`` (numbers and sizes only). Attributes:

- ``node.name`` (alias ``node.hostname``) and ``node.labels.KEY``: the agent's node name and the
  labels its operator gave it (``labels:`` in its YAML, ``--label k=v``);
- ``gpu.model`` (NVML's name, e.g. ``NVIDIA H100 80GB HBM3``), ``gpu.uuid``;
- ``gpu.index``, ``gpu.memory`` (total; a size such as ``40GiB``), ``gpu.compute_capability`` (``8.0``);
- ``gpu.mps`` (``true`` or ``false``, with ``==`` or ``!=``): whether its node runs MPS (the agent's ``mps``).

Text values compare without regard to case, as Swarm compares them, and may be globs (``*H100*``).
A label the node lacks matches ``!=`` and nothing else (Swarm's rule); so does a compute
capability the GPU source could not tell. Parsing happens once, at the edge (a 400 names the bad
constraint); the scheduler only calls :meth:`Constraints.allows` on the GPUs it considers.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

from gpumgr.wire.units import parse_bytes

#: Longest checked first, so ``>=`` is not read as ``>`` followed by ``=``.
OPERATORS = ("==", "!=", ">=", "<=")
NODE_NAME, NODE_LABELS = "node.name", "node.labels."
GPU_MODEL, GPU_UUID, GPU_INDEX, GPU_MEMORY, GPU_CC = ("gpu.model", "gpu.uuid", "gpu.index", "gpu.memory",
                                                     "gpu.compute_capability")
GPU_MPS = "gpu.mps"
#: ``gpu.mps``'s values, as the comparable tuples its constraint holds
FLAGS = {"true": (1,), "false": (0,)}
ALIASES = {"node.hostname": NODE_NAME}
TEXT_ATTRS = frozenset({NODE_NAME, GPU_MODEL, GPU_UUID})
NUMBER_ATTRS = frozenset({GPU_INDEX, GPU_MEMORY, GPU_CC})
#: What one request may carry: enough for any real use, small enough to check per GPU in microseconds.
MAX_CONSTRAINTS = 32
MAX_CONSTRAINT_CHARS = 512
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
_VERSION = re.compile(r"^[0-9]{1,4}(\.[0-9]{1,4}){0,2}$")


class ConstraintTarget(Protocol):
    """What a constraint reads of a GPU and its node (the scheduler's slot has it all)."""

    node: str
    uuid: str
    index: int
    total: int
    name: str
    compute_capability: str
    #: its node runs MPS
    mps: bool

    @property
    def labels(self) -> Mapping[str, str]:
        """Its node's labels."""
        ...


class Constraint(NamedTuple):
    """One parsed constraint; ``text`` is as written.

    A named tuple, not a dataclass: immutable and hashable all the same, and ``dataclasses`` (with the
    ``inspect`` it imports) is most of ``docker gpu``'s import time that this module would add.
    """

    text: str
    attr: str
    op: str
    #: text attributes: the compiled case-insensitive glob
    pattern: re.Pattern[str] | None = None
    #: number attributes: the value as a comparable tuple (bytes, an index, or a version's parts)
    number: tuple[int, ...] = ()
    #: ``node.labels.KEY``: the key
    key: str = ""

    def allows(self, gpu: ConstraintTarget) -> bool:
        """Whether ``gpu`` (and its node) satisfies this constraint."""
        if self.pattern is not None:
            text = self._text_of(gpu)
            if text is None:
                return self.op == "!="
            return bool(self.pattern.fullmatch(text.lower())) == (self.op == "==")
        have = self._number_of(gpu)
        if have is None:
            return self.op == "!="
        if self.op == "==":
            return have == self.number
        if self.op == "!=":
            return have != self.number
        return have >= self.number if self.op == ">=" else have <= self.number

    def _text_of(self, gpu: ConstraintTarget) -> str | None:
        if self.key:
            return gpu.labels.get(self.key)
        return {NODE_NAME: gpu.node, GPU_MODEL: gpu.name, GPU_UUID: gpu.uuid}[self.attr]

    def _number_of(self, gpu: ConstraintTarget) -> tuple[int, ...] | None:
        if self.attr == GPU_INDEX:
            return (gpu.index,)
        if self.attr == GPU_MEMORY:
            return (gpu.total,)
        if self.attr == GPU_MPS:
            return (1,) if gpu.mps else (0,)
        return version(gpu.compute_capability)


class Constraints(NamedTuple):
    """A request's constraints, all of which must hold; empty allows everything."""

    items: tuple[Constraint, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def texts(self) -> tuple[str, ...]:
        """The constraints as written."""
        return tuple(c.text for c in self.items)

    def allows(self, gpu: ConstraintTarget) -> bool:
        """Whether ``gpu`` satisfies every constraint."""
        return all(c.allows(gpu) for c in self.items)

    @property
    def about_gpus(self) -> bool:
        """Whether any constraint reads a GPU attribute (not only its node's)."""
        return any(c.attr.startswith("gpu.") for c in self.items)


NO_CONSTRAINTS = Constraints()


def version(text: str) -> tuple[int, ...] | None:
    """``"8.6"`` as ``(8, 6, 0)`` (``"9"`` as ``(9, 0, 0)``); None for an empty or unreadable one."""
    text = text.strip()
    if not _VERSION.match(text):
        return None
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def parse(text: object) -> Constraint:
    """One constraint from its text; ``ValueError`` saying what is wrong and quoting it."""
    if not isinstance(text, str):
        raise ValueError(f"a constraint must be a string such as 'gpu.model==*H100*', not {type(text).__name__}")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"a constraint may be at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
    for op in OPERATORS:
        attr, found, value = text.partition(op)
        if found:
            break
    else:
        raise ValueError(f"constraint {text!r} has no operator: write ATTRIBUTE==VALUE (or !=, >=, <=)")
    written, value = attr.strip(), value.strip()
    attr = ALIASES.get(written.lower(), written.lower())
    if not value:
        raise ValueError(f"constraint {text!r} has no value after {op!r}")
    if attr.startswith(NODE_LABELS):
        key = written[len(NODE_LABELS):]  # label keys keep their case, as Swarm's do
        if not _LABEL_KEY.match(key):
            raise ValueError(f"constraint {text!r}: {key!r} is not a label key (letters, digits, '.', '_', '/', '-')")
        return _text_constraint(text, NODE_LABELS.rstrip("."), op, value, key)
    if attr in TEXT_ATTRS:
        return _text_constraint(text, attr, op, value)
    if attr in NUMBER_ATTRS:
        return Constraint(text, attr, op, number=_number(text, attr, value))
    if attr == GPU_MPS:
        if op not in ("==", "!=") or value.lower() not in FLAGS:
            raise ValueError(f"constraint {text!r}: {GPU_MPS} takes == or != and true or false")
        return Constraint(text, attr, op, number=FLAGS[value.lower()])
    known = ", ".join(sorted({NODE_NAME, "node.labels.KEY", GPU_MPS, *TEXT_ATTRS, *NUMBER_ATTRS}))
    raise ValueError(f"constraint {text!r}: unknown attribute {attr!r}; known: {known}")


def parse_all(texts: Iterable[object]) -> Constraints:
    """Every constraint of a request; ``ValueError`` naming the first that cannot be read."""
    items = list(texts)
    if len(items) > MAX_CONSTRAINTS:
        raise ValueError(f"at most {MAX_CONSTRAINTS} constraints, got {len(items)}")
    return Constraints(tuple(parse(t) for t in items))


@functools.lru_cache(maxsize=1024)
def compiled(texts: tuple[str, ...]) -> Constraints:
    """``parse_all`` of texts already validated at the edge, cached: queued requests are placed many times."""
    return parse_all(texts)


def _text_constraint(text: str, attr: str, op: str, value: str, key: str = "") -> Constraint:
    if op not in ("==", "!="):
        raise ValueError(f"constraint {text!r}: {op} compares numbers and sizes; {attr} takes == or !=")
    return Constraint(text, attr, op, pattern=re.compile(fnmatch.translate(value.lower())), key=key)


def _number(text: str, attr: str, value: str) -> tuple[int, ...]:
    if attr == GPU_CC:
        parts = version(value)
        if parts is None:
            raise ValueError(f"constraint {text!r}: a compute capability is written like 8.0 or 9.0")
        return parts
    if attr == GPU_INDEX:
        if not (value.isascii() and value.isdigit()) or len(value) > 4:
            raise ValueError(f"constraint {text!r}: a GPU index is a whole number such as 0")
        return (int(value),)
    try:
        return (parse_bytes(value),)
    except ValueError as exc:
        raise ValueError(f"constraint {text!r}: {exc}") from None
