"""The one reader of ``torch.save`` pickles (``data.pkl``): nothing is imported or executed.

A fixed allowlist of shared, immutable stand-ins (rebuild functions, storage types, dtypes, ``torch.Size``,
plain containers; allowlisted tensor subclasses, :data:`SUBCLASSES`, as :class:`SubclassHeader`, nothing of
torchao imported) resolves what the pickle names. Any other global is, by the caller's policy, refused
(:func:`item_header`: a DCP tensor item's record) or an :class:`Opaque` placeholder recording its name and
arguments, never imported or called (:func:`scan_pickle`: a whole file, every tensor by its path).

Read by the pure-Python :class:`~ckptverify.safeparse.unpickler.ReferenceUnpickler`, which bounds every opcode
(memo index, hashed tuples) as it goes: on large pickles it is also faster than the C unpickler behind the
opcode pass that would make the C one safe. Work is bounded by size, :data:`MAX_OBJECTS`, and walks visiting
each object once.
"""

from __future__ import annotations

import functools
import json
import pickle
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ckptverify.errors import BadPickle
from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE, is_row_major, view_extent
from ckptverify.safeparse.unpickler import (
    DTYPE_GLOBALS,
    Budget,
    DTypeGlobal,
    FrozenGlobal,
    Limits,
    ReferenceUnpickler,
    callable_global,
    refuse_build,
    refusing,
)

__all__ = ["MAX_OBJECTS", "MAX_PICKLE_BYTES", "MAX_VALUES", "SUBCLASSES", "Opaque", "PickleScan", "StorageRef",
           "SubclassHeader", "TensorHeader", "item_header", "leaf_values", "scan_pickle"]

#: Largest ``data.pkl`` read.
MAX_PICKLE_BYTES = 256 << 20
#: Most objects (globals resolved, calls, storages, objects walked) one pickle may make.
MAX_OBJECTS = 2_000_000
#: A whole file: hashed tuples at most 200 deep (``hash`` recurses in C without limit) and of bounded expansion;
#: memo indices in order, with slack. A tensor item's record hashes no tuple at all.
LIMITS = Limits(max_depth=200, memo_slack=1024)
ITEM_LIMITS = Limits(max_depth=200, max_key_nodes=0, memo_slack=1024)

