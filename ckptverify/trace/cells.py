"""Cell encoders: one trace cell from a tensor (member digest, :mod:`ckptverify.trace.readback`), a metric (exact
bits), or any other value (digest of its sorted-key JSON, or its state digest when not plain data); a category's
cells from its members' digests."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ckptverify.errors import UsageError
from ckptverify.fingerprint.spec import MASK64 as _MASK64
from ckptverify.state.digest import state_digest
from ckptverify.trace import category
from ckptverify.trace.category import combine, digest_lanes, host_digest, signature
from ckptverify.trace.readback import _HOST_AS_DEVICE, _PLAIN_TYPES, Item, _Deferred, _digests_later, _on_host
from ckptverify.trace.sites import is_dtensor, local_view
from ckptverify.trace.store import Cell, bits_float, hex_lanes

if TYPE_CHECKING:
    import torch

_SCALARS = (int, float, bool, str, type(None))

def _tensor_item(site: str, kind: str, t: torch.Tensor, info: str = "") -> Item:
    """:func:`_tensor_cell`, with a tensor on an accelerator read back with the rest of the step."""
    local = local_view(t)
    if _on_host(local):
        return _tensor_cell(site, kind, t, info)

    def finish(digests: list[int]) -> list[Cell]:
        return [Cell(site, kind, digest_lanes(digests[0]), "fp128", info)]

    return _digests_later([local.detach()], finish)[0]


def _tensor_cell(site: str, kind: str, t: torch.Tensor, info: str = "") -> Cell:
    if t.is_cpu and not _HOST_AS_DEVICE and type(t).__name__ in _PLAIN_TYPES:
        if not t.requires_grad and t.is_contiguous():
            try:  # the common case (a batch, a module output without grad): no copy, no detach
                d = xxhash.xxh3_128_intdigest(t.numpy()) ^ signature(t.dtype, tuple(t.shape))
                return Cell(site, kind, digest_lanes(d), "digest128", info)
            except TypeError:
                pass  # a dtype numpy lacks
        return Cell(site, kind, digest_lanes(host_digest(t)), "digest128", info)
    # A tensor's member digest reads as bytes on the host, as its logical fingerprint on a device.
    encoding = "digest128" if _on_host(local_view(t)) else "fp128"
    return Cell(site, kind, digest_lanes(category.tensor_digests([t])[0]), encoding, info)


def _category_cells(group: str, kind: str, names: list[str], weights: list[int], encodings: list[str],
                    digests: list[int], detail: str,
                    lanes: Callable[[int], tuple[int, int]] = digest_lanes) -> list[Cell]:
    """One cell per member at detail ``tensor`` (its lanes: ``lanes`` of its digest), then the category cell."""
    cells: list[Cell] = []
    if detail == "tensor":
        cells = [Cell(n, kind, lanes(d), e, "", group) for n, d, e in zip(names, digests, encodings, strict=True)]
    cells.append(Cell(group, kind, combine(digests, weights), "set128"))
    return cells


def _tensor_leaves(obj: Any, out: list[Any]) -> list[Any]:
    """The tensors in ``obj`` (through mappings' values and sequences' items), in walk order."""
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _tensor_leaves(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _tensor_leaves(v, out)
    return out


def _value_item(site: str, kind: str, obj: Any, info: str = "") -> Item:
    """:func:`_object_cell` of what a module hook or a batch holds, with device tensors digested there in one pass and
    read back with the step (a read per hook call would be thousands of syncs a step); same cell either way."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_item(site, kind, obj, info)
    leaves = _tensor_leaves(obj, [])
    if not leaves or all(_on_host(t) for t in leaves) or any(is_dtensor(t) for t in leaves):
        return _object_cell(site, kind, obj, info)

    skeleton = _skeleton(obj)

    def finish(digests: list[int]) -> list[Cell]:
        summary = _filled(skeleton, iter(digests))
        return [Cell(site, kind, hex_lanes(state_digest(summary)), "digest128", info)]

    return _digests_later([t.detach() for t in leaves], finish)[0]


def _skeleton(obj: Any) -> Any:
    """``obj`` as :func:`_tensor_leaves` walks it, each tensor a tuple ``(dtype, shape)``, its digest to come (no other
    tuple is left: sequences become lists)."""
    import torch

    from ckptverify.fingerprint.eager import dtype_name

    if isinstance(obj, torch.Tensor):
        return dtype_name(obj.dtype), list(obj.shape)
    if isinstance(obj, Mapping):
        return {str(k): _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_skeleton(v) for v in obj]
    return obj


