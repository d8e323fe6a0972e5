"""Wrapper tensor subclasses (torchao's ``MXTensor``, ``NVFP4Tensor``, Transformer Engine's): fingerprinted by parts.

Such a tensor has no bytes of its own; ``__tensor_flatten__`` names its inner tensors and attributes. Its
fingerprint (:func:`combine_parts`) digests the class, outer dtype and shape, the non-``None`` context in
:func:`canonical` form (as :mod:`ckptverify.safeparse.torchsave` rebuilds it from a stored record), and each
part's name and logical fingerprint in flatten order: equal data with different scales or block size differ.
No torch import; :mod:`ckptverify.fingerprint.logical` calls this module, never the reverse.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["Flattened", "canonical", "class_label", "combine_parts", "dtensor_type", "flatten", "is_wrapper_subclass"]

#: Tensor types that hold their own values (nothing to flatten).
_PLAIN = frozenset({"Tensor", "Parameter", "Buffer"})

#: Not taken apart: an async collective's result (its inner buffer may still be in flight).
_NOT_TAKEN_APART = frozenset({"torch.distributed._functional_collectives.AsyncCollectiveTensor"})


def class_label(cls: type) -> str:
    """``module.QualName`` of a class: how a fingerprint and a stored record name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def is_wrapper_subclass(t: Any) -> bool:
    """Whether ``t`` is fingerprinted by its parts (not plain, not a ``DTensor``, not a pending async collective)."""
    cls = type(t)
    if cls.__name__ in _PLAIN and cls.__module__.startswith("torch"):
        return False
    if getattr(cls, "__tensor_flatten__", None) is None or class_label(cls) in _NOT_TAKEN_APART:
        return False
    dtensor = dtensor_type()
    return dtensor is None or not isinstance(t, dtensor)


def dtensor_type() -> type | None:
    """``DTensor``, if its module is loaded (a tensor cannot be a DTensor otherwise)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def canonical(value: Any) -> Any:
    """The canonical JSON form of one context attribute: scalars as they are, a dtype ``"torch.NAME"``, an enum
    ``{"enum", "value"}``, lists/tuples as lists, string-keyed dicts, dataclasses ``{"class", "fields"}``. Anything else
    raises :class:`~ckptverify.errors.UsageError`."""
    import torch

    if value is None or (isinstance(value, bool | int | float | str) and not isinstance(value, enum.Enum)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return {"enum": class_label(type(value)), "value": canonical(value.value)}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: canonical(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"class": class_label(type(value)),
                "fields": {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise UsageError(f"a tensor subclass attribute of type {type(value).__name__} has no canonical form")


@dataclass(frozen=True)
class Flattened:
    """A wrapper subclass taken apart: class label, canonical context (``None`` left out), inner tensors in order."""

    label: str
    context: dict[str, Any]
    parts: tuple[tuple[str, torch.Tensor], ...]


def flatten(t: torch.Tensor, *, strict: bool = True) -> Flattened:
    """Take wrapper subclass ``t`` apart via ``__tensor_flatten__``. ``strict``: an attribute without a canonical form
    raises :class:`~ckptverify.errors.UsageError`; otherwise it stands as ``{"type": ...}`` (a trace must not stop)."""
    names, ctx = t.__tensor_flatten__()
    if ctx is None:
        ctx = {}
    if not isinstance(ctx, dict):
        # Subclasses outside torchao may give any context: its canonical form under one key.
        ctx = {"context": ctx}
    context = {}
    for k, v in ctx.items():
        if v is None:
            continue
        try:
            context[str(k)] = canonical(v)
        except UsageError:
            if strict:
                raise
            context[str(k)] = {"type": class_label(type(v))}
    parts = tuple((str(name), getattr(t, name)) for name in names)
    return Flattened(class_label(type(t)), context, parts)


def combine_parts(label: str, dtype: str, shape: Sequence[int], context: dict[str, Any],
                  parts: Sequence[tuple[str, Any]]) -> str:
    """A subclass's fingerprint value: xxh3-128 of the canonical JSON of label, outer dtype, shape, context and parts.
    """
    text = json.dumps({
        "class": label,
        "dtype": dtype,
        "shape": [int(s) for s in shape],
        "context": context,
        "parts": [[name, fp.value, fp.dtype, list(fp.shape)] for name, fp in parts],
    }, sort_keys=True, separators=(",", ":"))
    return f"{xxhash.xxh3_128_intdigest(b'S' + text.encode()):032x}"
