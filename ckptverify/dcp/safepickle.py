"""Unpickling DCP metadata without executing anything: per-parse stand-ins, a budget, a plain tree out.

:func:`parse` reads a pickle with an unpickler whose ``find_class`` resolves only an allowlist of names
(DCP's metadata and planner dataclasses, ``torch.Size``, torch dtypes and layouts, two enums, ``pathlib``
paths) and resolves them to *stand-ins* built afresh for that one parse. Nothing from torch runs and nothing
the file does can outlive the parse: a hostile pickle cannot change the stand-ins a later parse uses
(the globals refuse ``BUILD``; the record classes are new classes each time).

The stand-ins do what the real objects would do where that can fail: ``torch.Size`` of a non-integer, an
enum of an unknown value, ``TensorProperties`` state that is not DCP's 5-tuple, slot state that is not a
dict, a frozen dataclass given slot state, hashing an unhashable dataclass all raise :class:`BadPickle`,
at the moment the real unpickler would raise, whether or not the object ends up in the result. So a pickle
this module accepts is one that real unpickling with torch's classes would also accept.

The result is a plain tree (:class:`Obj`, :class:`Size`, :class:`DType`, :class:`Enum`, :class:`Path`,
:class:`Layout`, ``PDict``/lists/tuples/str/int/float/bool/None/bytes) built with a **budget**: every node
visited while building it, and every element a stand-in copies, is charged, and the parse stops with
:class:`BudgetExceeded` past ``BUDGET_PER_BYTE * len(data) + BUDGET_BASE``. A memoized pickle that
references one object a billion times ("billion laughs") is refused in time linear in its size.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, ClassVar

from ckptverify.dcp.layout import DTYPE_ITEMSIZE

#: Charges allowed per byte of pickle, and in addition to that. A DCP metadata pickle needs at most about
#: one node per two bytes (every node costs at least an opcode and an argument byte), so these leave a
#: wide margin for real files while bounding the work a memoized pickle can ask for.
BUDGET_PER_BYTE = 4
BUDGET_BASE = 100_000
#: Deepest nesting of the plain tree (DCP metadata is about 8 deep; Megatron's planner data about 12).
MAX_DEPTH = 64

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

    @property
    def frozen(self) -> bool:
        return self.hash_fields is not None


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

#: Every global a DCP ``.metadata`` may name, as ``module.name``.
ALLOWED_GLOBALS: frozenset[str] = frozenset(
    [f"{k.module}.{k.name}" for k in KINDS.values()]
    + [f"{mod}.{name}" for name, (mod, _) in ENUMS.items()]
    + ["torch.Size", "torch.serialization._get_layout"]
    + [f"pathlib.{p}" for p in _PATHS]
    + [f"torch.{d}" for d in DTYPE_ITEMSIZE]
)


class BadPickle(Exception):
    """The pickle does something real unpickling would fail on, or DCP never writes."""


class BudgetExceeded(BadPickle):
    """The pickle asks for more work than its size justifies (a memoized "billion laughs")."""


class UnsafeGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allowlist; nothing was resolved."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


# ---------------------------------------------------------------------------------------------
# The plain tree handed to validation: immutable values, no behaviour.


def _refuse_build(self: Any, state: Any) -> None:
    # Frozen slotted dataclasses get a __setstate__ that sets their fields: a pickle BUILDing onto a value
    # a stand-in returned (an Enum, a Path) would rewrite it after its check. Refuse, as for the globals.
    raise BadPickle(f"the pickle modifies a {type(self).__name__} value")


@dataclass(frozen=True, slots=True)
class Obj:
    """An allowlisted dataclass instance: its kind and the fields its pickle set (defaults filled in)."""

    kind: str
    fields: dict[str, Any]

    __setstate__ = _refuse_build


class Size(tuple):
    """``torch.Size``: a tuple of non-negative-or-not Python ints (checked by the caller)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class DType:
    name: str

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class Enum:
    kind: str
    value: int

    @property
    def name(self) -> str:
        return ENUMS[self.kind][1][self.value]

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class Path:
    value: str

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class Layout:
    name: str

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class PDict:
    """A dict as the pickle built it: its items in insertion order (keys may repeat after conversion)."""

    items: tuple[tuple[Any, Any], ...]

    __setstate__ = _refuse_build


