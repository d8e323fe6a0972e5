"""Reading the ``data.pkl`` of a ``torch.save`` tensor item (each DCP item) without executing anything.

:func:`tensor_header` learns a tensor's dtype, shape, strides and storage offset from its ``data.pkl``: a
configuration of :mod:`ckptverify.safeparse.unpickler` whose allowlist resolves the tensor machinery
(``torch._utils._rebuild_tensor_v2``/``_v3``, the storage types, dtypes, ``collections.OrderedDict`` for the
hooks) to stand-ins shared by every parse (so each refuses ``BUILD`` and attribute writes), read by the
pure-Python reference unpickler with a dict memo. A plain tensor's ``data.pkl`` hashes no tuple, so any tuple
used as a dict key or set member is refused. The archive around it is walked by
:mod:`ckptverify.safeparse.zipwalk`.
"""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE
from ckptverify.safeparse.unpickler import Budget, FrozenGlobal, Limits, ReferenceUnpickler, callable_global

__all__ = ["TensorHeader", "tensor_header"]

_LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip

#: The bounds of a ``data.pkl`` read: no tuple hashed, memo entries numbered in order. No work budget: none of
#: the stand-ins copies or walks what it is given, so each opcode costs work in proportion to the bytes read.
LIMITS = Limits(max_key_nodes=0, memo_slack=0)


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What a tensor item's ``data.pkl`` says: the storage record and the view onto it."""

    dtype: str
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_row_major(self) -> bool:
        expected, acc = [], 1
        for n in reversed(self.size):
            expected.append(acc)
            acc *= n
        return all(s == e or n == 1 for s, e, n in zip(self.stride, reversed(expected), self.size, strict=True))


class _StorageRef:
    """A storage reference from a persistent id: immutable once made."""

    __slots__ = ("dtype", "key", "numel")

    def __init__(self, dtype: str | None, key: str, numel: int) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "numel", numel)

    def __setattr__(self, key: str, value: Any) -> None:
        raise pickle.UnpicklingError("data.pkl modifies a storage reference")

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("data.pkl modifies a storage reference")


class _Global(FrozenGlobal):
    """A global of the tensor allowlist (function, dtype, storage type): refuses ``BUILD``."""

    __slots__ = ()
    modified: ClassVar[str] = "data.pkl modifies a global ({label})"


class _DType(_Global):
    """A torch dtype global; not callable, like ``torch.float32``."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return self._label[len("torch."):]


class _StorageType(_Global):
    """A storage class global; ``dtype`` is its dtype (``None`` for ``UntypedStorage``)."""

    __slots__ = ("dtype",)

    def __init__(self, label: str, dtype: str | None) -> None:
        super().__init__(label)
        object.__setattr__(self, "dtype", dtype)


def _header(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None) -> TensorHeader:
    if not isinstance(storage, _StorageRef) or dtype is None:
        raise pickle.UnpicklingError("tensor without a storage or dtype")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) > 64:
        raise pickle.UnpicklingError("tensor size or stride is not a short tuple")
    ints = (offset, *size, *stride)
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in ints) or len(size) != len(stride):
        raise pickle.UnpicklingError("tensor view fields are not small non-negative integers")
    itemsize = DTYPE_ITEMSIZE.get(str(dtype))
    if itemsize is None:
        raise pickle.UnpicklingError(f"unknown dtype {str(dtype)[:40]!r}")
    numel = storage.numel
    if storage.dtype is None:
        # torch.save writes dtypes without a legacy typed storage (uint16/32/64, complex32, float8, ...)
        # as an UntypedStorage, whose size is counted in bytes.
        if numel % itemsize:
            raise pickle.UnpicklingError(f"untyped storage of {numel} bytes does not hold whole {dtype} elements")
        numel //= itemsize
    return TensorHeader(str(dtype), storage.key, numel, offset, tuple(size), tuple(stride))


def _tensor_globals() -> dict[tuple[str, str], Any]:
    """The allowlist for ``data.pkl``. Shared by every parse, so every member is immutable: the globals
    refuse ``BUILD`` and attribute writes, and the OrderedDict stand-in's class is never handed out."""

    def rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorHeader:
        return _header(storage, offset, size, stride, storage.dtype if isinstance(storage, _StorageRef) else None)

    def rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, req: Any, hooks: Any, dtype: Any,
                   *rest: Any) -> TensorHeader:
        return _header(storage, offset, size, stride, dtype.name if type(dtype) is _DType else None)

    ordered_dict = type("_OrderedDictStandIn", (dict,), {"__slots__": ()})
    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): callable_global(_Global, "torch._utils._rebuild_tensor_v2",
                                                                rebuild_v2),
        ("torch._utils", "_rebuild_tensor_v3"): callable_global(_Global, "torch._utils._rebuild_tensor_v3",
                                                                rebuild_v3),
        ("collections", "OrderedDict"): callable_global(_Global, "collections.OrderedDict",
                                                        lambda *a: ordered_dict(*a)),
        ("torch.storage", "UntypedStorage"): _StorageType("torch.storage.UntypedStorage", None),
    }
    for cls, dtype in _LEGACY_STORAGE_DTYPES.items():
        allowed[("torch", cls)] = _StorageType(f"torch.{cls}", dtype)
    for dtype in DTYPE_ITEMSIZE:
        allowed[("torch", dtype)] = _DType(f"torch.{dtype}")
    return allowed


_TENSOR_GLOBALS: dict[tuple[str, str], Any] | None = None


class _TensorHeaderUnpickler(ReferenceUnpickler):
    """The reference unpickler over the tensor allowlist: ``BUILD`` only onto objects that define
    ``__setstate__`` (all of which refuse it), storages from persistent ids, no tuple hashed."""

    noop_build = False
    what = "data.pkl"

    def __init__(self, data: bytes) -> None:
        global _TENSOR_GLOBALS
        if _TENSOR_GLOBALS is None:
            _TENSOR_GLOBALS = _tensor_globals()
        super().__init__(data, _TENSOR_GLOBALS, Budget(0, _exceeded, LIMITS))  # never charged: see LIMITS

    def unknown_global(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor record"[:300])

    def persistent(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unexpected persistent id")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or type(key) is not str or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError("malformed storage reference")
        return _StorageRef(stype.dtype, key, numel)


def _exceeded() -> Exception:  # pragma: no cover - nothing charges the budget
    return pickle.UnpicklingError("data.pkl asks for more work than its size allows")


def tensor_header(data_pkl: bytes) -> TensorHeader:
    """Read a tensor item's ``data.pkl`` safely. Raises ``pickle.UnpicklingError`` on anything else.

    The result depends on the bytes alone, and the items of a checkpoint share a handful of headers (one
    per dtype and shape), so small ones are remembered by their bytes."""
    if len(data_pkl) <= _CACHED_HEADER_BYTES:
        return _tensor_header_cached(bytes(data_pkl))
    return _tensor_header(data_pkl)


_CACHED_HEADER_BYTES = 4096


@functools.lru_cache(maxsize=1024)
def _tensor_header_cached(data_pkl: bytes) -> TensorHeader:
    return _tensor_header(data_pkl)


def _tensor_header(data_pkl: bytes) -> TensorHeader:
    try:
        obj = _TensorHeaderUnpickler(data_pkl).load()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # hostile bytes: any failure is "not a plain tensor", never a traceback
        raise pickle.UnpicklingError(f"{type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, TensorHeader):
        raise pickle.UnpicklingError(f"data.pkl holds {type(obj).__name__}, not a tensor")
    return obj