#: The legacy typed storage classes ``torch.<Name>Storage`` and their dtypes.
LEGACY_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16",
    "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8", "QUInt8Storage": "quint8", "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage record as the pickle references it: ``dtype`` ``None`` for an untyped storage, whose ``numel`` counts
    bytes."""

    key: str
    dtype: str | None
    numel: int

    __setstate__ = refuse_build


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """A tensor as a pickle records it: its storage record (``storage_numel`` in whole elements) and the view onto it
    (offset in elements). ``dtype`` is ``None`` only in a whole file (:func:`scan_pickle`), for a storage of no known
    dtype (``storage_numel`` then counts bytes)."""

    dtype: str | None
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    __setstate__ = refuse_build

    @property
    def is_row_major(self) -> bool:
        return is_row_major(self.size, self.stride)

    def extent(self) -> int:
        """Elements of the storage this tensor reaches (0 when empty)."""
        return view_extent(self.size, self.stride, self.storage_offset)

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

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __getattr__(self, attr: str) -> Any:
        # Reached only for what a stand-in lacks (a pickle appending to it, say): name the global, not this class.
        raise AttributeError(f"{self.name} is outside the allowlist and not rebuilt, so it has no {attr[:40]!r}")

    def __reduce__(self) -> Any:  # pragma: no cover - never pickled again
        raise TypeError("Opaque stand-ins are not picklable")


def _opaque_class(qual: str) -> type[Opaque]:
    return type("Opaque", (Opaque,), {"name": qual})


@dataclass
class PickleScan:
    """What a pickle holds: tensors by path, allowlisted subclasses by path (their inner tensors are not in
    ``tensors``), the storages they use, and the globals outside the allowlist it named."""

    root: Any
    tensors: dict[str, TensorHeader] = field(default_factory=dict)
    storages: dict[str, StorageRef] = field(default_factory=dict)
    opaque: set[str] = field(default_factory=set)
    subclasses: dict[str, SubclassHeader] = field(default_factory=dict)

    def all_tensors(self) -> list[tuple[str, str | None, TensorHeader]]:
        """Every stored tensor as ``(path, part, ref)``: plain ones (``part`` ``None``), then each subclass's inner
        ones."""
        out: list[tuple[str, str | None, TensorHeader]] = [(p, None, r) for p, r in self.tensors.items()]
        for path, sub in self.subclasses.items():
            out.extend((path, name, ref) for name, ref in sub.parts)
        return out


# ----------------------------------------------------------------------------------- shared stand-ins


def dtype_name(value: Any) -> str | None:
    """The dtype a dtype stand-in names (``float32``), else ``None``."""
    return value.name if type(value) is DTypeGlobal else None


class _StorageType(FrozenGlobal):
    """A storage class global; ``dtype`` is its dtype (``None`` for ``UntypedStorage``)."""

    __slots__ = ("dtype",)

    def __init__(self, label: str, dtype: str | None) -> None:
        super().__init__(label)
        self.dtype = dtype


class _OrderedDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` without its methods beyond ``dict``'s. A state (a ``state_dict``'s
    ``_metadata``) is kept, not walked."""

    __slots__ = ("state",)

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _ordered_dict(*args: Any) -> _OrderedDict:
    # Pickled as a call without arguments, then SETITEMS: pairs given here would be hashed unchecked.
    if args:
        raise BadPickle("collections.OrderedDict called with arguments")
    return _OrderedDict()


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise BadPickle("_codecs.encode outside the bytes-in-protocol-2 form")
    return text.encode("latin1")


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
    :data:`SUBCLASSES` order, a :class:`TensorHeader` each),
    ``context`` (canonical JSON, see :func:`ckptverify.fingerprint.subclass.canonical`)."""

    cls: str
    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    parts: tuple[tuple[str, Any], ...]
    context: str

    __setstate__ = refuse_build

    @property
    def short_name(self) -> str:
        return self.cls.rsplit(".", 1)[-1]


class _SubclassType(FrozenGlobal):
    """A tensor subclass global of :data:`SUBCLASSES`: only a value to name the class by."""

    __slots__ = ()


class _EnumValue(FrozenGlobal):
    """A member of an allowlisted enum, by its value."""

    __slots__ = ("value",)

    def __init__(self, label: str, value: str) -> None:
        super().__init__(label)
        self.value = value


_STRIDED = FrozenGlobal("torch.strided")  # the one layout ``_get_layout`` resolves


def _enum_global(label: str, values: frozenset[str]) -> FrozenGlobal:
    def make(value: Any = None, *rest: Any) -> _EnumValue:
        if rest or type(value) is not str or value not in values:
            raise BadPickle(f"{label} has no member {str(value)[:40]!r}")
        return _EnumValue(label, value)

    return callable_global(label, make)


def _record_class(label: str) -> type:
    """Stand-in for an allowlisted dataclass: ``NEWOBJ`` makes it empty, one ``BUILD`` fills it, nothing else changes
    it."""

    def __new__(cls: type) -> Any:
        inst = object.__new__(cls)
        inst.fields = None
        return inst

    def __setstate__(self: Any, state: Any) -> None:
        if self.fields is not None or type(state) is not dict or not all(type(k) is str for k in state):
            raise BadPickle(f"data.pkl sets unexpected state on {label}")
        _check_attributes(label, state, None)
        self.fields = {k: _canonical(v) for k, v in state.items()}

    return type("_Record", (), {"__slots__": ("fields",), "__new__": __new__, "__setstate__": __setstate__,
                                "label": label})


def _canonical(value: Any) -> Any:
    """An attribute's canonical JSON form (as ``fingerprint.subclass.canonical``); anything not a scalar, dtype, enum
    member or filled record is refused."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is DTypeGlobal:
        return f"torch.{value.name}"
    if type(value) is _EnumValue:
        return {"enum": value._label, "value": value.value}
    label = getattr(type(value), "label", None)
    if label in _RECORDS and getattr(value, "fields", None) is not None:
        return {"class": label, "fields": value.fields}
    raise BadPickle(f"a tensor subclass attribute of type {_type_name(value)} is not allowed")