# ---------------------------------------------------------------------------------------------
# Stand-ins: new for every parse, immutable where they are shared.


class _Budget:
    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def charge(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise BudgetExceeded("the pickle asks for more work than its size allows "
                                 "(a memoized structure expanded past the budget)")


class _Global:
    """A shared global (function, enum, dtype): refuses ``BUILD``, so no pickle can change it."""

    __slots__ = ("_call", "_label")

    def __init__(self, label: str, call: Any = None) -> None:
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_call", call)

    def __setattr__(self, key: str, value: Any) -> None:
        raise BadPickle(f"the pickle modifies the global {self._label}")

    def __setstate__(self, state: Any) -> None:
        raise BadPickle(f"the pickle modifies the global {self._label}")

    def __call__(self, *args: Any) -> Any:
        if self._call is None:
            raise BadPickle(f"{self._label} is not callable")
        return self._call(*args)


class _Record:
    """Base of the per-parse record classes: stores what ``BUILD`` sets, as real unpickling would."""

    __slots__ = ("_built", "_f")
    _kind: Kind
    _budget: _Budget

    def __new__(cls, *args: Any, **kwargs: Any) -> _Record:
        if args or kwargs:
            raise BadPickle(f"{cls._kind.name} is built with arguments, which DCP never pickles")
        cls._budget.charge()
        obj = object.__new__(cls)
        object.__setattr__(obj, "_f", {})
        object.__setattr__(obj, "_built", False)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only REDUCE (a call of the class) gets here; NEWOBJ calls __new__ alone.
        raise BadPickle(f"{self._kind.name} is called, which DCP never pickles")

    def __setattr__(self, key: str, value: Any) -> None:
        raise BadPickle("the pickle sets an attribute outside BUILD")

    def __setstate__(self, state: Any) -> None:
        kind = self._kind
        self._budget.charge()
        if kind.tuple_state:
            _check_properties_state(state)
            self._f.update(zip(kind.fields, state, strict=True))
            object.__setattr__(self, "_built", True)
            return
        # pickle's load_build for a class without __setstate__: (dict | None, slot dict | None) or a dict.
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        if state is not None:
            if not isinstance(state, dict):
                raise BadPickle(f"{kind.name} state is {type(state).__name__}, not a dictionary")
            self._set_fields(state)
        if slots is not None:
            if not isinstance(slots, dict):
                raise BadPickle(f"{kind.name} slot state is {type(slots).__name__}, not a dictionary")
            if kind.frozen and slots:
                raise BadPickle(f"{kind.name} is frozen; setting attributes on it fails")
            self._set_fields(slots)
        object.__setattr__(self, "_built", True)

    def _set_fields(self, values: dict[Any, Any]) -> None:
        kind = self._kind
        self._budget.charge(len(values))
        for key, value in values.items():
            if type(key) is not str:
                raise BadPickle(f"{kind.name} has an attribute named by a {type(key).__name__}")
            if key not in kind.fields and not (kind.open_fields and _PLAIN_NAME.match(key)):
                raise BadPickle(f"{kind.name} has no field {key[:80]!r}")
            self._f[key] = value

    def __hash__(self) -> int:
        kind = self._kind
        if kind.hash_fields is None:
            raise BadPickle(f"{kind.name} is unhashable but used as a dict key or set member")
        defaults = dict(kind.defaults)
        values = []
        for name in kind.hash_fields:
            if name in self._f:
                values.append(self._f[name])
            elif name in defaults:
                values.append(defaults[name])
            else:
                raise BadPickle(f"{kind.name} is hashed before its field {name!r} is set")
        try:
            return hash(tuple(values))
        except TypeError as exc:
            raise BadPickle(f"{kind.name} holds an unhashable value: {exc}") from None

    def __eq__(self, other: object) -> bool:
        return self is other


_PLAIN_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def _check_properties_state(state: Any) -> None:
    # TensorProperties.__setstate__ unpacks five values and maps the fourth through _MEM_FORMAT_ENCODING.
    if not isinstance(state, tuple) or len(state) != 5:
        raise BadPickle("TensorProperties state is not the 5-tuple DCP pickles")
    encoding = state[3]
    if not isinstance(encoding, Enum) or encoding.kind != "_MEM_FORMAT_ENCODING":
        raise BadPickle("TensorProperties memory format is not a _MEM_FORMAT_ENCODING")


class _SafeUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler: its memo is a dict. (The C unpickler grows its memo array to any index a
    ``LONG_BINPUT`` names and zero-fills it: a 10-byte pickle makes it touch gigabytes.)"""

    def __init__(self, data: bytes, allowed: dict[tuple[str, str], Any]) -> None:
        self._stream = io.BytesIO(data)
        self._size = len(data)
        super().__init__(self._stream)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeGlobal(f"{module}.{name}"[:300]) from None

    def persistent_load(self, pid: Any) -> Any:
        raise BadPickle("persistent ids are not used by DCP metadata")

    # Where the pure-Python unpickler is more lenient than the C one that DCP uses, follow the C one (or
    # refuse), so that a file accepted here is never one real unpickling fails on.

    def load_build(self) -> None:
        state = self.stack.pop()
        setstate = getattr(self.stack[-1], "__setstate__", None)
        if setstate is None:
            raise BadPickle("BUILD on a value that is not an allowlisted dataclass")
        setstate(state)

    def load_frame(self) -> None:
        # The Python unpickler accepts a frame that claims more bytes than remain; the C one does not.
        size = int.from_bytes(self.read(8), "little")
        if size > self._size - self._stream.tell():
            raise BadPickle("pickle data was truncated (a frame runs past the end)")
        self._unframer.load_frame(size)

    def _memo_put(self, index: int) -> None:
        # A pickler numbers memo entries in order; the C unpickler allocates (and zero-fills) index * 2 slots.
        if index < 0 or index > len(self.memo):
            raise BadPickle(f"memo index {index} is beyond the {len(self.memo)} objects memoized so far")
        self.memo[index] = self.stack[-1]

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))

    def _refuse_text_opcode(self) -> None:
        raise BadPickle("protocol-0 text opcodes (INT, LONG, FLOAT, STRING, GET, PUT, INST, OBJ, ...) are "
                        "not used by DCP metadata")

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.FRAME[0]] = load_frame
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput
    for _op in (pickle.INT, pickle.LONG, pickle.FLOAT, pickle.STRING, pickle.UNICODE, pickle.GET, pickle.PUT,
                pickle.INST, pickle.OBJ, pickle.PERSID, pickle.BINPERSID, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_text_opcode
    del _op


_INT_ONLY = frozenset({int})


def _int_arg(value: Any) -> bool:
    return type(value) is int


def _allowlist(budget: _Budget) -> dict[tuple[str, str], Any]:
    """A fresh allowlist: new record classes, new global stand-ins, bound to this parse's budget."""
    allowed: dict[tuple[str, str], Any] = {}
    for kind in KINDS.values():
        cls = type(f"_Shadow_{kind.name}", (_Record,), {"__slots__": (), "_kind": kind, "_budget": budget})
        allowed[(kind.module, kind.name)] = cls

    def make_size(*args: Any) -> Size:
        if len(args) != 1 or not isinstance(args[0], tuple | list):
            raise BadPickle("torch.Size with unexpected arguments")
        budget.charge(len(args[0]) + 1)
        if not set(map(type, args[0])) <= _INT_ONLY:
            raise BadPickle("torch.Size of non-integers (torch.Size raises on it)")
        return Size(args[0])

    def enum_of(kind: str) -> Any:
        values = ENUMS[kind][1]

        def make(*args: Any) -> Enum:
            budget.charge()
            if len(args) != 1 or not _int_arg(args[0]) or args[0] not in values:
                raise BadPickle(f"{kind} has no such value (the enum raises on it)")
            return Enum(kind, args[0])

        return make

    def make_layout(*args: Any) -> Layout:
        budget.charge()
        if len(args) != 1 or type(args[0]) is not str or args[0] not in LAYOUTS:
            raise BadPickle("unknown torch layout (torch.serialization._get_layout raises on it)")
        return Layout(args[0])

    def make_path(*parts: Any) -> Path:
        budget.charge(len(parts) + 1)
        if not all(type(p) is str for p in parts):
            raise BadPickle("path with non-string parts (pathlib raises on it)")
        return Path(str(PurePosixPath(*parts)) if parts else ".")

    allowed[("torch", "Size")] = _Global("torch.Size", make_size)
    allowed[("torch.serialization", "_get_layout")] = _Global("torch.serialization._get_layout", make_layout)
    for name, (module, _) in ENUMS.items():
        allowed[(module, name)] = _Global(f"{module}.{name}", enum_of(name))
    for name in _PATHS:
        allowed[("pathlib", name)] = _Global(f"pathlib.{name}", make_path)
    for name in DTYPE_ITEMSIZE:
        allowed[("torch", name)] = _DTypeGlobal(name)
    return allowed


class _DTypeGlobal(_Global):
    """A torch dtype global; not callable, like ``torch.float32``."""

    __slots__ = ()

    def __init__(self, name: str) -> None:
        super().__init__(f"torch.{name}")


# ---------------------------------------------------------------------------------------------


def parse(data: bytes) -> Any:
    """Unpickle ``data`` through the allowlist and return the plain tree.

    Raises :class:`UnsafeGlobal` for a global outside the allowlist, :class:`BudgetExceeded` past the
    budget, :class:`BadPickle` for anything real unpickling would reject (or DCP never writes), and
    ``pickle.UnpicklingError`` for bytes that are not a pickle. Any other exception raised while reading
    hostile bytes is turned into :class:`BadPickle`, so callers need to catch only these.
    """
    budget = _Budget(BUDGET_PER_BYTE * len(data) + BUDGET_BASE)
    try:
        raw = _SafeUnpickler(data, _allowlist(budget)).load()
        return _Plain(budget).convert(raw, 0)
    except (UnsafeGlobal, BadPickle):
        raise
    except pickle.UnpicklingError as exc:
        raise BadPickle(f"not a valid pickle: {exc}"[:300]) from None
    except MemoryError:
        raise BudgetExceeded("the pickle asks for more memory than is available") from None
    except RecursionError:
        raise BadPickle("the pickle nests too deeply") from None
    except Exception as exc:  # hostile bytes: every failure is a finding, never a traceback
        raise BadPickle(f"{type(exc).__name__}: {exc}"[:300]) from None


class _Plain:
    """Turns what the unpickler built into the plain tree, charging every node to the budget."""

    def __init__(self, budget: _Budget) -> None:
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
            return PDict(tuple((self.convert(k, depth), self.convert(v, depth)) for k, v in value.items()))
        if isinstance(value, _DTypeGlobal):
            return DType(value._label[len("torch."):])
        if isinstance(value, _Record):
            kind = value._kind
            fields = dict(kind.defaults)
            fields.update(value._f)
            budget.charge(len(fields))
            for f in kind.fields:
                if f not in fields:
                    missing = [f for f in kind.fields if f not in fields]
                    raise BadPickle(f"{kind.name} lacks the field(s) {missing}")
            return Obj(kind.name, {k: v if type(v) in _SCALAR_LEAVES else self.convert(v, depth)
                                   for k, v in fields.items()})
        if isinstance(value, _Global) or (isinstance(value, type) and issubclass(value, _Record)):
            raise BadPickle("a class or function itself appears as a value")
        raise BadPickle(f"a value of type {t.__name__} appears, which DCP metadata never holds")


#: Values the plain tree keeps as they are.
_LEAVES = frozenset({str, int, float, bool, bytes, Size, Enum, Path, Layout})
#: Leaves cheap enough to copy without a charge of their own (the container was charged for them).
_SCALAR_LEAVES = frozenset({str, int, float, bool, type(None)})
