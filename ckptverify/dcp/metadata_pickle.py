"""Unpickling DCP metadata without executing anything: per-parse stand-ins, a budget, a plain tree out.

A configuration of :mod:`ckptverify.safeparse.unpickler`. The allowlist (DCP dataclasses, ``torch.Size``, dtypes,
layouts, two enums, paths) resolves to stand-ins made afresh per parse (but the dtypes, which nothing can change),
so a hostile pickle cannot change what a later parse uses. Stand-ins fail where the real objects would, at the
same moment, so an accepted pickle is one real unpickling would accept. The result is a plain tree, built under a
budget (``BUDGET_PER_BYTE * len(data) + BUDGET_BASE``: a "billion laughs" is refused in linear time); hashed tuples
are bounded (``MAX_DEPTH``, ``MAX_KEY_NODES``: ``hash`` recurses in C without limit) and stand-ins refuse growing
tuples.

The C unpickler reads only pickles :func:`~ckptverify.safeparse.pickle_subset.in_fast_subset` admits; any other,
or any it fails on, goes to the pure-Python reference, whose outcome is the answer (a C refusal stands: it is
what DCP meets). Tests check both agree on real, mutated and generated pickles.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from ckptverify.errors import BadPickle, UnsafeGlobal
from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE
from ckptverify.safeparse.gcpause import paused_gc
from ckptverify.safeparse.pickle_subset import in_fast_subset
from ckptverify.safeparse.unpickler import (
    DTYPE_GLOBALS,
    Budget,
    DTypeGlobal,
    FastUnpickler,
    FrozenGlobal,
    Limits,
    ReferenceUnpickler,
    callable_global,
    refuse_build,
    refusing,
)

#: Charges per byte, and in addition: real metadata needs about one node per two bytes, a wide margin.
BUDGET_PER_BYTE = 4
BUDGET_BASE = 100_000
#: Deepest nesting of the plain tree and of a hashed tuple (DCP ~8, Megatron ~12).
MAX_DEPTH = 64
#: Most values a hashed tuple (a dict key, a set member, a dataclass's hashed field) may expand to.
MAX_KEY_NODES = 1024
#: Most dimensions of a ``torch.Size`` and parts of a path.
MAX_DIMS = 64
MAX_PATH_PARTS = 256
LIMITS = Limits(work_per_byte=BUDGET_PER_BYTE, work_base=BUDGET_BASE, max_depth=MAX_DEPTH,
                max_key_nodes=MAX_KEY_NODES, memo_slack=0)

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_PL = "torch.distributed.checkpoint.planner"
_MCORE = "megatron.core.dist_checkpointing.strategies.torch"


@dataclass(frozen=True)
class Kind:
    """An allowlisted dataclass: where it lives, its fields, and how real unpickling treats it."""

    module: str
    name: str
    fields: tuple[str, ...]
    #: Fields that take part in ``hash()`` of a frozen dataclass (``None``: unhashable, like ``@dataclass``).
    hash_fields: tuple[str, ...] | None = None
    #: Defaults of fields that have one (a frozen dataclass hashes its defaults when the field is unset).
    defaults: tuple[tuple[str, Any], ...] = ()
    #: ``TensorProperties`` defines ``__setstate__`` taking DCP's 5-tuple.
    tuple_state: bool = False
    #: Extra attribute names a writer may attach (Megatron adds ``all_local_plans`` and ``mcore_data``).
    open_fields: bool = False
    field_set: frozenset[str] = field(init=False, repr=False, compare=False)
    default_map: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "field_set", frozenset(self.fields))
        object.__setattr__(self, "default_map", dict(self.defaults))


#: Every dataclass a DCP ``.metadata`` may name, by its short name.
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(_MD, "Metadata", ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
         defaults=(("planner_data", None), ("storage_data", None), ("storage_meta", None), ("version", None)),
         open_fields=True),
    Kind(_MD, "TensorStorageMetadata", ("properties", "size", "chunks")),
    Kind(_MD, "TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
         tuple_state=True),
    Kind(_MD, "ChunkStorageMetadata", ("offsets", "sizes")),
    Kind(_MD, "BytesStorageMetadata", ()),
    Kind(_MD, "MetadataIndex", ("fqn", "offset", "index"), hash_fields=("fqn", "offset"),
         defaults=(("offset", None), ("index", None))),
    Kind(_MD, "StorageMeta", ("checkpoint_id", "save_id", "load_id", "modules"),
         defaults=(("checkpoint_id", None), ("save_id", None), ("load_id", None))),
    Kind(_FS, "_StorageInfo", ("relative_path", "offset", "length", "transform_descriptors"),
         defaults=(("transform_descriptors", None),)),
    Kind(_FS, "_StoragePrefix", ("prefix",)),
    Kind(_PL, "SavePlan", ("items", "storage_data", "planner_data", "usable"),
         hash_fields=("items", "storage_data", "planner_data", "usable"),
         defaults=(("storage_data", None), ("planner_data", None), ("usable", True))),
    Kind(_PL, "WriteItem", ("index", "type", "bytes_io_data", "tensor_data"),
         hash_fields=("index", "type", "bytes_io_data", "tensor_data"),
         defaults=(("bytes_io_data", None), ("tensor_data", None))),
    Kind(_PL, "TensorWriteData", ("chunk", "properties", "size"), hash_fields=("chunk", "properties", "size")),
    Kind(_PL, "BytesIOWriteData", ("nbytes",), hash_fields=("nbytes",)),
    Kind(_MCORE, "MCoreSavePlan", ("items", "storage_data", "planner_data", "usable", "mcore_data"),
         hash_fields=("items", "storage_data", "planner_data", "usable", "mcore_data"),
         defaults=(("storage_data", None), ("planner_data", None), ("usable", True), ("mcore_data", None))),
)}

#: Enums DCP pickles by value, and the values each has.
ENUMS: dict[str, tuple[str, dict[int, str]]] = {
    "_MEM_FORMAT_ENCODING": (_MD, {0: "TORCH_CONTIGUOUS_FORMAT", 1: "TORCH_CHANNELS_LAST",
                                   2: "TORCH_PRESERVE_FORMAT"}),
    "WriteItemType": (_PL, {1: "TENSOR", 2: "SHARD", 3: "BYTE_IO"}),
}

#: ``str(layout)`` of every ``torch.layout`` (``torch.serialization._get_layout`` looks names up in these).
LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
                     "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})

_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")


# -------- The plain tree handed to validation: immutable values, no behaviour.


@dataclass(frozen=True, slots=True)
class Obj:
    """An allowlisted dataclass instance: its kind and the fields its pickle set (defaults filled in)."""

    kind: str
    fields: dict[str, Any]

    __setstate__ = refuse_build


class Size(tuple):
    """``torch.Size``: a tuple of non-negative-or-not Python ints (checked by the caller)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class DType:
    name: str

    __setstate__ = refuse_build


