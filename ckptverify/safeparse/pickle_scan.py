"""Find the tensors in a ``torch.save`` pickle (``data.pkl``) without executing anything.

A whole-file ``torch.save`` (a ``.pt``/``.bin``/``.ckpt``: a state dict, a Lightning checkpoint, an optimizer)
pickles nested containers whose leaves are tensors (``torch._utils._rebuild_tensor_v2`` over a persistent
storage reference) and plain values. This unpickler resolves the tensor machinery (rebuild functions, storage
types, dtypes, ``torch.Size``) and plain containers to inert stand-ins of its own; every other global (a
framework's ``AttributeDict``, a ``Path``, a user class) becomes an :class:`Opaque` placeholder that records
its name and whatever the pickle hands it, and is **never called or imported**. So nothing in the file runs,
whatever it names, and the report says which globals were left uninterpreted.

Work is bounded: the pickle's size, the objects it may build (:data:`MAX_OBJECTS`), and the walk over the
result visits each object once (a "billion laughs" of shared references stays linear).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from dataclasses import dataclass, field
from typing import Any

from ckptverify.dcp.layout import DTYPE_ITEMSIZE
from ckptverify.errors import PickleScanError

__all__ = ["MAX_OBJECTS", "MAX_PICKLE_BYTES", "MAX_VALUES", "Opaque", "PickleScan", "PickleScanError", "TensorRef",
           "leaf_values", "scan_pickle"]

#: Largest ``data.pkl`` read.
MAX_PICKLE_BYTES = 256 << 20
#: Most objects (globals resolved, calls, storages) one pickle may make.
MAX_OBJECTS = 2_000_000
#: Deepest nesting of tuples in tuples a pickle may build. Hashing a tuple (a dict key, a set member) recurses
#: in C with no limit, so a key nested a million deep would crash the process; real checkpoints nest a few deep.
MAX_TUPLE_DEPTH = 200
#: How far past the memo entries made so far a ``PUT`` index may reach. A pickler numbers memo entries 0, 1, 2,
#: ... in order; the C unpickler zero-fills its memo array up to twice the largest index it is given, so one
#: ``LONG_BINPUT`` of index 2**31 in a file of a few hundred bytes would allocate 32 GiB.
MEMO_SLACK = 1024

_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}  # fmt: skip


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str | None
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it: its storage record, dtype, shape, stride, storage offset."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str | None:
        return self.storage.dtype

    def extent(self) -> int:
        """Elements of the storage this tensor reaches (offset + the furthest element + 1; 0 when empty)."""
        if any(s == 0 for s in self.shape):
            return 0
        return self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=False)) + 1


class Opaque:
    """An instance of a global outside the tensor allowlist: it records the arguments and state the pickle
    gives it. Its class is made per name by the unpickler (so ``NEWOBJ``, which needs a class, works); nothing
    of the real global is ever imported or called."""

    name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> Any:  # pragma: no cover - never pickled again
        raise TypeError("Opaque stand-ins are not picklable")


def _opaque_class(qual: str) -> type[Opaque]:
    return type("Opaque", (Opaque,), {"name": qual})


@dataclass
class PickleScan:
    """What a pickle holds: its tensors by path (``state_dict.layer.weight``) and the storages they use."""

    root: Any
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    storages: dict[str, StorageRef] = field(default_factory=dict)
    opaque: set[str] = field(default_factory=set)


class _Budget:
    def __init__(self, limit: int) -> None:
        self.left = limit

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise PickleScanError(f"the pickle builds more than {MAX_OBJECTS} objects; refused (a decompression "
                                  "bomb, or not a checkpoint)")


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, scan: PickleScan, budget: _Budget) -> None:
        super().__init__(io.BytesIO(data))
        self.scan = scan
        self.budget = budget
        self._classes: dict[str, type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        self.budget.spend()
        qual = f"{module}.{name}"
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return self._rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return lambda data, *rest: data
        if module == "torch" and name in _STORAGE_DTYPES:
            return ("storage-type", _STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPE_ITEMSIZE:
            return ("dtype", name)
        if module == "torch" and name == "Size":
            return lambda dims=(): tuple(dims)
        if module == "collections" and name == "OrderedDict":
            return _OrderedDict
        if module == "builtins" and name in ("set", "frozenset"):
            return lambda items=(): list(items)
        if module == "_codecs" and name == "encode":
            return _encode
        self.scan.opaque.add(qual)
        if qual not in self._classes:
            self._classes[qual] = _opaque_class(qual)
        return self._classes[qual]

    def persistent_load(self, pid: Any) -> Any:
        self.budget.spend()
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise PickleScanError("a persistent reference that is not a torch storage")
        _, kind, key, _location, numel = pid
        dtype = kind[1] if isinstance(kind, tuple) and len(kind) == 2 else None
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise PickleScanError("a storage reference with a bad key or size")
        ref = self.scan.storages.get(key)
        if ref is None:
            ref = StorageRef(key, dtype, numel)
            self.scan.storages[key] = ref
        return ref

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        self.budget.spend()
        if not isinstance(storage, StorageRef):
            return _opaque_class("torch._utils._rebuild_tensor_v2 (not over a storage)")()
        if type(offset) is not int or not isinstance(size, tuple | list) or not isinstance(stride, tuple | list):
            raise PickleScanError("a tensor with a bad offset, shape or stride")
        shape, strides = tuple(size), tuple(stride)
        # Below 2**63 as torch's own sizes: a pickle's LONG4 can carry an integer of millions of digits, and the
        # extent of a tensor multiplies them.
        if len(shape) != len(strides) or len(shape) > 64 or not all(
                type(v) is int and 0 <= v < 1 << 63 for v in (*shape, *strides, offset)):
            raise PickleScanError("a tensor with a bad offset, shape or stride")
        return TensorRef(storage, offset, shape, strides)


class _OrderedDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` without its methods beyond ``dict``'s (``__reduce__`` rebuilds by items)."""


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise PickleScanError("_codecs.encode outside the bytes-in-protocol-2 form")
    return text.encode("latin1")