def _type_name(value: Any) -> str:
    """The type a value stands for: the global's name for an :class:`Opaque` stand-in."""
    return value.name if isinstance(value, Opaque) else type(value).__name__


def _check_attributes(label: str, state: dict[str, Any], part_type: type | None) -> None:
    """Refuse a ``label`` record whose attributes differ from what torchao writes (unknown, required missing, wrong
    kind per :data:`_ATTRIBUTES`; inner tensors are ``part_type`` records)."""
    kinds = _ATTRIBUTES[label]
    for key, value in state.items():
        if key not in kinds and not (key == "_is_param" and value is True and part_type is not None):
            # ``_is_param``: the mark ``nn.Parameter`` leaves on a subclass it wraps, nothing of the values.
            what = "inner tensor" if part_type is not None and isinstance(value, part_type) else "attribute"
            raise BadPickle(f"{label} has no {what} {key[:40]!r}")
    for key, (kind, optional) in kinds.items():
        if key not in state and not optional:
            raise BadPickle(f"{label} record without its {key!r}")
        if key in state and not _is_kind(state[key], kind, part_type):
            raise BadPickle(f"a tensor subclass attribute of type {_type_name(state[key])} is not "
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
        return type(value) is DTypeGlobal or (kind == "elem" and type(value) is str and 0 < len(value) <= 64)
    if kind == "int":
        return type(value) is int and 0 < value < 1 << 31
    if kind == "bool":
        return type(value) is bool
    if kind in _ENUMS:
        return type(value) is _EnumValue and value._label == kind
    return getattr(type(value), "label", None) == kind and getattr(value, "fields", None) is not None


def _allowlist() -> dict[tuple[str, str], Any]:
    """Every global a ``torch.save`` pickle may name -> its shared stand-in. The tensor rebuilds, the subclass
    rebuild and the layout lookup are the reader's own (:data:`_READER_GLOBALS`)."""

    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_wrapper_subclass"): _WRAPPER,
        # A device (a subclass record names one; so does a Lightning hyperparameter) stays an inert placeholder,
        # not reported as uninterpreted.
        ("torch", "device"): _opaque_class("torch.device"),
        ("torch.storage", "UntypedStorage"): _StorageType("torch.storage.UntypedStorage", None),
        ("torch", "UntypedStorage"): _StorageType("torch.UntypedStorage", "uint8"),
        ("torch", "Size"): callable_global("torch.Size", lambda dims=(): tuple(dims)),
        ("collections", "OrderedDict"): callable_global("collections.OrderedDict", _ordered_dict),
        ("_codecs", "encode"): callable_global("_codecs.encode", _encode),
    }
    for name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        allowed[("torch._utils", name)] = callable_global(f"torch._utils.{name}", lambda data, *rest: data)
    for name in ("set", "frozenset"):
        allowed[("builtins", name)] = callable_global(f"builtins.{name}", lambda items=(): list(items))
    allowed.update(DTYPE_GLOBALS)
    for cls, dtype in LEGACY_STORAGE_DTYPES.items():  # after the dtypes: a storage name is never a dtype name
        allowed[("torch", cls)] = _StorageType(f"torch.{cls}", dtype)
    torchao = [*((label, _SubclassType(label)) for label in SUBCLASSES), *((label, _record_class(label)) for label in
               _RECORDS), *((label, _enum_global(label, values)) for label, values in _ENUMS.items())]
    allowed.update((tuple(label.rsplit(".", 1)), stand_in) for label, stand_in in torchao)
    return allowed


_WRAPPER = FrozenGlobal("torch._utils._rebuild_wrapper_subclass")
_ALLOWED = _allowlist()
#: Globals the reader resolves to its own methods (they record storages and tensors, and follow the policy).
_READER_GLOBALS = {
    ("torch._utils", "_rebuild_tensor"): "_rebuild_tensor",
    ("torch._utils", "_rebuild_tensor_v2"): "_rebuild_tensor",
    ("torch._utils", "_rebuild_tensor_v3"): "_rebuild_tensor_v3",
    ("torch._tensor", "_rebuild_from_type_v2"): "_rebuild_from_type",
    ("torch.serialization", "_get_layout"): "_get_layout",
}