def _filled(skeleton: Any, digests: Any) -> Any:
    """``skeleton``'s object with every tensor replaced by its member digest (taken from ``digests`` in walk order),
    dtype and shape: what a composite value's digest is taken of."""
    if type(skeleton) is tuple:
        return {"digest": f"{next(digests):032x}", "dtype": skeleton[0], "shape": skeleton[1]}
    if isinstance(skeleton, dict):
        return {k: _filled(v, digests) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_filled(v, digests) for v in skeleton]
    return skeleton


def _object_cell(site: str, kind: str, obj: Any, info: str = "") -> Cell:
    """A tensor's member digest, or the digest of anything else (:func:`_value_lanes`)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_cell(site, kind, obj, info)
    return Cell(site, kind, _value_lanes(obj), "digest128", info)


def _json_encoder() -> Callable[[Any], str]:
    """JSON text with sorted keys, no spaces. CPython's C encoder is built once and called directly (``JSONEncoder``
    rebuilds it per call, costing more than encoding a state dict)."""
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
    """Digest of a non-tensor value: plain data through its sorted-key JSON, anything else through
    :func:`~ckptverify.state.digest.state_digest`. Both runs take the same path per field, so the digests compare."""
    try:
        text = _json(value)
    except (TypeError, ValueError):
        digests = category.tensor_digests(_tensor_leaves(value, []))
        return hex_lanes(state_digest(_filled(_skeleton(value), iter(digests))))
    d = xxhash.xxh3_128_intdigest(b"J" + text.encode("utf-8", "surrogatepass"))
    return digest_lanes(d)


def _scaler_item(site: str, kind: str, scaler: Any) -> Item:
    """The loss scaler's cell: digest of its ``state_dict()``. A ``GradScaler`` on a device is read with the step
    (widened exactly) instead of by ``state_dict()``'s two ``.item()`` syncs; the cell is the same."""
    import torch

    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if (not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled() or scale is None or tracker is None
            or _on_host(scale) or scale.device != tracker.device):
        return Cell(site, kind, _value_lanes(scaler.state_dict()), "digest128")
    bits = torch.cat([scale.detach().reshape(1).to(torch.float64).view(torch.int64),
                      tracker.detach().reshape(1).to(torch.int64)])
    rest = {"growth_factor": scaler._growth_factor, "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval}

    def make(values: list[int]) -> list[Cell]:
        state = {"scale": bits_float(values[0]), **rest, "_growth_tracker": int(values[1])}
        return [Cell(site, kind, _value_lanes(state), "digest128")]

    return _Deferred(bits, make)


def _metric_item(name: str, value: Any) -> Item:
    """:func:`_metric_cell`, but a one-element real device tensor is widened exactly on the device and read back with
    the step instead of by ``.item()``."""
    import torch

    # Fast path for host floats: same cell as _metric_cell, without its type tests (every metric, every step).
    if type(value) is float:
        return Cell.from_float(f"metric.{name}", "metric", value)
    if (type(value) is torch.Tensor and value.dtype.is_floating_point and value.device.type == "cpu"
            and not _HOST_AS_DEVICE and value.numel() == 1):
        return Cell.from_float(f"metric.{name}", "metric", value.item())
    if (type(value) is torch.Tensor and not _on_host(value) and value.numel() == 1 and not value.is_complex()):
        site, floating = f"metric.{name}", value.dtype.is_floating_point
        bits = value.detach().reshape(1).to(torch.float64 if floating else torch.int64).view(torch.int64)

        def make(values: list[int]) -> list[Cell]:
            return [Cell(site, "metric", (values[0] & _MASK64, 0), "f64" if floating else "i64")]

        return _Deferred(bits, make)
    if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.numel() != 1:
        return _tensor_item(f"metric.{name}", "metric", value)
    return _metric_cell(name, value)


def _metric_cell(name: str, value: Any) -> Cell:
    """A metric's exact value: numbers and one-element real tensors by their bits as float64/int64 (widening is
    exact), anything else by member or state digest."""
    import torch

    site = f"metric.{name}"
    if type(value) is torch.Tensor and value.is_cpu and not value.is_complex() and value.numel() == 1:
        value = value.item()  # the common case: a loss, a norm
    elif isinstance(value, torch.Tensor):
        if is_dtensor(value) and value.numel() == 1:
            value = value.full_tensor()
        if value.numel() == 1 and not value.is_complex() and not is_dtensor(value):
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