_MAKES_TUPLE = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"})
#: Calls whose result may be (or hold) a tuple they were given: our stand-ins pass values through.
_PASSES_THROUGH = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


def _check_nesting(data: bytes) -> None:
    """Refuse a pickle that would build tuples nested deeper than :data:`MAX_TUPLE_DEPTH`, before anything is
    built. One pass over the opcodes with a stack of nesting heights (0: not a tuple). Tuples are immutable, so
    a tuple's height is fixed when it is built; lists and dicts cannot be hashed, so their contents do not count.
    Calls are charged the height of their arguments, as a stand-in may hand a tuple argument back.

    The same pass bounds the memo: a ``PUT`` index more than :data:`MEMO_SLACK` past the number of memo entries
    made before it is refused, so the unpickler's memo stays linear in the pickle's size."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    puts = 0
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name == "DUP":
                stack.append(stack[-1] if stack else 0)
                continue
            if name in _MEMO_PUT or name == "MEMOIZE":
                index = int(arg) if name != "MEMOIZE" else len(memo)
                if index < 0 or index > puts + MEMO_SLACK:
                    raise PickleScanError(f"the pickle stores memo entry {index} after {puts} entries; refused "
                                          "(the unpickler would allocate memory for every index below it)")
                puts += 1
                memo[index] = stack[-1] if stack else 0
                continue
            if name in _MEMO_GET:
                stack.append(memo.get(int(arg), 0))
                continue
            before = op.stack_before
            below = next((i for i, obj in enumerate(before) if obj is pickletools.markobject), None)
            if below is None:
                popped = [stack.pop() if stack else 0 for _ in before]  # the top first
            else:  # everything above the mark, then the objects under it (SETITEMS' dict, say)
                at = marks.pop() if marks else 0
                popped = stack[at:]
                del stack[at:]
                popped += [stack.pop() if stack else 0 for _ in range(below)]
            top = max(popped, default=0)
            if name in _MAKES_TUPLE or name == "EMPTY_TUPLE":
                height = top + 1
            elif name in _PASSES_THROUGH:
                height = top
            elif name == "BUILD":
                height = popped[-1] if popped else 0  # the object built upon stays (popped last)
            else:
                height = 0
            if height > MAX_TUPLE_DEPTH:
                raise PickleScanError(f"the pickle nests tuples deeper than {MAX_TUPLE_DEPTH} levels; refused")
            stack.extend([height] * len(op.stack_after))
    except PickleScanError:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as exc:
        raise PickleScanError(f"not a readable pickle: {type(exc).__name__}: {exc}"[:300]) from None


def scan_pickle(data: bytes, *, max_objects: int = MAX_OBJECTS) -> PickleScan:
    """Unpickle ``data`` into inert stand-ins and list its tensors; raises :class:`PickleScanError`."""
    if len(data) > MAX_PICKLE_BYTES:
        raise PickleScanError(f"data.pkl is {len(data)} bytes, more than this tool reads ({MAX_PICKLE_BYTES})")
    _check_nesting(data)
    scan = PickleScan(root=None)
    budget = _Budget(max_objects)
    try:
        scan.root = _Unpickler(data, scan, budget).load()
    except PickleScanError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            RecursionError, MemoryError, OverflowError, UnicodeDecodeError, ImportError) as exc:
        raise PickleScanError(f"not a readable pickle: {type(exc).__name__}: {exc}"[:300]) from None
    _walk(scan, budget)
    return scan


def _walk(scan: PickleScan, budget: _Budget) -> None:
    """Name every tensor by its path of keys; each object is visited once (shared references stay linear)."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", scan.root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget.spend()
        if isinstance(obj, TensorRef):
            scan.tensors.setdefault(path or "<root>", obj)
        elif isinstance(obj, dict):
            for k, v in reversed(list(obj.items())):
                stack.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(obj, list | tuple):
            for i in reversed(range(len(obj))):
                stack.append((f"{path}.{i}" if path else str(i), obj[i]))
        elif isinstance(obj, Opaque):
            stack.append((path, obj.state))
            stack.append((path, obj.args))