class _Reader(ReferenceUnpickler):
    """The reference unpickler over the allowlist. ``opaque``: a global outside it becomes an :class:`Opaque` class
    (else it is refused). Every global, storage and tensor is charged to the budget."""

    what = "data.pkl"

    def __init__(self, data: bytes, scan: PickleScan, budget: Budget, opaque: bool) -> None:
        super().__init__(data, _ALLOWED, budget)
        self.scan = scan
        self.opaque = opaque
        self._classes: dict[str, type[Opaque]] = {}

    def find_class(self, module: str, name: str) -> Any:
        self._budget.charge()
        own = _READER_GLOBALS.get((module, name))
        return getattr(self, own) if own is not None else super().find_class(module, name)

    def unknown_global(self, module: str, name: str) -> Any:
        qual = f"{module}.{name}"
        if not self.opaque:
            raise BadPickle(f"{qual} is not part of a tensor record"[:300])
        self.scan.opaque.add(qual)
        if qual not in self._classes:
            self._classes[qual] = _opaque_class(qual)
        return self._classes[qual]

    def persistent_load(self, pid: Any) -> Any:
        self._budget.charge()
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise BadPickle("a persistent reference that is not a torch storage")
        _, kind, key, _location, numel = pid
        if type(kind) is not _StorageType and not self.opaque:
            raise BadPickle("a storage reference without a storage type")
        dtype = kind.dtype if type(kind) is _StorageType else None
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise BadPickle("a storage reference with a bad key or size")
        ref = self.scan.storages.get(key)
        if ref is None:
            ref = StorageRef(key, dtype, numel)
            self.scan.storages[key] = ref
        elif ref.dtype != dtype:
            # One record read as two storage types would be sized two ways; torch.save never writes that.
            raise BadPickle(f"storage {key[:40]!r} is referenced with two different types")
        return ref

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
        return self._tensor(storage, offset, size, stride, None)

    def _rebuild_tensor_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = None,
                           hooks: Any = None, dtype: Any = None, *rest: Any) -> Any:
        """As v2, with the element dtype given (over an untyped storage, sized in bytes)."""
        name = dtype_name(dtype)  # every dtype stand-in names one of DTYPE_ITEMSIZE
        if name is None:
            raise BadPickle("_rebuild_tensor_v3 without a dtype")
        return self._tensor(storage, offset, size, stride, name)

    def _tensor(self, storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None) -> Any:
        """A :class:`TensorHeader` over ``storage``; ``dtype``: the element dtype v3 names (else the storage's)."""
        self._budget.charge()
        if not isinstance(storage, StorageRef):
            if not self.opaque:
                raise BadPickle("tensor without a storage or dtype")
            return _opaque_class("torch._utils._rebuild_tensor_v2 (not over a storage)")()
        if type(offset) is not int or not isinstance(size, tuple | list) or not isinstance(stride, tuple | list):
            raise BadPickle("a tensor with a bad offset, shape or stride")
        shape, strides = tuple(size), tuple(stride)
        # Below 2**63: a LONG4 can carry millions of digits, and the extent multiplies them.
        if len(shape) != len(strides) or len(shape) > 64 or not all(
                type(v) is int and 0 <= v < 1 << 63 for v in (*shape, *strides, offset)):
            raise BadPickle("a tensor with a bad offset, shape or stride")
        if dtype is not None and storage.dtype is not None and storage.dtype != dtype:
            raise BadPickle(f"a {dtype} tensor over a {storage.dtype} storage")
        numel = storage.numel
        if dtype is not None and storage.dtype is None:
            # torch.save writes dtypes without a legacy typed storage (uint16/32/64, complex32, float8, ...)
            # as an UntypedStorage, whose size is counted in bytes.
            if numel % DTYPE_ITEMSIZE[dtype] and not self.opaque:
                raise BadPickle(f"untyped storage of {numel} bytes does not hold whole {dtype} elements")
            numel //= DTYPE_ITEMSIZE[dtype]
        dtype = dtype or storage.dtype
        if dtype is None and not self.opaque:
            raise BadPickle("tensor without a storage or dtype")
        return TensorHeader(dtype, storage.key, numel, offset, shape, strides)

    def _rebuild_from_type(self, func: Any, new_type: Any, args: Any, state: Any = None, *rest: Any) -> Any:
        """``_rebuild_from_type_v2``: a :class:`SubclassHeader` for an allowlisted subclass (malformed: refused), else
        an inert :class:`Opaque` (nothing is called) or, refusing, a refusal."""
        self._budget.charge()
        label = getattr(new_type, "_label", None)
        if label not in SUBCLASSES and self.opaque:
            return self.unknown_global("torch._tensor", "_rebuild_from_type_v2")(func, new_type, args, state, *rest)
        if rest:
            raise BadPickle(f"a {label} record with extra arguments")
        if func is not _WRAPPER or type(new_type) is not _SubclassType:
            raise BadPickle("_rebuild_from_type_v2 of something other than an allowlisted tensor subclass")
        if type(args) is not tuple or len(args) != 8:
            raise BadPickle("malformed wrapper subclass arguments")
        cls, dtype, size, stride, offset, layout, _device, requires_grad = args
        if (cls is not new_type or type(dtype) is not DTypeGlobal or layout is not _STRIDED
                or type(requires_grad) is not bool):
            raise BadPickle("wrapper subclass arguments name another class, no dtype or another layout")
        if (not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) > 64
                or len(size) != len(stride)):
            raise BadPickle("wrapper subclass size or stride is not a short tuple")
        if not all(type(v) is int and 0 <= v < 1 << 63 for v in (offset, *size, *stride)):
            raise BadPickle("wrapper subclass view fields are not small non-negative integers")
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise BadPickle("wrapper subclass state is not a dict of attributes")
        _check_attributes(label, state, TensorHeader)
        if state["orig_dtype"].name != dtype.name:
            raise BadPickle(f"{label} of {dtype.name} records another original dtype")
        names = SUBCLASSES[label]
        parts = tuple((n, state[n]) for n in names if state.get(n) is not None)
        # ``_is_param`` (see _check_attributes) is not among the attributes the live tensor flattens to.
        context = {k: _canonical(v) for k, v in state.items()
                   if k not in names and v is not None and not (k == "_is_param" and v is True)}
        text = json.dumps(context, sort_keys=True, separators=(",", ":"))
        return SubclassHeader(label, dtype.name, tuple(size), tuple(stride), parts, text)

    def _get_layout(self, *args: Any) -> Any:
        if args == ("torch.strided",):
            return _STRIDED
        if not self.opaque:
            raise BadPickle(f"layout {str(args[0] if args else None)[:40]!r} is not torch.strided")
        return self.unknown_global("torch.serialization", "_get_layout")(*args)