@dataclass(frozen=True, slots=True)
class Enum:
    kind: str
    value: int

    __setstate__ = refuse_build


@dataclass(frozen=True, slots=True)
class Path:
    value: str

    __setstate__ = refuse_build


@dataclass(frozen=True, slots=True)
class TorchLayout:
    """A ``torch.layout`` (``torch.strided``, ...) by name."""

    name: str

    __setstate__ = refuse_build


@dataclass(frozen=True, slots=True)
class PDict:
    """A dict as the pickle built it: its items in insertion order (keys may repeat after conversion)."""

    items: tuple[tuple[Any, Any], ...]

    __setstate__ = refuse_build


# -------- Stand-ins: new for every parse, immutable where they are shared.


def _budget(size: int) -> Budget:
    """The budget of a pickle of ``size`` bytes."""
    return Budget(LIMITS.work(size), "the pickle asks for more work than its size allows (a memoized structure "
                  f"expanded past the budget; limit: {BUDGET_PER_BYTE} per byte + {BUDGET_BASE})", LIMITS)


class _Record:
    """Base of the per-parse record classes: stores what ``BUILD`` sets, as real unpickling would."""

    __slots__ = ("_f",)
    _kind: Kind
    _budget: Budget

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        if args or kwargs:
            raise BadPickle(f"{cls._kind.name} is built with arguments, which DCP never pickles")
        budget = cls._budget
        budget.left -= 1
        if budget.left < 0:
            budget.charge(0)
        obj = object.__new__(cls)
        _set_f(obj, {})
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only REDUCE (a call of the class) gets here; NEWOBJ calls __new__ alone.
        raise BadPickle(f"{self._kind.name} is called, which DCP never pickles")

    def __setstate__(self, state: Any) -> None:
        kind = self._kind
        budget = self._budget
        budget.left -= 1
        if budget.left < 0:
            budget.charge(0)
        if kind.tuple_state:
            _check_properties_state(state)
            self._f.update(zip(kind.fields, state, strict=True))
            return
        # pickle's load_build for a class without __setstate__: (dict | None, slot dict | None) or a dict.
        if type(state) is dict and state.keys() <= kind.field_set:  # the usual case, in one step
            budget.left -= len(state)
            if budget.left < 0:
                budget.charge(0)
            self._f.update(state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if state is not None:
            if type(state) is not dict:
                raise BadPickle(f"{kind.name} state is {type(state).__name__}, not a dictionary")
            self._set_fields(state)
        if slots is not None:
            if type(slots) is not dict:
                raise BadPickle(f"{kind.name} slot state is {type(slots).__name__}, not a dictionary")
            if kind.hash_fields is not None and slots:  # hashable: a frozen dataclass
                raise BadPickle(f"{kind.name} is frozen; setting attributes on it fails")
            self._set_fields(slots)

    def _set_fields(self, values: dict[Any, Any]) -> None:
        kind = self._kind
        self._budget.charge(len(values))
        fields = kind.field_set
        for key in values:
            if type(key) is not str:
                raise BadPickle(f"{kind.name} has an attribute named by a {type(key).__name__}")
            if key not in fields and not (kind.open_fields and _PLAIN_NAME.match(key)):
                raise BadPickle(f"{kind.name} has no field {key[:80]!r}")
        self._f.update(values)

    def __hash__(self) -> int:
        # Equality stays object identity: equal keys stay two entries, which validation refuses as a repeat.
        kind = self._kind
        if kind.hash_fields is None:
            raise BadPickle(f"{kind.name} is unhashable but used as a dict key or set member")
        budget = self._budget
        budget.charge(1 + len(kind.hash_fields))  # a hash of a hash of ... must not go unpaid
        fields = self._f
        values = []
        for name in kind.hash_fields:
            if name in fields:
                value = fields[name]
            elif name in kind.default_map:
                value = kind.default_map[name]
            else:
                raise BadPickle(f"{kind.name} is hashed before its field {name!r} is set")
            if isinstance(value, tuple) and type(value) is not Size:  # a Size holds ints only
                budget.check_hashable(value, Size)
            values.append(value)
        try:
            return hash(tuple(values))
        except TypeError as exc:
            raise BadPickle(f"{kind.name} holds an unhashable value: {exc}") from None


_set_f = _Record._f.__set__  # type: ignore[attr-defined]
_PLAIN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _check_properties_state(state: Any) -> None:
    # DCP's 5-tuple, checked now even if unused: a state tuple holding tuples could nest without limit.
    if type(state) is not tuple or len(state) != 5:
        raise BadPickle("TensorProperties state is not the 5-tuple DCP pickles")
    dtype, layout, requires_grad, encoding, pin_memory = state
    if type(encoding) is not Enum or encoding.kind != "_MEM_FORMAT_ENCODING":
        raise BadPickle("TensorProperties memory format is not a _MEM_FORMAT_ENCODING")
    if (type(dtype) is not DTypeGlobal or type(layout) is not TorchLayout or type(requires_grad) is not bool
            or type(pin_memory) is not bool):
        raise BadPickle("TensorProperties state is not (dtype, layout, bool, memory format, bool)")


class _SafeUnpickler(ReferenceUnpickler):
    """The framework's pure-Python reference unpickler, refusing the opcodes DCP never writes (the C unpickler, the
    framework's :class:`FastUnpickler`, reads only what :func:`in_fast_subset` admits, which holds none of them).

    Unlike the ``torch.save`` reader it charges nothing per global or opcode: only the stand-ins and the conversion,
    which both unpicklers run, charge, so both spend the budget alike (every other opcode works in proportion to
    its bytes)."""

    refused_opcodes = (pickle.INT, pickle.LONG, pickle.FLOAT, pickle.STRING, pickle.UNICODE, pickle.GET, pickle.PUT,
                       pickle.INST, pickle.OBJ, pickle.PERSID, pickle.BINPERSID, pickle.EXT1, pickle.EXT2,
                       pickle.EXT4)
    refused_opcodes_reason = ("protocol-0 text opcodes (INT, LONG, FLOAT, STRING, GET, PUT, INST, OBJ, ...) are "
                              "not used by DCP metadata")
    flat_tuple = Size


def _allowlist(budget: Budget) -> dict[tuple[str, str], Any]:
    """A fresh allowlist: new record classes, new global stand-ins, bound to this parse's budget."""
    allowed: dict[tuple[str, str], Any] = {}
    for kind in KINDS.values():
        cls = type(f"_Shadow_{kind.name}", (_Record,), {"__slots__": (), "_kind": kind, "_budget": budget})
        allowed[(kind.module, kind.name)] = cls

    def make_size(*args: Any) -> Size:
        if len(args) != 1 or not isinstance(args[0], tuple | list):
            raise BadPickle("torch.Size with unexpected arguments")
        dims = args[0]
        budget.left -= len(dims) + 1
        if budget.left < 0:
            budget.charge(0)
        if len(dims) > MAX_DIMS:
            raise BadPickle(f"torch.Size of more than {MAX_DIMS} dimensions")
        if not set(map(type, dims)) <= _INT_ONLY:
            raise BadPickle("torch.Size of non-integers (torch.Size raises on it)")
        return Size(dims)

    def enum_of(kind: str) -> Any:
        values = ENUMS[kind][1]

        def make(*args: Any) -> Enum:
            budget.charge()
            if len(args) != 1 or type(args[0]) is not int or args[0] not in values:
                raise BadPickle(f"{kind} has no such value (the enum raises on it)")
            return Enum(kind, args[0])

        return make

    def make_layout(*args: Any) -> TorchLayout:
        budget.charge()
        if len(args) != 1 or type(args[0]) is not str or args[0] not in LAYOUTS:
            raise BadPickle("unknown torch layout (torch.serialization._get_layout raises on it)")
        return TorchLayout(args[0])

    def make_path(*parts: Any) -> Path:
        budget.charge(len(parts) + 1)
        if len(parts) > MAX_PATH_PARTS:
            raise BadPickle(f"a path of more than {MAX_PATH_PARTS} parts")
        if not all(type(p) is str for p in parts):
            raise BadPickle("path with non-string parts (pathlib raises on it)")
        return Path(str(PurePosixPath(*parts)) if parts else ".")

    allowed[("torch", "Size")] = callable_global("torch.Size", make_size)
    allowed[("torch.serialization", "_get_layout")] = callable_global("torch.serialization._get_layout",
                                                                       make_layout)
    for name, (module, _) in ENUMS.items():
        allowed[(module, name)] = callable_global(f"{module}.{name}", enum_of(name))
    for name in _PATHS:
        allowed[("pathlib", name)] = callable_global(f"pathlib.{name}", make_path)
    allowed.update(DTYPE_GLOBALS)
    return allowed


#: Every global a DCP ``.metadata`` may name, as ``module.name``.
ALLOWED_GLOBALS: frozenset[str] = frozenset(f"{module}.{name}" for module, name in _allowlist(_budget(0)))


_INT_ONLY = frozenset({int})


def parse(data: bytes) -> Any:
    """Unpickle ``data`` through the allowlist and return the plain tree (fast path and fallback: module docstring).

    Raises :class:`UnsafeGlobal` (global outside the allowlist) or :class:`BadPickle` (budget, anything real
    unpickling rejects or DCP never writes, not a pickle, and any other failure on hostile bytes).
    """
    with paused_gc():
        if not in_fast_subset(data):
            return _parse(data, fast=False)
        try:
            return _parse(data, fast=True)
        except (UnsafeGlobal, BadPickle) as exc:
            c_error = exc
        _parse(data, fast=False)  # raises the reference's own account of what is wrong
        raise c_error


def parse_reference(data: bytes) -> Any:
    """:func:`parse` by the pure-Python unpickler alone (the reference the C unpickler is checked against)."""
    with paused_gc():
        return _parse(data, fast=False)


def _parse(data: bytes, *, fast: bool) -> Any:
    budget = _budget(len(data))
    with refusing():
        allowed = _allowlist(budget)
        unpickler = FastUnpickler(data, allowed) if fast else _SafeUnpickler(data, allowed, budget)
        raw = unpickler.load()
        del unpickler  # its memo holds every state dict BUILD copied: free them before converting
        return _Plain(budget).convert(raw, 0)


_DTYPES = {name: DType(name) for name in DTYPE_ITEMSIZE}
# Obj(kind, fields) without the frozen dataclass's __init__ (half the cost of converting a record).
_new_obj = object.__new__
_set_obj_kind = Obj.kind.__set__  # type: ignore[attr-defined]
_set_obj_fields = Obj.fields.__set__  # type: ignore[attr-defined]


class _Plain:
    """Turns what the unpickler built into the plain tree, charging every node to the budget."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def convert(self, value: Any, depth: int) -> Any:
        budget = self.budget
        budget.left -= 1
        if budget.left < 0:
            budget.charge(0)
        if depth > MAX_DEPTH:
            raise BadPickle(f"the pickle nests deeper than {MAX_DEPTH} levels")
        t = type(value)
        if t in _LEAVES or value is None:
            if t is Size:
                budget.charge(len(value))
            return value
        depth += 1
        if t is tuple or t is list or t is dict:
            budget.charge(len(value))  # every element, scalar or not, is work
        if t is tuple:
            return tuple(v if type(v) in _SCALAR_LEAVES else self.convert(v, depth) for v in value)
        if t is list:
            return [v if type(v) in _SCALAR_LEAVES else self.convert(v, depth) for v in value]
        if t is dict:
            if depth > MAX_DEPTH:
                return PDict(tuple((self.convert(k, depth), self.convert(v, depth)) for k, v in value.items()))
            # Scalar keys and values inline (what convert would do for them, charges included).
            pairs = []
            for k, v in value.items():
                if type(k) not in _SCALAR_LEAVES:
                    k = self.convert(k, depth)
                else:
                    budget.left -= 1
                if type(v) not in _SCALAR_LEAVES:
                    v = self.convert(v, depth)
                else:
                    budget.left -= 1
                pairs.append((k, v))
            if budget.left < 0:
                budget.charge(0)
            return PDict(tuple(pairs))
        if isinstance(value, _Record):
            return self._record(value, depth)
        if t is DTypeGlobal:
            return _DTYPES[value.name]
        if isinstance(value, FrozenGlobal) or (isinstance(value, type) and issubclass(value, _Record)):
            raise BadPickle("a class or function itself appears as a value")
        raise BadPickle(f"a value of type {t.__name__} appears, which DCP metadata never holds")

    def _record(self, value: _Record, depth: int) -> Obj:
        kind = value._kind
        f = value._f
        if f.keys() == kind.field_set:  # every field set, none extra: the usual case
            fields = f.copy()
        else:
            fields = dict(kind.defaults)
            fields.update(f)
        budget = self.budget
        budget.left -= len(fields)
        if budget.left < 0:
            budget.charge(0)
        if not fields.keys() >= kind.field_set:
            missing = [f for f in kind.fields if f not in fields]
            raise BadPickle(f"{kind.name} lacks the field(s) {missing}")
        for k, v in fields.items():  # values replaced in place: the keys stay
            t = type(v)
            if t in _SCALAR_LEAVES:
                continue
            if depth <= MAX_DEPTH and (t is Size or t is Enum or t is TorchLayout or t is Path or t is DTypeGlobal):
                # Leaves inline (what convert would do for them, charges included).
                budget.left -= 1
                if t is Size:
                    budget.left -= len(v)
                elif t is DTypeGlobal:
                    fields[k] = _DTYPES[v.name]
                if budget.left < 0:
                    budget.charge(0)
            else:
                fields[k] = self.convert(v, depth)
        obj = _new_obj(Obj)
        _set_obj_kind(obj, kind.name)
        _set_obj_fields(obj, fields)
        return obj


#: Values the plain tree keeps as they are.
_LEAVES = frozenset({str, int, float, bool, bytes, Size, Enum, Path, TorchLayout})
#: Leaves cheap enough to copy without a charge of their own (the container was charged for them).
_SCALAR_LEAVES = frozenset({str, int, float, bool, type(None)})
