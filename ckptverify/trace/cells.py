"""Cell encoders: one trace cell from a tensor, a metric, or any other value.

Tensors by their member digest (bytes on the host, the logical fingerprint on a device, see
:mod:`ckptverify.trace.readback`); metrics by their exact bits; other values by the digest of their JSON text
with sorted keys (:func:`_value_lanes`), or of their state digest when they are not plain data.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.errors import UsageError
from ckptverify.trace.readback import _HOST_AS_DEVICE, _MASK64, Item, _Deferred, _digests_later, _on_host
from ckptverify.trace.sites import _is_dtensor
from ckptverify.trace.store import Cell, hex_lanes

if TYPE_CHECKING:
    import torch

#: Plain values: compared as they are from step to step, and packed as numbers when they are.
_SCALARS = (int, float, bool, str, type(None))

def _encoding(t: Any) -> str:
    """How a tensor's member digest reads: bytes on the host, the logical fingerprint on a device."""
    local = t.to_local() if _is_dtensor(t) else t
    return "digest128" if _on_host(local) else "fp128"


def _tensor_item(site: str, kind: str, t: torch.Tensor, info: str = "") -> Item:
    """:func:`_tensor_cell`, with a tensor on an accelerator read back with the rest of the step."""
    local = t.to_local() if _is_dtensor(t) else t
    if _on_host(local):
        return _tensor_cell(site, kind, t, info)

    def finish(digests: list[int]) -> list[Cell]:
        return [Cell(site, kind, ((digests[0] >> 64), digests[0] & _MASK64), "fp128", info)]

    items = _digests_later([local.detach()], finish)
    return items[0]


def _object_item(site: str, kind: str, obj: Any, info: str = "") -> Item:
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_item(site, kind, obj, info)
    return _object_cell(site, kind, obj, info)


def _tensor_cell(site: str, kind: str, t: torch.Tensor, info: str = "") -> Cell:
    import xxhash

    from ckptverify.trace.category import digest_lanes, host_digest, signature, tensor_digests

    if t.is_cpu and not _HOST_AS_DEVICE and type(t).__name__ in _PLAIN:
        if not t.requires_grad and t.is_contiguous():
            try:  # the common case (a batch, a module output without grad): no copy, no detach
                d = xxhash.xxh3_128_intdigest(t.numpy()) ^ signature(t.dtype, tuple(t.shape))
                return Cell(site, kind, (d >> 64, d & _MASK64), "digest128", info)
            except TypeError:
                pass  # a dtype numpy lacks
        return Cell(site, kind, digest_lanes(host_digest(t)), "digest128", info)
    return Cell(site, kind, digest_lanes(tensor_digests([t])[0]), _encoding(t), info)


#: Tensor types that hold their own values (no DTensor or other subclass that needs unwrapping).
_PLAIN = frozenset({"Tensor", "Parameter", "Buffer"})


def _summary(obj: Any) -> Any:
    """``obj`` with every tensor replaced by its member digest, dtype and shape (for composite digests)."""
    import torch

    from ckptverify.fingerprint import kernels as kern
    from ckptverify.trace.category import tensor_digests

    if isinstance(obj, torch.Tensor):
        return {"digest": f"{tensor_digests([obj])[0]:032x}", "dtype": kern.dtype_name(obj.dtype),
                "shape": list(obj.shape)}
    if isinstance(obj, Mapping):
        return {str(k): _summary(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_summary(v) for v in obj]
    return obj


def _object_cell(site: str, kind: str, obj: Any, info: str = "") -> Cell:
    """A tensor's member digest, or the digest of anything else (:func:`_value_lanes`)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_cell(site, kind, obj, info)
    return Cell(site, kind, _value_lanes(obj), "digest128", info)


def _json_encoder() -> Callable[[Any], str]:
    """JSON text with sorted keys and no spaces. CPython's C encoder is made once and called directly (the
    JSONEncoder front end builds it again at every call, which costs more than encoding a state dict)."""
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    c_encoder = make(None, encoder.default, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True)

    def encode(value: Any) -> str:
        if isinstance(value, str):
            return encoder.encode(value)
        try:
            return "".join(c_encoder(value, 0))
        except RecursionError:
            raise ValueError("nested too deeply") from None

    return encode


_json = _json_encoder()


def _value_lanes(value: Any) -> tuple[int, int]:
    """A digest of a non-tensor value for a trace cell. Plain data (dicts, lists, strings, numbers, ``None``)
    is digested through its JSON text with sorted keys (the C encoder: microseconds for a state dict); anything
    else through :func:`~ckptverify.state.digest.state_digest`, tensors inside by member digest. Traces compare
    values of one configuration with each other, so each field takes the same path in both runs."""
    try:
        text = _json(value)
    except (TypeError, ValueError):
        from ckptverify.state.digest import state_digest

        return hex_lanes(state_digest(_summary(value)))
    d = xxhash.xxh3_128_intdigest(b"J" + text.encode("utf-8", "surrogatepass"))
    return d >> 64, d & _MASK64


def _metric_item(name: str, value: Any) -> Item:
    """:func:`_metric_cell`, with a one-element real tensor on an accelerator widened there (to float64 or
    int64, exactly) and read back with the rest of the step instead of by ``.item()``."""
    import torch

    # The common cases first (a learning rate, a loss or a norm on the host): the cell _metric_cell makes,
    # without its chain of type tests (called for every metric at every step).
    if type(value) is float:
        return Cell.from_float(f"metric.{name}", "metric", value)
    if (type(value) is torch.Tensor and value.dtype.is_floating_point and value.device.type == "cpu"
            and not _HOST_AS_DEVICE and value.numel() == 1):
        return Cell.from_float(f"metric.{name}", "metric", value.item())
    if (type(value) is torch.Tensor and not _on_host(value) and value.numel() == 1 and not value.is_complex()):
        site = f"metric.{name}"
        if value.dtype.is_floating_point:
            bits = value.detach().reshape(1).to(torch.float64).view(torch.int64)

            def make(values: list[int]) -> list[Cell]:
                return [Cell(site, "metric", (values[0] & _MASK64, 0), "f64")]
        else:
            bits = value.detach().reshape(1).to(torch.int64)

            def make(values: list[int]) -> list[Cell]:
                return [Cell(site, "metric", (values[0] & _MASK64, 0), "i64")]
        return _Deferred(bits, make)
    if isinstance(value, torch.Tensor) and not _is_dtensor(value) and value.numel() != 1:
        return _tensor_item(f"metric.{name}", "metric", value)
    return _metric_cell(name, value)


def _metric_cell(name: str, value: Any) -> Cell:
    """A metric's exact value: numbers (and one-element real tensors) by their bits, as float64 or int64 —
    widening any real float dtype to float64 is exact — anything else by member digest or state digest."""
    import numpy as np
    import torch

    site = f"metric.{name}"
    if type(value) is torch.Tensor and value.is_cpu and not value.is_complex() and value.numel() == 1:
        value = value.item()  # the common case: a loss, a norm
    elif isinstance(value, torch.Tensor):
        if _is_dtensor(value) and value.numel() == 1:
            value = value.full_tensor()
        if value.numel() == 1 and not value.is_complex() and not _is_dtensor(value):
            value = value.detach().reshape(()).item()
        else:
            return _tensor_cell(site, "metric", value)
    if isinstance(value, bool | np.bool_ | int | np.integer):
        try:
            return Cell.from_int(site, "metric", int(value))
        except UsageError:
            return _object_cell(site, "metric", int(value))
    if isinstance(value, float | np.floating):
        return Cell.from_float(site, "metric", float(value))
    return _object_cell(site, "metric", value)

