"""Find the tensors in a whole-file ``torch.save`` pickle (``data.pkl``) without executing anything.

Tensor machinery (rebuild functions, storage types, dtypes, ``torch.Size``) and plain containers resolve to
inert stand-ins; every other global becomes an :class:`Opaque` placeholder that records its name and arguments
and is **never imported or called**. Allowlisted tensor subclasses (torchao's ``MXTensor``, ``NVFP4Tensor``)
become :class:`~ckptverify.safeparse.torchsave.SubclassHeader` s (inner tensors as :class:`TensorRef`); a
malformed one is refused.

Read by the C unpickler only after :func:`~ckptverify.safeparse.unpickler.check_opcodes` bounded tuple nesting
and the memo. Work is bounded by size, :data:`MAX_OBJECTS`, and a walk visiting each object once.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptverify.errors import BadPickle
from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE
from ckptverify.safeparse.torchsave import (
    LEGACY_STORAGE_DTYPES,
    SUBCLASSES,
    SubclassHeader,
    dtype_name,
    subclass_allowlist,
    subclass_fields,
)
from ckptverify.safeparse.unpickler import Budget, FastUnpickler, Limits, check_opcodes

__all__ = [
    "MAX_OBJECTS",
    "MAX_PICKLE_BYTES",
    "MAX_VALUES",
    "Opaque",
    "PickleScan",
    "TensorRef",
    "leaf_values",
    "scan_pickle",
]

#: Largest ``data.pkl`` read.
MAX_PICKLE_BYTES = 256 << 20
#: Most objects (globals resolved, calls, storages) one pickle may make.
MAX_OBJECTS = 2_000_000
#: Deepest tuple nesting: hashing a tuple recurses in C without limit (a deep key crashes the process).
MAX_TUPLE_DEPTH = 200
#: How far past the entries made a ``PUT`` index may reach: the C unpickler zero-fills its memo to twice the
#: largest index (one ``LONG_BINPUT`` of 2**31 would allocate 32 GiB).
MEMO_SLACK = 1024
LIMITS = Limits(max_depth=MAX_TUPLE_DEPTH, memo_slack=MEMO_SLACK, max_bytes=MAX_PICKLE_BYTES)

#: Storage classes read as storages: the legacy typed ones but the quantized (whose tensors are not rebuilt here).
_STORAGE_DTYPES = {name: dtype for name, dtype in LEGACY_STORAGE_DTYPES.items() if not name.startswith("Q")} | {
    "UntypedStorage": "uint8"}


@dataclass(frozen=True)
class StorageRef:
    """A storage record: ``dtype`` ``None`` for an untyped storage, whose ``numel`` counts bytes."""

    key: str
    dtype: str | None
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it (storage offset in elements). ``elem_dtype``: the dtype
    ``_rebuild_tensor_v3`` names over an untyped storage; otherwise the storage's dtype is the tensor's."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    elem_dtype: str | None = None

    @property
    def dtype(self) -> str | None:
        return self.elem_dtype or self.storage.dtype

    def extent(self) -> int:
        """Elements of the storage this tensor reaches (0 when empty)."""
        if any(s == 0 for s in self.shape):
            return 0
        return self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride, strict=False)) + 1

    def extent_bytes(self) -> int | None:
        """Bytes of the storage this tensor reaches, or ``None`` for a dtype of unknown size."""
        itemsize = DTYPE_ITEMSIZE.get(self.dtype or "")
        return None if itemsize is None else self.extent() * itemsize


class Opaque:
    """An instance of a global outside the allowlist, recording what the pickle gives it. A class is made per name
    (``NEWOBJ`` needs one); nothing of the real global is imported or called."""

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
    """What a pickle holds: tensors by path, allowlisted subclasses by path (their inner tensors are not in
    ``tensors``), and the storages they use."""

    root: Any
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    storages: dict[str, StorageRef] = field(default_factory=dict)
    opaque: set[str] = field(default_factory=set)
    subclasses: dict[str, SubclassHeader] = field(default_factory=dict)

    def all_tensors(self) -> list[tuple[str, str | None, TensorRef]]:
        """Every stored tensor as ``(path, part, ref)``: plain ones (``part`` ``None``), then each subclass's inner
        ones."""
        out: list[tuple[str, str | None, TensorRef]] = [(p, None, r) for p, r in self.tensors.items()]
        for path, sub in self.subclasses.items():
            out.extend((path, name, ref) for name, ref in sub.parts)
        return out


def _budget(max_objects: int) -> Budget:
    def exceeded() -> BadPickle:
        return BadPickle(f"the pickle builds more than {MAX_OBJECTS} objects; refused (a decompression "
                               "bomb, or not a checkpoint)")

    return Budget(max_objects, exceeded, LIMITS)


class _Unpickler(FastUnpickler):
    """The C unpickler over :func:`_allowlist`; other globals resolve to :class:`Opaque` classes. Every global and
    storage is charged to the budget."""

    def __init__(self, data: bytes, scan: PickleScan, budget: Budget) -> None:
        super().__init__(data, {})
        self._allowed = _allowlist(self)
        self.scan = scan
        self.budget = budget
        self._classes: dict[str, type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        self.budget.charge()
        return super().find_class(module, name)

    def unknown_global(self, module: str, name: str) -> Any:
        qual = f"{module}.{name}"
        self.scan.opaque.add(qual)
        if qual not in self._classes:
            self._classes[qual] = _opaque_class(qual)
        return self._classes[qual]

    def persistent(self, pid: Any) -> Any:
        self.budget.charge()
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise BadPickle("a persistent reference that is not a torch storage")
        _, kind, key, _location, numel = pid
        dtype = kind[1] if isinstance(kind, tuple) and len(kind) == 2 else None
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise BadPickle("a storage reference with a bad key or size")
        ref = self.scan.storages.get(key)
        if ref is None:
            ref = StorageRef(key, dtype, numel)
            self.scan.storages[key] = ref
        elif ref.dtype != dtype:
            # One record read as two storage types would be sized two ways; torch.save never writes that.
            raise BadPickle(f"storage {key[:40]!r} is referenced with two different types")
        return ref

    def _rebuild_tensor_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = None,
                           hooks: Any = None, dtype: Any = None, *rest: Any) -> Any:
        """As v2, with the element dtype given (over an untyped storage, sized in bytes)."""
        name = dtype_name(dtype)
        if name is None or name not in DTYPE_ITEMSIZE:
            raise BadPickle("_rebuild_tensor_v3 without a dtype")
        ref = self._rebuild_tensor(storage, offset, size, stride)
        if not isinstance(ref, TensorRef):
            return ref
        if ref.storage.dtype is not None and ref.storage.dtype != name:
            raise BadPickle(f"a {name} tensor over a {ref.storage.dtype} storage")
        return TensorRef(ref.storage, ref.offset, ref.shape, ref.stride, elem_dtype=name)

    def _rebuild_from_type(self, func: Any, new_type: Any, args: Any, state: Any = None, *rest: Any) -> Any:
        """``_rebuild_from_type_v2``: a :class:`SubclassHeader` for an allowlisted subclass (malformed: refused), else
        an inert :class:`Opaque` (nothing is called)."""
        self.budget.charge()
        label = getattr(new_type, "_label", None)
        if label not in SUBCLASSES:
            qual = "torch._tensor._rebuild_from_type_v2"
            self.scan.opaque.add(qual)
            return self.unknown_global(*qual.rsplit(".", 1))(func, new_type, args, state, *rest)
        if rest:
            raise BadPickle(f"a {label} record with extra arguments")
        try:
            return SubclassHeader(*subclass_fields(func, new_type, args, state, TensorRef))
        except pickle.UnpicklingError as exc:
            raise BadPickle(str(exc)) from None

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        self.budget.charge()
        if not isinstance(storage, StorageRef):
            return _opaque_class("torch._utils._rebuild_tensor_v2 (not over a storage)")()
        if type(offset) is not int or not isinstance(size, tuple | list) or not isinstance(stride, tuple | list):
            raise BadPickle("a tensor with a bad offset, shape or stride")
        shape, strides = tuple(size), tuple(stride)
        # Below 2**63: a LONG4 can carry millions of digits, and the extent multiplies them.
        if len(shape) != len(strides) or len(shape) > 64 or not all(
                type(v) is int and 0 <= v < 1 << 63 for v in (*shape, *strides, offset)):
            raise BadPickle("a tensor with a bad offset, shape or stride")
        return TensorRef(storage, offset, shape, strides)


def _allowlist(unpickler: _Unpickler) -> dict[tuple[str, str], Any]:
    """Allowlisted global -> stand-in (tensor machinery builds :class:`TensorRef`/:class:`StorageRef`). Made per parse:
    the rebuild stand-in is bound to its unpickler's scan and budget."""
    rebuild = unpickler._rebuild_tensor
    # Shared immutable stand-ins; the tensor rebuilds and storages are this reader's own.
    allowed: dict[tuple[str, str], Any] = subclass_allowlist()
    # A device elsewhere (a Lightning hyperparameter) stays an inert placeholder, not reported as uninterpreted
    # (every subclass record names one).
    del allowed[("torch", "device")]
    device_class = _opaque_class("torch.device")
    layout = allowed.pop(("torch.serialization", "_get_layout"))

    def get_layout(*args: Any) -> Any:
        if args == ("torch.strided",):
            return layout(*args)
        return unpickler.unknown_global("torch.serialization", "_get_layout")(*args)

    allowed |= {
        ("torch.serialization", "_get_layout"): get_layout,
        ("torch", "device"): device_class,
        ("torch._utils", "_rebuild_tensor_v2"): rebuild,
        ("torch._utils", "_rebuild_tensor"): rebuild,
        ("torch._utils", "_rebuild_tensor_v3"): unpickler._rebuild_tensor_v3,
        ("torch._tensor", "_rebuild_from_type_v2"): unpickler._rebuild_from_type,
        ("torch.storage", "UntypedStorage"): ("storage-type", None),
        ("torch", "Size"): lambda dims=(): tuple(dims),
        ("collections", "OrderedDict"): _OrderedDict,
        ("_codecs", "encode"): _encode,
    }
    for name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        allowed[("torch._utils", name)] = lambda data, *rest: data
    for name in ("set", "frozenset"):
        allowed[("builtins", name)] = lambda items=(): list(items)
    for name, dtype in _STORAGE_DTYPES.items():  # after the dtypes: a storage name is never a dtype name
        allowed[("torch", name)] = ("storage-type", dtype)
    return allowed