#: Most plain values :func:`leaf_values` lists from one object tree.
MAX_VALUES = 200_000


def leaf_values(root: Any, *, prefix: str = "", limit: int = MAX_VALUES) -> dict[str, str]:
    """Every plain value (number, string, bytes, bool, ``None``) of an object tree, by path, as a canonical
    string (``int:4``, ``float:0.001``: exact, ``-0.0`` and ``0.0`` differ), for comparing two trees value by
    value. Tensors are not values (see :attr:`PickleScan.tensors`); an :class:`Opaque` object contributes its
    name (``<path>.__class__``) and what the pickle handed it (``.args.N``, ``.state...``). Each object is
    visited once; past ``limit`` values the rest are left out."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, root)]
    while stack and len(out) < limit:
        path, obj = stack.pop()
        if isinstance(obj, TensorRef | StorageRef):
            continue
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes | bytearray):
            out[path or "<root>"] = _canonical(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in reversed(list(obj.items())):
                stack.append((f"{path}.{k}" if path else str(k), v))
        elif isinstance(obj, tuple) and len(obj) == 2 and obj[0] in ("dtype", "storage-type"):
            out[path or "<root>"] = f"{obj[0]}:{obj[1]}"  # a torch dtype, as the unpickler resolved it
        elif isinstance(obj, list | tuple):
            for i in reversed(range(len(obj))):
                stack.append((f"{path}.{i}" if path else str(i), obj[i]))
        elif isinstance(obj, Opaque):
            out[f"{path}.__class__" if path else "__class__"] = f"global:{obj.name}"
            stack.append((f"{path}.state" if path else "state", obj.state))
            stack.append((f"{path}.args" if path else "args", obj.args))
    return out


def _canonical(obj: Any) -> str:
    """A plain value as an exact string; long strings and bytes by their length and digest."""
    text = f"{type(obj).__name__}:{obj!r}"
    if len(text) <= 512:
        return text
    from ckptverify.fingerprint import digest_bytes

    raw = obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else bytes(obj)
    return f"{type(obj).__name__}[{len(obj)}]:xxh3-128:{digest_bytes(raw)}"
