"""Reading a DCP tensor item's ``data.pkl`` without executing anything.

:func:`tensor_header` reads dtype, shape, strides and offset through the reference unpickler with an allowlist
of shared stand-ins (each refuses ``BUILD`` and attribute writes); no tuple may be hashed.
:func:`item_header` also reads allowlisted tensor subclasses (:data:`SUBCLASSES`, torchao's ``MXTensor`` and
``NVFP4Tensor``) as :class:`SubclassHeader`: the class, enums and attribute records are stand-ins by name, so
nothing of torchao is imported or run, and any other global is refused.
"""

from __future__ import annotations

import functools
import json
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE, is_row_major
from ckptverify.safeparse.unpickler import Budget, FrozenGlobal, Limits, ReferenceUnpickler, callable_global

__all__ = ["SUBCLASSES", "SubclassHeader", "TensorHeader", "dtype_name", "item_header", "subclass_allowlist",
           "subclass_fields", "tensor_header"]

T = TypeVar("T")

#: The legacy typed storage classes ``torch.<Name>Storage`` and their dtypes.
LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip

#: No tuple hashed, memo in order. No work budget: no stand-in copies or walks its input, so work is linear.
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
        return is_row_major(self.size, self.stride)


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


def dtype_name(value: Any) -> str | None:
    """The dtype a dtype stand-in of :func:`subclass_allowlist` names (``float32``), else ``None``."""
    return value.name if type(value) is _DType else None


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
    """The ``data.pkl`` allowlist, shared by every parse, so every member is immutable (the OrderedDict stand-in's
    class is never handed out)."""

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
    for cls, dtype in LEGACY_STORAGE_DTYPES.items():
        allowed[("torch", cls)] = _StorageType(f"torch.{cls}", dtype)
    for dtype in DTYPE_ITEMSIZE:
        allowed[("torch", dtype)] = _DType(f"torch.{dtype}")
    return allowed


_TENSOR_GLOBALS: dict[tuple[str, str], Any] | None = None


class _TensorHeaderUnpickler(ReferenceUnpickler):
    """Reference unpickler over the tensor allowlist: ``BUILD`` only onto stand-ins (which refuse it), storages from
    persistent ids, no tuple hashed."""

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
    """Read a plain tensor item's ``data.pkl`` safely; ``pickle.UnpicklingError`` on anything else."""
    return _pkl_header(data_pkl, False)  # type: ignore[return-value]


def _pkl_header(data_pkl: bytes, subclass: bool) -> TensorHeader | SubclassHeader:
    """``data_pkl`` read through the plain or the subclass allowlist. Small results are cached by their bytes (a
    checkpoint has one header per dtype and shape)."""
    if len(data_pkl) <= _CACHED_HEADER_BYTES:
        return _cached_header(bytes(data_pkl), subclass)
    return _read_header(data_pkl, subclass)


_CACHED_HEADER_BYTES = 4096


@functools.lru_cache(maxsize=2048)
def _cached_header(data_pkl: bytes, subclass: bool) -> TensorHeader | SubclassHeader:
    return _read_header(data_pkl, subclass)


def _read_header(data_pkl: bytes, subclass: bool) -> TensorHeader | SubclassHeader:
    if subclass:
        return _load_record(_ItemHeaderUnpickler(data_pkl), SubclassHeader)
    return _load_record(_TensorHeaderUnpickler(data_pkl), TensorHeader)