class _OrderedDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` without its methods beyond ``dict``'s (``__reduce__`` rebuilds by items)."""


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise BadPickle("_codecs.encode outside the bytes-in-protocol-2 form")
    return text.encode("latin1")


def scan_pickle(data: bytes, *, max_objects: int = MAX_OBJECTS) -> PickleScan:
    """Unpickle ``data`` into inert stand-ins and list its tensors; raises :class:`BadPickle`."""
    if len(data) > MAX_PICKLE_BYTES:
        raise BadPickle(f"data.pkl is {len(data)} bytes, more than this tool reads ({MAX_PICKLE_BYTES})")
    check_opcodes(data, LIMITS, BadPickle)
    scan = PickleScan(root=None)
    budget = _budget(max_objects)
    try:
        scan.root = _Unpickler(data, scan, budget).load()
    except BadPickle:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            RecursionError, MemoryError, OverflowError, UnicodeDecodeError, ImportError) as exc:
        raise BadPickle(f"not a readable pickle: {type(exc).__name__}: {exc}"[:300]) from None
    _walk(scan, budget)
    return scan


def _key(k: Any) -> str:
    """A dict key as a path component; a dtype key as it read before dtypes had stand-ins of their own."""
    name = dtype_name(k)
    return str(k) if name is None else str(("dtype", name))


def _walk(scan: PickleScan, budget: Budget) -> None:
    """Name every tensor by its path of keys; each object is visited once (shared references stay linear)."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", scan.root)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget.charge()
        if isinstance(obj, TensorRef):
            scan.tensors.setdefault(path or "<root>", obj)
        elif isinstance(obj, SubclassHeader):
            scan.subclasses.setdefault(path or "<root>", obj)  # its inner tensors are its parts, not tensors
        elif isinstance(obj, dict):
            for k, v in reversed(list(obj.items())):
                stack.append((f"{path}.{_key(k)}" if path else _key(k), v))
        elif isinstance(obj, list | tuple):
            for i in reversed(range(len(obj))):
                stack.append((f"{path}.{i}" if path else str(i), obj[i]))
        elif isinstance(obj, Opaque):
            stack.append((path, obj.state))
            stack.append((path, obj.args))


#: Most plain values :func:`leaf_values` lists from one object tree.
MAX_VALUES = 200_000


def leaf_values(root: Any, *, prefix: str = "", limit: int = MAX_VALUES) -> dict[str, str]:
    """Every plain value of an object tree by path, as an exact canonical string (``int:4``; ``-0.0`` != ``0.0``).
    Tensors are not values; an :class:`Opaque` contributes ``<path>.__class__`` and its arguments/state. Each object
    is visited once; values past ``limit`` are left out."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, root)]
    while stack and len(out) < limit:
        path, obj = stack.pop()
        if isinstance(obj, TensorRef | StorageRef | SubclassHeader):
            continue
        name = dtype_name(obj)
        if name is not None:
            out[path or "<root>"] = f"dtype:{name}"  # a torch dtype, as the unpickler resolved it
            continue
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes | bytearray):
            out[path or "<root>"] = _canonical(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for k, v in reversed(list(obj.items())):
                stack.append((f"{path}.{_key(k)}" if path else _key(k), v))
        elif isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "storage-type":
            out[path or "<root>"] = f"{obj[0]}:{obj[1]}"  # a storage type, as the unpickler resolved it
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
    raw = obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else bytes(obj)
    return f"{type(obj).__name__}[{len(obj)}]:xxh3-128:{xxhash.xxh3_128_hexdigest(raw)}"