def _budget(max_objects: int, limits: Limits) -> Budget:
    return Budget(max_objects, f"the pickle builds more than {max_objects} objects; refused (a decompression bomb, "
                  "or not a checkpoint)", limits)


def scan_pickle(data: bytes, *, max_objects: int = MAX_OBJECTS) -> PickleScan:
    """Unpickle ``data`` into inert stand-ins (a global outside the allowlist: an :class:`Opaque`, named in
    ``opaque``) and list its tensors; raises :class:`BadPickle`."""
    if len(data) > MAX_PICKLE_BYTES:
        raise BadPickle(f"data.pkl is {len(data)} bytes, more than this tool reads ({MAX_PICKLE_BYTES})")
    scan = PickleScan(root=None)
    budget = _budget(max_objects, LIMITS)
    with refusing():
        scan.root = _Reader(data, scan, budget, opaque=True).load()
    _walk(scan, budget)
    return scan


def item_header(data_pkl: bytes) -> TensorHeader | SubclassHeader:
    """A DCP tensor item's ``data.pkl``: a :class:`TensorHeader`, or a :class:`SubclassHeader` whose parts are
    :class:`TensorHeader` s; ``pickle.UnpicklingError`` for anything else (a global outside the allowlist is
    refused, no tuple may be hashed). Small records are cached by their bytes (one per dtype and shape)."""
    if len(data_pkl) <= _CACHED_HEADER_BYTES:
        return _read_header(bytes(data_pkl))
    return _read_header.__wrapped__(data_pkl)


