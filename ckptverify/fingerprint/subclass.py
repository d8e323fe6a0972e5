"""Tensor subclasses that hold their values in inner tensors (torchao's ``MXTensor`` and ``NVFP4Tensor``,
Transformer Engine's storages): fingerprinted by their parts (see ``docs/fingerprint.md``).

A wrapper subclass has no bytes of its own: ``__tensor_flatten__`` names the inner tensors that hold its
values (for a block-scaled format, the encoded data ``qdata`` and the ``scale``; for NVFP4 also an optional
per-tensor scale) and gives the attributes that say how to read them (block size, element dtype, whether the
scales are swizzled, ...). Its fingerprint is the digest of

* the class (``module.QualName``), the outer dtype and shape,
* its **context**: every attribute of ``__tensor_flatten__``'s context that is not ``None``, in the canonical
  JSON form of :func:`canonical` (the same form the checkpoint reader builds from a stored record without
  importing the class, :mod:`ckptverify.safeparse.torchsave`),
* each inner tensor's name and logical fingerprint (value, dtype, shape), in the order ``__tensor_flatten__``
  names them.

So two tensors with equal data and different scales differ, and so do two with equal parts and a different
block size. :func:`combine_parts` is that digest; the fingerprint of each part comes from
:mod:`ckptverify.fingerprint.logical` (which calls this module, never the other way round). Importing this
module imports no torch.
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

__all__ = ["Flattened", "canonical", "class_label", "combine_parts", "flatten", "is_wrapper_subclass"]

#: Tensor types that hold their own values (nothing to flatten).
_PLAIN = frozenset({"Tensor", "Parameter", "Buffer"})

#: Subclasses with ``__tensor_flatten__`` that are not taken apart: an async collective's result must be waited
#: for (any op on it waits; its inner buffer may still be in flight).
_NOT_TAKEN_APART = frozenset({"torch.distributed._functional_collectives.AsyncCollectiveTensor"})


def class_label(cls: type) -> str:
    """``module.QualName`` of a class: how a fingerprint and a stored record name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def is_wrapper_subclass(t: Any) -> bool:
    """Whether ``t`` is a tensor subclass fingerprinted by its parts (not a plain tensor, not a ``DTensor``,
    whose fingerprint is collective, see :func:`~ckptverify.fingerprint.tensor_fingerprint`, not an async
    collective's pending result)."""
    cls = type(t)
    if cls.__name__ in _PLAIN and cls.__module__.startswith("torch"):
        return False
    if getattr(cls, "__tensor_flatten__", None) is None or class_label(cls) in _NOT_TAKEN_APART:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is None or not isinstance(t, dtensor)


def canonical(value: Any) -> Any:
    """The canonical JSON form of one attribute of a subclass's flatten context.

    ``None``, booleans, integers, floats and strings stay as they are; a torch dtype is ``"torch.NAME"``; an
    enum member is ``{"enum": "module.QualName", "value": its value}``; a list or tuple is a list; a dict (string
    keys) a dict; a dataclass instance ``{"class": "module.QualName", "fields": {name: canonical(value)}}``.
    Anything else raises :class:`~ckptverify.errors.UsageError` (the fingerprint cannot say what it is)."""
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
    """A wrapper subclass taken apart: its class label, its context (canonical, ``None`` values left out) and
    its inner tensors by name, in ``__tensor_flatten__``'s order."""

    label: str
    context: dict[str, Any]
    parts: tuple[tuple[str, torch.Tensor], ...]


def flatten(t: torch.Tensor, *, strict: bool = True) -> Flattened:
    """Take ``t`` (a wrapper subclass, :func:`is_wrapper_subclass`) apart through ``__tensor_flatten__``.

    ``strict``: an attribute without a canonical form raises :class:`~ckptverify.errors.UsageError` (a
    fingerprint must not pretend to cover it); otherwise it stands as ``{"type": "module.QualName"}`` (a trace,
    which must not stop a training run, still covers every part and every other attribute)."""
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
    """The fingerprint value (32 hex digits) of a subclass from its parts' fingerprints (each a
    :class:`~ckptverify.fingerprint.TensorFingerprint`: its ``value``, ``dtype`` and ``shape`` count): xxh3-128
    of the canonical JSON text of the class label, outer dtype and shape, context and parts."""
    text = json.dumps({
        "class": label,
        "dtype": dtype,
        "shape": [int(s) for s in shape],
        "context": context,
        "parts": [[name, fp.value, fp.dtype, list(fp.shape)] for name, fp in parts],
    }, sort_keys=True, separators=(",", ":"))
    return f"{xxhash.xxh3_128_intdigest(b'S' + text.encode()):032x}"