def _load_record(unpickler: Any, want: type[T]) -> T:
    """What ``unpickler`` loads if it is a ``want``; any failure (hostile bytes) is an ``UnpicklingError``."""
    try:
        obj = unpickler.load()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # hostile bytes: any failure is "not a tensor record", never a traceback
        raise pickle.UnpicklingError(f"{type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, want):
        raise pickle.UnpicklingError(f"data.pkl holds {type(obj).__name__}, not a tensor")
    return obj


# ----------------------------------------------------------------------------------- tensor subclasses

#: Subclasses :func:`item_header` reads -> inner tensor names in ``__tensor_flatten__`` order (optional last).
SUBCLASSES: dict[str, tuple[str, ...]] = {
    "torchao.prototype.mx_formats.mx_tensor.MXTensor": ("qdata", "scale"),
    "torchao.prototype.mx_formats.nvfp4_tensor.NVFP4Tensor": ("qdata", "scale", "per_tensor_scale",
                                                              "act_per_tensor_scale"),
}

_KERNEL = "torchao.quantization.quantize_.common.kernel_preference.KernelPreference"
_SCALING = "torchao.prototype.mx_formats.config.ScaleCalculationMode"
_MX_KWARGS = "torchao.prototype.mx_formats.mx_tensor.QuantizeTensorToMXKwargs"
_NVFP4_KWARGS = "torchao.prototype.mx_formats.nvfp4_tensor.QuantizeTensorToNVFP4Kwargs"

#: Enums their attributes use: ``module.QualName`` -> the values a record may name.
_ENUMS: dict[str, frozenset[str]] = {
    _KERNEL: frozenset({"auto", "torch", "mslk", "emulated", "triton"}),
    _SCALING: frozenset({"floor", "rceil", "ceil", "even"}),
}

#: Dataclasses their attributes use; fields in :data:`_ATTRIBUTES`.
_RECORDS: frozenset[str] = frozenset({_MX_KWARGS, _NVFP4_KWARGS})

#: Attribute name -> (kind, optional) per class, as torchao writes them. Kind: ``part`` (inner tensor), ``dtype``,
#: ``elem`` (dtype or format name like ``"fp6_e2m3"``), ``int`` (positive), ``bool``, or an :data:`_ENUMS` /
#: :data:`_RECORDS` label; ``?`` admits ``None``. Non-optional attributes are in every record.
_ATTRIBUTES: dict[str, dict[str, tuple[str, bool]]] = {
    "torchao.prototype.mx_formats.mx_tensor.MXTensor": {
        "qdata": ("part", False), "scale": ("part", False), "elem_dtype": ("elem", False),
        "block_size": ("int", False), "orig_dtype": ("dtype", False), "kernel_preference": (f"{_KERNEL}?", False),
        "act_quant_kwargs": (f"{_MX_KWARGS}?", False), "is_swizzled_scales": ("bool", False)},
    "torchao.prototype.mx_formats.nvfp4_tensor.NVFP4Tensor": {
        "qdata": ("part", False), "scale": ("part", False), "block_size": ("int", False),
        "orig_dtype": ("dtype", False), "per_tensor_scale": ("part?", True), "act_per_tensor_scale": ("part?", True),
        "is_swizzled_scales": ("bool", True), "use_triton_kernel": ("bool", True),
        "act_quant_kwargs": (f"{_NVFP4_KWARGS}?", True)},
    _MX_KWARGS: {"elem_dtype": ("elem", False), "block_size": ("int", False), "scaling_mode": (_SCALING, False),
                 "kernel_preference": (_KERNEL, False), "is_swizzled_scales": ("bool", False)},
    _NVFP4_KWARGS: {"block_size": ("int", False), "is_swizzled_scales": ("bool", False),
                    "use_triton_kernel": ("bool", False), "use_dynamic_per_tensor_scale": ("bool", False)},
}


@dataclass(frozen=True, slots=True)
class SubclassHeader:
    """A tensor subclass record: class (``module.QualName``), outer dtype/shape/strides, inner tensors by name (in
    :data:`SUBCLASSES` order: a :class:`TensorHeader` each in a DCP item, a ``pickle_scan.TensorRef`` in a whole
    file), ``context`` (canonical JSON, see :func:`ckptverify.fingerprint.subclass.canonical`)."""

    cls: str
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    parts: tuple[tuple[str, Any], ...]
    context: str

    @property
    def short_name(self) -> str:
        return self.cls.rsplit(".", 1)[-1]


class _SubclassType(_Global):
    """A tensor subclass global of :data:`SUBCLASSES`: only a value to name the class by."""

    __slots__ = ()


class _EnumValue(_Global):
    """A member of an allowlisted enum, by its value."""

    __slots__ = ("value",)

    def __init__(self, label: str, value: str) -> None:
        super().__init__(label)
        object.__setattr__(self, "value", value)


class _Layout(_Global):
    __slots__ = ()


_STRIDED = _Layout("torch.strided")


def _enum_global(label: str, values: frozenset[str]) -> FrozenGlobal:
    def make(value: Any = None, *rest: Any) -> _EnumValue:
        if rest or type(value) is not str or value not in values:
            raise pickle.UnpicklingError(f"{label} has no member {str(value)[:40]!r}")
        return _EnumValue(label, value)

    return callable_global(_Global, label, make)


def _record_class(label: str) -> type:
    """Stand-in for an allowlisted dataclass: ``NEWOBJ`` makes it empty, one ``BUILD`` fills it, nothing else changes
    it."""

    def __new__(cls: type) -> Any:
        inst = object.__new__(cls)
        object.__setattr__(inst, "fields", None)
        return inst

    def __setstate__(self: Any, state: Any) -> None:
        if self.fields is not None or type(state) is not dict or not all(type(k) is str for k in state):
            raise pickle.UnpicklingError(f"data.pkl sets unexpected state on {label}")
        _check_attributes(label, state, None)
        object.__setattr__(self, "fields", {k: _canonical(v) for k, v in state.items()})

    def __setattr__(self: Any, key: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"data.pkl modifies {label}")

    return type("_Record", (), {"__slots__": ("fields",), "__new__": __new__, "__setstate__": __setstate__,
                                "__setattr__": __setattr__, "label": label})


def _canonical(value: Any) -> Any:
    """An attribute's canonical JSON form (as ``fingerprint.subclass.canonical``); anything not a scalar, dtype, enum
    member or filled record is refused."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is _DType:
        return f"torch.{value.name}"
    if type(value) is _EnumValue:
        return {"enum": value._label, "value": value.value}
    label = getattr(type(value), "label", None)
    if label in _RECORDS and getattr(value, "fields", None) is not None:
        return {"class": label, "fields": value.fields}
    raise pickle.UnpicklingError(f"a tensor subclass attribute of type {type(value).__name__} is not allowed")


def _check_attributes(label: str, state: dict[str, Any], part_type: type | None) -> None:
    """Refuse a ``label`` record whose attributes differ from what torchao writes (unknown, required missing, wrong
    kind per :data:`_ATTRIBUTES`; inner tensors are ``part_type`` records)."""
    kinds = _ATTRIBUTES[label]
    for key, value in state.items():
        if key not in kinds and not (key == "_is_param" and value is True and part_type is not None):
            # ``_is_param``: the mark ``nn.Parameter`` leaves on a subclass it wraps, nothing of the values.
            what = "inner tensor" if part_type is not None and isinstance(value, part_type) else "attribute"
            raise pickle.UnpicklingError(f"{label} has no {what} {key[:40]!r}")
    for key, (kind, optional) in kinds.items():
        if key not in state:
            if optional:
                continue
            raise pickle.UnpicklingError(f"{label} record without its {key!r}")
        if not _is_kind(state[key], kind, part_type):
            raise pickle.UnpicklingError(f"a tensor subclass attribute of type {type(state[key]).__name__} is not "
                                         f"what {label}.{key} holds ({kind.rsplit('.', 1)[-1]})")


def _is_kind(value: Any, kind: str, part_type: type | None) -> bool:
    """Whether ``value``, as the stand-ins resolve it, is of ``kind`` (see :data:`_ATTRIBUTES`)."""
    if kind.endswith("?"):
        if value is None:
            return True
        kind = kind[:-1]
    if kind == "part":
        return part_type is not None and isinstance(value, part_type)
    if kind in ("dtype", "elem"):
        return type(value) is _DType or (kind == "elem" and type(value) is str and 0 < len(value) <= 64)
    if kind == "int":
        return type(value) is int and 0 < value < 1 << 31
    if kind == "bool":
        return type(value) is bool
    if kind in _ENUMS:
        return type(value) is _EnumValue and value._label == kind
    return getattr(type(value), "label", None) == kind and getattr(value, "fields", None) is not None


def subclass_fields(func: Any, new_type: Any, args: Any, state: Any, part_type: type,
                    ) -> tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[tuple[str, Any], ...], str]:
    """Check ``_rebuild_from_type_v2`` arguments for an allowlisted subclass; return class label, outer dtype, size,
    stride, inner tensors (in :data:`SUBCLASSES` order) and canonical attributes. ``pickle.UnpicklingError`` otherwise.
    """
    if func is not _WRAPPER or type(new_type) is not _SubclassType:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than an allowlisted tensor subclass")
    if type(args) is not tuple or len(args) != 8:
        raise pickle.UnpicklingError("malformed wrapper subclass arguments")
    cls, dtype, size, stride, offset, layout, _device, requires_grad = args
    if cls is not new_type or type(dtype) is not _DType or layout is not _STRIDED or type(requires_grad) is not bool:
        raise pickle.UnpicklingError("wrapper subclass arguments name another class, no dtype or another layout")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) > 64 or len(size) != len(stride):
        raise pickle.UnpicklingError("wrapper subclass size or stride is not a short tuple")
    if not all(type(v) is int and 0 <= v < 1 << 63 for v in (offset, *size, *stride)):
        raise pickle.UnpicklingError("wrapper subclass view fields are not small non-negative integers")
    if type(state) is not dict or not all(type(k) is str for k in state):
        raise pickle.UnpicklingError("wrapper subclass state is not a dict of attributes")
    _check_attributes(new_type._label, state, part_type)
    if state["orig_dtype"].name != dtype.name:
        raise pickle.UnpicklingError(f"{new_type._label} of {dtype.name} records another original dtype")
    names = SUBCLASSES[new_type._label]
    parts = tuple((n, state[n]) for n in names if state.get(n) is not None)
    # ``_is_param`` (see _check_attributes) is not among the attributes the live tensor flattens to.
    context = {k: _canonical(v) for k, v in state.items()
               if k not in names and v is not None and not (k == "_is_param" and v is True)}
    text = json.dumps(context, sort_keys=True, separators=(",", ":"))
    return new_type._label, dtype.name, tuple(size), tuple(stride), parts, text


def _rebuild_subclass(func: Any, new_type: Any, args: Any, state: Any) -> SubclassHeader:
    return SubclassHeader(*subclass_fields(func, new_type, args, state, TensorHeader))


_WRAPPER = _Global("torch._utils._rebuild_wrapper_subclass")


def _subclass_globals() -> dict[tuple[str, str], Any]:
    """The tensor allowlist plus what a wrapper subclass record names (see :data:`SUBCLASSES`)."""

    def layout(name: Any = None, *rest: Any) -> _Layout:
        if rest or name != "torch.strided":
            raise pickle.UnpicklingError(f"layout {str(name)[:40]!r} is not torch.strided")
        return _STRIDED

    def device(name: Any = None, *rest: Any) -> str:
        if rest or type(name) is not str or len(name) > 64:
            raise pickle.UnpicklingError("malformed device")
        return name

    allowed = dict(_tensor_globals())
    allowed[("torch._tensor", "_rebuild_from_type_v2")] = callable_global(
        _Global, "torch._tensor._rebuild_from_type_v2", _rebuild_subclass)
    allowed[("torch._utils", "_rebuild_wrapper_subclass")] = _WRAPPER
    allowed[("torch.serialization", "_get_layout")] = callable_global(_Global, "torch.serialization._get_layout",
                                                                      layout)
    allowed[("torch", "device")] = callable_global(_Global, "torch.device", device)
    for label in SUBCLASSES:
        module, name = label.rsplit(".", 1)
        allowed[(module, name)] = _SubclassType(label)
    for label, values in _ENUMS.items():
        module, name = label.rsplit(".", 1)
        allowed[(module, name)] = _enum_global(label, values)
    for label in _RECORDS:
        module, name = label.rsplit(".", 1)
        allowed[(module, name)] = _record_class(label)
    return allowed


_SUBCLASS_GLOBALS: dict[tuple[str, str], Any] | None = None


def subclass_allowlist() -> dict[tuple[str, str], Any]:
    """A new dict of shared stand-ins for what a subclass record names beyond the plain tensor machinery (not the
    rebuild functions or storage types, which each reader resolves its own way)."""
    global _SUBCLASS_GLOBALS
    if _SUBCLASS_GLOBALS is None:
        _SUBCLASS_GLOBALS = _subclass_globals()
    skip = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
            ("collections", "OrderedDict"), ("torch._tensor", "_rebuild_from_type_v2")}
    return {k: v for k, v in _SUBCLASS_GLOBALS.items()
            if k not in skip and not isinstance(v, _StorageType)}


class _ItemHeaderUnpickler(_TensorHeaderUnpickler):
    """:class:`_TensorHeaderUnpickler` over :func:`_subclass_globals`."""

    def __init__(self, data: bytes) -> None:
        global _SUBCLASS_GLOBALS
        if _SUBCLASS_GLOBALS is None:
            _SUBCLASS_GLOBALS = _subclass_globals()
        ReferenceUnpickler.__init__(self, data, _SUBCLASS_GLOBALS, Budget(0, _exceeded, LIMITS))

    def unknown_global(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a tensor record"[:300])


def item_header(data_pkl: bytes) -> TensorHeader | SubclassHeader:
    """A tensor item's ``data.pkl``: a plain header or a :class:`SubclassHeader`; ``pickle.UnpicklingError`` otherwise.
    A record naming no subclass rebuild goes through the plain allowlist."""
    return _pkl_header(data_pkl, b"_rebuild_from_type_v2" in data_pkl)