_CACHED_HEADER_BYTES = 4096


@functools.lru_cache(maxsize=2048)
def _read_header(data_pkl: bytes) -> TensorHeader | SubclassHeader:
    try:
        with refusing():
            obj = _Reader(data_pkl, PickleScan(root=None), _budget(MAX_OBJECTS, ITEM_LIMITS), opaque=False).load()
    except BadPickle as exc:  # a record's callers expect what the C unpickler raises, as torch.load does
        raise pickle.UnpicklingError(str(exc)) from None
    if isinstance(obj, TensorHeader | SubclassHeader):
        return obj
    raise pickle.UnpicklingError(f"data.pkl holds {type(obj).__name__}, not a tensor")


def _key(k: Any) -> str:
    """A dict key as a path component; a dtype key as it read before dtypes had stand-ins of their own."""
    name = dtype_name(k)
    return str(k) if name is None else str(("dtype", name))


def _push_entries(stack: list[tuple[str, Any]], path: str, obj: Any) -> bool:
    """Push the entries of a dict, list or tuple by their paths, last first (so they pop in order); whether it is one.
    """
    if isinstance(obj, dict):
        entries, name = obj.items(), _key
    elif isinstance(obj, list | tuple):
        entries, name = enumerate(obj), str
    else:
        return False
    prefix = f"{path}." if path else ""
    stack.extend(reversed([(prefix + name(k), v) for k, v in entries]))
    return True


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
        if isinstance(obj, TensorHeader):
            scan.tensors.setdefault(path or "<root>", obj)
        elif isinstance(obj, SubclassHeader):
            scan.subclasses.setdefault(path or "<root>", obj)  # its inner tensors are its parts, not tensors
        elif not _push_entries(stack, path, obj) and isinstance(obj, Opaque):
            stack.append((path, obj.state))
            stack.append((path, obj.args))


#: Most plain values :func:`leaf_values` lists from one object tree.
MAX_VALUES = 200_000


def leaf_values(root: Any, *, prefix: str = "") -> dict[str, str]:
    """Every plain value of an object tree by path, as an exact canonical string (``int:4``; ``-0.0`` != ``0.0``).
    Tensors are not values; an :class:`Opaque` contributes ``<path>.__class__`` and its arguments/state. Each object
    is visited once; values past :data:`MAX_VALUES` are left out."""
    out: dict[str, str] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, root)]
    while stack and len(out) < MAX_VALUES:
        path, obj = stack.pop()
        if isinstance(obj, TensorHeader | StorageRef | SubclassHeader):
            continue
        name = dtype_name(obj)
        if name is not None:
            out[path or "<root>"] = f"dtype:{name}"  # a torch dtype, as the unpickler resolved it
            continue
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes | bytearray):
            out[path or "<root>"] = _value(obj)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj) is _StorageType:
            out[path or "<root>"] = f"storage-type:{obj.dtype}"  # a storage type, as the unpickler resolved it
        elif not _push_entries(stack, path, obj) and isinstance(obj, Opaque):
            out[f"{path}.__class__" if path else "__class__"] = f"global:{obj.name}"
            stack.append((f"{path}.state" if path else "state", obj.state))
            stack.append((f"{path}.args" if path else "args", obj.args))
    return out


def _value(obj: Any) -> str:
    """A plain value as an exact string; long strings and bytes by their length and digest."""
    text = f"{type(obj).__name__}:{obj!r}"
    if len(text) <= 512:
        return text
    raw = obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else bytes(obj)
    return f"{type(obj).__name__}[{len(obj)}]:xxh3-128:{xxhash.xxh3_128_hexdigest(raw)}"
