"""The per-step trace recorder: digests of what a training step saw and produced, one row per step.

Use (see ``docs/trace.md``)::

    header = TraceHeader(run="a", level="state", workload="tinygpt")
    with TraceRecorder(run_dir, header=header) as rec:
        rec.attach(model, optimizer=optimizer)  # gradient and module hooks
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=train_state)

``record_step`` is called once per step, after ``optimizer.step()`` (and ``scheduler.step()``): what it
reads from ``state`` is the state *after* the step. Gradients are recorded right before
``optimizer.step()`` by the hook ``attach(model, optimizer=...)`` installs; without it, by an explicit
:meth:`TraceRecorder.record_grads` call, or else read from ``p.grad`` when ``record_step`` runs (which a
loop that calls ``zero_grad`` at the end of the step has already cleared).

Every rank writes its own store, ``<run_dir>/rank<r>``, of what it holds (a DTensor's local shard). The
recorder walks the sites in a fixed order (state dict order, ``named_parameters`` order).

At detail ``category`` (the header's) each tensor category is one cell per step (:mod:`ckptverify.trace.category`);
at detail ``tensor`` each tensor also gets its own cell. How the per-step cost is kept down is described in
``docs/trace.md`` (*Values*, *Cost*): views kept from step to step, one vectorized pass for all category cells,
random streams re-digested only when they moved, hyperparameters packed with one ``struct`` call.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.errors import UsageError
from ckptverify.state.distributed import rank_world
from ckptverify.trace.store import (
    DEFAULT_FLUSH_EVERY,
    LEVELS,
    Cell,
    TraceHeader,
    TraceWriter,
    hex_lanes,
    rank_store_path,
)

if TYPE_CHECKING:
    import torch

    from ckptverify.state.train_state import TrainState

__all__ = ["ROOT_MODULE", "TraceRecorder", "canonical_name", "fingerprint_many", "module_site"]

#: The name the root module goes by in site names.
ROOT_MODULE = "(root)"

#: Wrapper components that ``get_state_dict`` leaves out of FQNs (torch.compile, activation checkpointing,
#: FSDP1); module and gradient names drop them too, so they match parameter names.
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

#: Order of the non-tensor fields of a TrainState in a row, by kind.
_FIELD_ORDER = {"scheduler": 0, "rng": 1, "data": 2, "counter": 3, "extra": 4}


def canonical_name(name: str) -> str:
    """``name`` without wrapper components (``_orig_mod``, ``_checkpoint_wrapped_module``, ...)."""
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_PARTS)


def module_site(module: str, direction: str, occurrence: int) -> str:
    """Site name of a module's forward input (``in``), forward output (``fwd``) or input gradient (``bwd``)
    at one occurrence."""
    return f"module.{module or ROOT_MODULE}.{direction}#{occurrence}"


def _unwrap(model: Any) -> Any:
    """The user's module inside DDP / ``torch.compile`` wrappers (whose names get_state_dict leaves out)."""
    from torch.nn.parallel import DistributedDataParallel

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def _is_dtensor(t: Any) -> bool:
    from ckptverify.fingerprint import _dtensor_type

    dtype = _dtensor_type()
    return dtype is not None and isinstance(t, dtype)


# ---------------------------------------------------------------------------------------- fingerprints

#: Kept for callers of :func:`fingerprint_many`: plain tensors of any size now go through one batched pass.
SMALL_TENSOR = 1 << 12


def fingerprint_many(tensors: list[torch.Tensor]) -> list[str]:
    """:func:`~ckptverify.fingerprint.tensor_fingerprint` values of ``tensors``, in order.

    Plain tensors are fingerprinted together on their device (one batched pass per device,
    :func:`ckptverify.fingerprint.kernels.lanes_many`, read back once); DTensors one by one through
    ``tensor_fingerprint``, in list order (DTensor fingerprints are collective: every rank passes the same
    list)."""
    from ckptverify.fingerprint import TensorFingerprint, tensor_fingerprint
    from ckptverify.fingerprint import kernels as kern

    out: list[str | None] = [None] * len(tensors)
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if _is_dtensor(t):
            out[i] = tensor_fingerprint(t).value
        else:
            by_device.setdefault(t.device, []).append(i)
    for members in by_device.values():
        lanes = kern.lanes_many([tensors[i] for i in members]).tolist()
        for i, (a, b) in zip(members, lanes, strict=True):
            out[i] = TensorFingerprint.from_lanes((a & _MASK64, b & _MASK64), "", (), 0).value
    return [v for v in out if v is not None]


# --------------------------------------------------------------------------------------------- cells

_MASK64 = (1 << 64) - 1


#: Host tensors take the accelerator path too (logical fingerprints computed in batches, read back once per
#: step): set ``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1`` so that a machine without an accelerator runs that path
#: (the test suite does). Traces recorded this way compare only with traces recorded this way.
_HOST_AS_DEVICE = os.environ.get("CKPTVERIFY_TRACE_HOST_AS_DEVICE") == "1"


def _on_host(t: Any) -> bool:
    """Whether a (local) tensor is digested by its bytes on the host, now; else by the batched device path."""
    return t.device.type == "cpu" and not _HOST_AS_DEVICE


class _Deferred:
    """Cells whose values are still on an accelerator: ``make(values)`` builds them from ``tensor`` once it is
    read back (``values``: the tensor's elements as Python ints, flattened). Every deferred item of a step is
    read back together, once (:class:`_ReadBack`), instead of one synchronizing read per category, batch element
    and metric. Items that share one tensor share its read."""

    __slots__ = ("make", "tensor")

    def __init__(self, tensor: torch.Tensor, make: Callable[[list[int]], list[Cell]]) -> None:
        self.tensor, self.make = tensor, make


Item = Cell | _Deferred


class _ReadBack:
    """The values a step's deferred items wait for, on their way to the host: one copy per device, started
    when the step is recorded and finished (:meth:`cells`) when the next step is, so that nothing waits for
    the device in between. On CUDA the copy goes to a pinned buffer without blocking and an event marks its
    end; elsewhere the values are read when needed.

    ``pinned``: per CUDA device, the pinned host buffer its owner (one recorder) reuses step after step
    (allocating one costs milliseconds). A recorder finishes one step's read before it starts the next, so one
    buffer per device is enough."""

    def __init__(self, items: list[Item], pinned: dict[Any, Any] | None = None) -> None:
        import torch

        self.items = items
        tensors: dict[int, Any] = {}
        for x in items:
            if type(x) is _Deferred:
                tensors.setdefault(id(x.tensor), x.tensor)
        by_device: dict[Any, list[tuple[int, Any]]] = {}
        for key, t in tensors.items():
            by_device.setdefault(t.device, []).append((key, t))
        self._reads: list[tuple[list[tuple[int, int]], Any, Any]] = []  # (key, numel) per member, values, event
        for device, members in by_device.items():
            flat = torch.cat([t.reshape(-1).to(torch.int64) for _, t in members])
            layout = [(key, t.numel()) for key, t in members]
            event = None
            if device.type == "cuda" and pinned is not None:
                buf = pinned.get(device)
                if buf is None or buf.numel() < flat.numel():
                    buf = pinned[device] = torch.empty(max(flat.numel(), 1024), dtype=torch.int64,
                                                             pin_memory=True)
                out = buf[:flat.numel()]
                out.copy_(flat, non_blocking=True)  # enqueued on the source device's current stream
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                flat = out
            self._reads.append((layout, flat, event))

    def cells(self) -> list[Cell]:
        """The step's cells, every deferred item made from the values read back."""
        values: dict[int, list[int]] = {}
        for layout, flat, event in self._reads:
            if event is not None:
                event.synchronize()
            got = flat.tolist()
            at = 0
            for key, n in layout:
                values[key] = got[at:at + n]
                at += n
        out: list[Cell] = []
        for x in self.items:
            if type(x) is _Deferred:
                out.extend(x.make(values[id(x.tensor)]))
            else:
                out.append(x)  # type: ignore[arg-type]
        return out


def _pair_digests(values: list[int]) -> list[int]:
    """Flattened ``(n, 2)`` lane sums (signed, as read back) as ``n`` unsigned 128-bit member digests."""
    it = iter(values)
    return [(a & _MASK64) << 64 | (b & _MASK64) for a, b in zip(it, it, strict=True)]


def _digests_later(tensors: list[Any], finish: Callable[[list[int]], list[Cell]]) -> list[Item]:
    """``finish(digests)`` of ``tensors``' member digests (plain local tensors): host ones digested now, the
    others in one batched pass on their device, read back with the rest of the step. Returns ``finish``'s
    cells, or one deferred item that makes them."""
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.trace.category import tensor_digests

    device = [i for i, t in enumerate(tensors) if not _on_host(t)]
    if not device:
        return list(finish(tensor_digests(tensors)))
    devices = {tensors[i].device for i in device}
    if len(devices) > 1:  # several accelerators on one rank: read each back now
        return list(finish(tensor_digests(tensors)))
    host = [i for i, t in enumerate(tensors) if _on_host(t)]
    known = dict(zip(host, tensor_digests([tensors[i] for i in host]), strict=True))
    lanes = kern.lanes_many([tensors[i] for i in device])

    def make(values: list[int]) -> list[Cell]:
        digests = [0] * len(tensors)
        for i, d in known.items():
            digests[i] = d
        for i, d in zip(device, _pair_digests(values), strict=True):
            digests[i] = d
        return finish(digests)

    return [_Deferred(lanes, make)]


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


def _hparam_cell(site: str, v: Any) -> Cell | None:
    import numpy as np

    if isinstance(v, bool | np.bool_ | int | np.integer):
        return Cell.from_int(site, "hparam", int(v))
    if isinstance(v, float | np.floating):
        return Cell.from_float(site, "hparam", float(v))
    if hasattr(v, "numel") and v.numel() == 1 and not _is_dtensor(v):
        return Cell.from_float(site, "hparam", float(v.detach().reshape(()).item()))
    return None


def hparam_cells(prefix: str, optimizers: list[Any]) -> list[Cell]:
    """One exact-value cell per hyperparameter of every param group: ``<prefix><g>.<key>`` (``<prefix><o>.<g>.<key>``
    with several optimizers; a sequence such as ``betas`` one cell per element). Numbers by their bits;
    other values (``None``, strings) are left out: what drives a step's arithmetic is numeric."""
    cells: list[Cell] = []
    for o, opt in enumerate(optimizers):
        head = f"{prefix}{o}." if len(optimizers) > 1 else prefix
        for g, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key == "params":
                    continue
                items = list(enumerate(value)) if isinstance(value, list | tuple) else [(None, value)]
                for k, v in items:
                    cell = _hparam_cell(f"{head}{g}.{key}" + ("" if k is None else f".{k}"), v)
                    if cell is not None:
                        cells.append(cell)
    return cells


@dataclass
class _HparamSpec:
    """Where the numbers of each param group are, found once: per group, the keys of its scalar entries (read
    with one ``itemgetter`` call) and of its sequence entries (``betas``), the members' names in that order,
    the ``struct`` format that packs their 64-bit values, and their weights."""

    scalars: list[Any]  # per group: an itemgetter of its scalar keys, or None
    counts: list[int]  # per group: how many scalar keys
    sequences: list[list[str]]  # per group: keys of sequence entries
    names: list[str]
    fmt: str
    weights: list[int]
    comparable: bool  # values that cannot change in place: the groups can be compared as a whole
    shape: list[int]  # len() of each group, and the number of optimizers, when found


class _HparamCells:
    """The hyperparameters of every param group as cells, made cheaply every step.

    At detail ``tensor``: one exact-value cell per hyperparameter (:func:`hparam_cells`), then a category cell
    ``<prefix>*`` over them; at detail ``category``: the category cell only (its members' values are their
    bits, so a replay of detail ``tensor`` names the one that differs). The numeric entries are found once
    (:class:`_HparamSpec`) and packed with one ``struct`` call per step; while the groups hold the same values,
    the cells of the step before are reused."""

    def __init__(self, prefix: str, detail: str) -> None:
        self.prefix, self.detail = prefix, detail
        self._snap: Any = None
        self._cells: list[Cell] = []
        self._spec: _HparamSpec | None = None

    def __call__(self, optimizers: list[Any]) -> list[Cell]:
        groups = [g for opt in optimizers for g in opt.param_groups]
        snap = None
        if self._spec is not None and self._spec.comparable:
            snap = (len(optimizers), [tuple(g.values()) for g in groups])
            if snap == self._snap:
                return self._cells
        cells = self._make(optimizers, groups)
        self._snap, self._cells = snap, cells
        return cells

    def _make(self, optimizers: list[Any], groups: list[Any]) -> list[Cell]:
        import struct

        from ckptverify.trace.category import combine

        spec = self._spec
        if spec is None or spec.shape != [*map(len, groups), len(optimizers)]:
            spec = self._spec = self._find(optimizers, groups)
        group = f"{self.prefix}*"
        try:
            values: list[Any] = []
            for g, get, n, seqs in zip(groups, spec.scalars, spec.counts, spec.sequences, strict=True):
                if n == 1:
                    values.append(get(g))
                elif n:
                    values.extend(get(g))
                for key in seqs:
                    values.extend(g[key])
            packed = struct.pack(spec.fmt, *values)
            lows = list(struct.unpack(f"<{len(packed) // 8}Q", packed))
            names, weights = spec.names, spec.weights
            encodings = ["f64" if k == "d" else "i64" for k in spec.fmt[1:]]
        except (struct.error, KeyError, IndexError, TypeError):
            self._spec = None  # the groups changed shape or types: find the entries again next time
            slow = hparam_cells(self.prefix, optimizers)
            names = [c.site for c in slow]
            lows = [c.lanes[0] for c in slow]
            weights = [_weight(n) for n in names]
            encodings = [c.encoding for c in slow]
        if not names:
            return []
        cells = []
        if self.detail == "tensor":
            # A member's value in the category cell is its 64 bits (lane 0 of its own cell).
            cells = [Cell(n, "hparam", (b, 0), e, "", group)
                     for n, b, e in zip(names, lows, encodings, strict=True)]
        cells.append(Cell(group, "hparam", combine(lows, weights), "set128"))
        return cells

    def _find(self, optimizers: list[Any], groups: list[Any]) -> _HparamSpec:
        """Which entries are numbers, and how to pack them."""
        import operator

        scalars: list[Any] = []
        counts: list[int] = []
        sequences: list[list[str]] = []
        names: list[str] = []
        fmt = "<"
        comparable = True
        for o, opt in enumerate(optimizers):
            head = f"{self.prefix}{o}." if len(optimizers) > 1 else self.prefix
            for g, group in enumerate(opt.param_groups):
                keys: list[str] = []
                seqs: list[str] = []
                seq_names: list[str] = []
                seq_fmt = ""
                for key, value in group.items():
                    if key == "params":
                        continue
                    if isinstance(value, list) or not isinstance(value, (*_SCALARS, tuple)):
                        comparable = False  # a value that can change in place: no reuse by comparison
                    if isinstance(value, list | tuple):
                        kinds = [_hparam_cell("x", v) for v in value]
                        if value and all(c is not None for c in kinds):
                            seqs.append(key)
                            seq_names += [f"{head}{g}.{key}.{k}" for k in range(len(value))]
                            seq_fmt += "".join("d" if c.encoding == "f64" else "q" for c in kinds)  # type: ignore[union-attr]
                        continue
                    cell = _hparam_cell("x", value)
                    if cell is not None:
                        keys.append(key)
                        names.append(f"{head}{g}.{key}")
                        fmt += "d" if cell.encoding == "f64" else "q"
                names += seq_names
                fmt += seq_fmt
                scalars.append(operator.itemgetter(*keys) if keys else None)
                counts.append(len(keys))
                sequences.append(seqs)
        weights = [_weight(n) for n in names]
        return _HparamSpec(scalars, counts, sequences, names, fmt, weights, comparable,
                           [*map(len, groups), len(optimizers)])


def _weight(name: str) -> int:
    from ckptverify.trace.category import weight

    return weight(name)


def non_persistent_buffers(model: Any) -> list[tuple[str, Any]]:
    """``(canonical name, tensor)`` of every buffer of ``model`` registered with ``persistent=False`` (state
    dicts, and so checkpoints, leave them out)."""
    out = []
    for mod_name, module in _unwrap(model).named_modules():
        for name in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            buf = module._buffers.get(name)
            if buf is not None:
                out.append((canonical_name(f"{mod_name}.{name}" if mod_name else name), buf))
    return out


def _field_kind(name: str) -> str:
    if name == "counters":
        return "counter"
    if name == "scaler":
        return "optim"
    if name == "data":
        return "data"
    head = name.split(".", 1)[0]
    return {"scheduler": "scheduler", "rng": "rng"}.get(head, "extra")


# --------------------------------------------------------------------------------------------- members


class _Members:
    """The tensors of one category, in a fixed order: their site names, weights and encodings."""

    def __init__(self, group: str, kind: str, names: list[str], tensors: list[Any]) -> None:
        from ckptverify.trace.category import weight

        self.group, self.kind, self.names = group, kind, names
        self.weights = [weight(n) for n in names]
        self.tensors = tensors
        self.locals = [t.to_local() if _is_dtensor(t) else t for t in tensors]
        self.encodings = ["digest128" if _on_host(t) else "fp128" for t in self.locals]


class _Digester:
    """Digests the members of several categories in one pass: host tensors through views kept from step to
    step (one C call each), device tensors in one batched pass per device; the category sums in Python
    integers."""

    def __init__(self, categories: list[_Members], owners: list[Any]) -> None:
        """``owners``: what to read data pointers from to see a host member's storage move (the Parameters
        behind state-dict aliases, the buffers); the optimizer state is followed by identity elsewhere."""
        from itertools import accumulate

        from ckptverify.trace.category import HostViews

        self.categories = categories
        tensors = [t for c in categories for t in c.locals]
        self.count = len(tensors)
        self._host = [i for i, t in enumerate(tensors) if _on_host(t)]
        self._device: dict[Any, list[int]] = {}
        for i, t in enumerate(tensors):
            if not _on_host(t):
                self._device.setdefault(t.device, []).append(i)
        self._tensors = tensors
        self._views = HostViews([tensors[i] for i in self._host], owners=owners)
        self.bounds = list(accumulate((len(c.names) for c in categories), initial=0))
        self._spans = [(k, self.bounds[k], self.bounds[k + 1]) for k, c in enumerate(categories) if c.names]

    def _host_digests(self) -> list[int] | None:
        """Every member's slot in category order, the host members' digests in theirs (zero elsewhere);
        ``None`` when a host member's storage moved (rebuild)."""
        host = self._views.digests()
        if host is None or not self._device:
            return host
        out = [0] * self.count
        for i, d in zip(self._host, host, strict=True):
            out[i] = d
        return out

    def digests(self) -> list[int] | None:
        """Every member's digest (an unsigned 128-bit integer) in category order; ``None`` when a host
        member's storage moved (rebuild)."""
        out = self._host_digests()
        if out is None:
            return None
        for members in self._device.values():
            for i, d in zip(members, _device_digests([self._tensors[i] for i in members]), strict=True):
                out[i] = d
        return out

    def digests_later(self) -> tuple[list[int], Any] | None:
        """:meth:`digests`, with the members on one accelerator left there: the digests (zero at those
        members' places) and the device's ``(m, 2)`` lane sums in member order (``None`` when every member is
        on the host); ``None`` when a host member's storage moved. Members on several devices are read back
        now."""
        if len(self._device) != 1:
            digests = self.digests()
            return None if digests is None else (digests, None)
        out = self._host_digests()
        if out is None:
            return None
        (members,) = self._device.values()
        from ckptverify.fingerprint import kernels as kern

        return out, kern.lanes_many([self._tensors[i] for i in members])

    def fill(self, digests: list[int], values: list[int]) -> list[int]:
        """``digests`` with the device members' read-back lane sums (``values``, flattened) in their places."""
        out = list(digests)
        (members,) = self._device.values()
        for i, d in zip(members, _pair_digests(values), strict=True):
            out[i] = d
        return out

    def cells(self, digests: list[int], detail: str) -> list[list[Cell]]:
        """Each category's cells, from ``digests`` (see :meth:`digests`)."""
        out: list[list[Cell]] = [[] for _ in self.categories]
        for k, lo, hi in self._spans:
            c = self.categories[k]
            out[k] = _category_cells(c.group, c.kind, c.names, c.weights, c.encodings, digests[lo:hi], detail)
        return out


def _device_digests(tensors: list[Any]) -> list[int]:
    """Member digests of tensors on one device, computed there and read back once."""
    from ckptverify.fingerprint import kernels as kern

    return [(a & _MASK64) << 64 | (b & _MASK64) for a, b in kern.lanes_many(tensors).tolist()]


def _category_cells(group: str, kind: str, names: list[str], weights: list[int], encodings: list[str],
                    digests: list[int], detail: str) -> list[Cell]:
    """At detail ``tensor`` one cell per member, then (at every detail) the category cell."""
    from ckptverify.trace.category import combine_digests

    cells: list[Cell] = []
    if detail == "tensor":
        cells = [Cell(n, kind, (d >> 64, d & _MASK64), e, "", group)
                 for n, d, e in zip(names, digests, encodings, strict=True)]
    cells.append(Cell(group, kind, combine_digests(digests, weights), "set128"))
    return cells


class _Gradients:
    """Every parameter of a model, for reading their ``.grad`` in ``named_parameters`` order."""

    def __init__(self, model: Any) -> None:
        import ctypes

        import torch

        from ckptverify.trace.category import signature, weight

        named = [(f"grad.{canonical_name(n)}", p) for n, p in _unwrap(model).named_parameters()]
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.weights = [weight(n) for n in self.names]
        locals_ = [p.to_local() if _is_dtensor(p) else p for p in self.params]
        self.dtensor = [_is_dtensor(p) for p in self.params]
        self.host = [_on_host(t) for t in locals_]
        # A gradient has its parameter's dtype and shape (autograd refuses any other).
        self.signatures = [signature(t.dtype, tuple(t.shape)) for t in locals_]
        self.encodings = ["digest128" if h else "fp128" for h in self.host]
        # Plain host parameters: each step, a view over every gradient's bytes straight from its address (a
        # third of the cost of .numpy()), checked contiguous first; the gradients are held while hashed.
        self.fast = bool(self.params) and all(self.host) and not any(self.dtensor) and all(
            t.numel() for t in locals_)
        self._makers = [(ctypes.c_char * (t.numel() * t.element_size())).from_address for t in locals_]
        self._contiguous = torch.Tensor.is_contiguous
        self._ptr = torch.Tensor.data_ptr

    def cells(self, detail: str) -> list[Item]:
        if self.fast:
            from operator import xor

            import xxhash

            grads = [p.grad for p in self.params]
            try:
                if all(map(self._contiguous, grads)):
                    views = [make(ptr) for make, ptr in zip(self._makers, map(self._ptr, grads), strict=True)]
                    digests = list(map(xor, map(xxhash.xxh3_128_intdigest, views), self.signatures))
                    return _category_cells("grad.*", "grad", self.names, self.weights, self.encodings, digests,
                                           detail)
            except (TypeError, RuntimeError):
                pass  # a parameter without gradient, a sparse gradient
        return self._cells(detail)

    def _cells(self, detail: str) -> list[Item]:
        present = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not present:
            return []
        grads = []
        for i in present:
            g = self.params[i].grad
            grads.append(g.to_local() if _is_dtensor(g) else g)
        names = [self.names[i] for i in present]
        weights = [self.weights[i] for i in present]
        encodings = [self.encodings[i] for i in present]

        def finish(digests: list[int]) -> list[Cell]:
            return _category_cells("grad.*", "grad", names, weights, encodings, digests, detail)

        return _digests_later(grads, finish)


def _live_value(groups: list[Any], index: int, head: str, rest: str) -> Any:
    value = groups[index].get(head)
    if rest:  # a sequence hyperparameter flattened per element (e.g. betas.0)
        try:
            value = value[int(rest)]  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            return _MISSING
    return value


_MISSING = object()
_UNCACHEABLE = object()
_SCALARS = (int, float, bool, str, type(None))


def _snapshot(value: Any) -> Any:
    """An immutable copy of a value made of numbers, strings, ``None``, lists and tuples (to compare with the
    next step's); ``_UNCACHEABLE`` for anything else (a tensor, an object: digested every time)."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list or kind is tuple:
        items = tuple(_snapshot(v) for v in value)
        return _UNCACHEABLE if any(v is _UNCACHEABLE for v in items) else (kind, items)
    return _UNCACHEABLE


class _Leaves:
    """The non-tensor leaves of a flattened state dict, digested together per parent name (one cell per
    optimizer param group, ...): each cell is the digest (:func:`_value_lanes`) of ``{leaf: value}``. Leaves
    that are hyperparameters of a live param group are read from it at each step (a scheduler changes them);
    the others come from the cached state dict. A parent whose live leaves are unchanged keeps its cell."""

    def __init__(self, flat: Mapping[str, Any], prefix: str, site_prefix: str, kind: str,
                 groups: list[Any] | None = None) -> None:
        self.kind = kind
        self.parents: dict[str, list[tuple[str, Any, tuple[int, str, str] | None]]] = {}
        for name, value in flat.items():
            if _is_tensor(value):
                continue
            rest = name[len(prefix):] if name.startswith(prefix) else name
            parent, _, leaf = rest.rpartition(".")
            site = site_prefix + parent if parent else site_prefix.rstrip(".")
            live = None
            if groups is not None and name.startswith(prefix + "param_groups."):
                index, _, key = name[len(prefix + "param_groups."):].partition(".")
                head, _, sub = key.partition(".")
                if head != "params" and index.isdigit() and int(index) < len(groups):
                    live = (int(index), head, sub)
            self.parents.setdefault(site, []).append((leaf, value, live))
        self.groups = groups or []
        self._cache: dict[str, tuple[Any, Cell]] = {}
        # Per parent, the JSON text of its fixed leaves and of its live leaves' names, made once: a step then
        # encodes the live values only (None where a fixed leaf is not plain data).
        self._fixed: dict[str, bytes | None] = {}
        for site, leaves in self.parents.items():
            fixed = {leaf: value for leaf, value, where in leaves if where is None}
            names = [leaf for leaf, _, where in leaves if where is not None]
            try:
                self._fixed[site] = (_json(fixed) + "|" + _json(names) + "|").encode("utf-8", "surrogatepass")
            except (TypeError, ValueError):
                self._fixed[site] = None
        # The param groups a parent reads, when their values can be compared as a whole from step to step
        # (numbers, strings, tuples; the "params" list by identity): then an unchanged group costs one
        # comparison of tuples.
        self._reads: dict[str, list[int] | None] = {}
        for site, leaves in self.parents.items():
            read = sorted({where[0] for _, _, where in leaves if where is not None})
            plain = all(isinstance(v, (*_SCALARS, tuple)) or k == "params"
                        for g in read for k, v in self.groups[g].items())
            self._reads[site] = read if plain else None

    def cells(self) -> list[Cell]:
        out = []
        for site, leaves in self.parents.items():
            read = self._reads[site]
            if read is not None:
                snap: Any = [tuple(self.groups[g].values()) for g in read]
                hit = self._cache.get(site)
                if hit is not None and hit[0] == snap:
                    out.append(hit[1])
                    continue
                live = [_live_value(self.groups, *where) for _, _, where in leaves if where is not None]
            else:
                live = [_live_value(self.groups, *where) for _, _, where in leaves if where is not None]
                snap = _snapshot(live)
                hit = self._cache.get(site)
                if hit is not None and snap is not _UNCACHEABLE and hit[0] == snap:
                    out.append(hit[1])
                    continue
            cell = self._cell(site, leaves, live)
            self._cache[site] = (snap, cell)
            out.append(cell)
        return out


    def _cell(self, site: str, leaves: list[tuple[str, Any, tuple[int, str, str] | None]], live: list[Any]) -> Cell:
        fixed = self._fixed[site]
        if fixed is not None:
            try:
                d = xxhash.xxh3_128_intdigest(b"L" + fixed + _json(live).encode("utf-8", "surrogatepass"))
                return Cell(site, self.kind, (d >> 64, d & _MASK64), "digest128")
            except (TypeError, ValueError):
                pass  # a live value that is not plain data (a tensor learning rate): the general digest
        values = iter(live)
        leaf_values = {leaf: value if where is None else next(values) for leaf, value, where in leaves}
        return Cell(site, self.kind, _value_lanes({k: v for k, v in leaf_values.items() if v is not _MISSING}),
                    "digest128")


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


class _StateLayout:
    """What a state-level row reads from a TrainState, found once through ``get_state_dict`` (which costs
    milliseconds) and kept while it holds: the optimizer-state and parameter tensors (updated in place from
    step to step) as category members, the non-tensor leaves, the non-persistent buffers.

    It holds while :meth:`signature` is unchanged: no module registered a parameter, buffer or submodule (the
    recorder's registration hooks count those), the optimizers hold the same state tensors and param groups,
    and no parameter's storage moved (checked when digesting)."""

    def __init__(self, state: TrainState, structure: int) -> None:
        from ckptverify.dcp.loading import flat_names

        model_sd, optim_sd = state._model_optim()
        optim_flat = flat_names({"optim": optim_sd}) if optim_sd else {}
        param_flat = flat_names({"model": model_sd}) if model_sd else {}
        groups = [g for opt in state.optimizers for g in opt.param_groups]
        self.structure = structure
        self.signature = _layout_signature(state, structure)
        self._pin = [opt.state for opt in state.optimizers]  # keeps ids in the signature unique
        self.optim_leaves = _Leaves(optim_flat, "optim.", "optim.", "optim", groups)
        self.param_leaves = _Leaves(param_flat, "model.", "param.", "param")
        names = [f"optim.{n[len('optim.'):]}" for n, v in optim_flat.items() if _is_tensor(v)]
        self.optim = _Members("optim.state.*", "optim", names, [v for v in optim_flat.values() if _is_tensor(v)])
        owners = {}
        if state.model is not None:
            inner = _unwrap(state.model)
            for t in [*inner.parameters(), *inner.buffers()]:
                local = t.to_local() if _is_dtensor(t) else t
                if local.device.type == "cpu" and local.numel():
                    owners.setdefault((local.data_ptr(), local.dtype, tuple(local.shape)), t)
        tensors = [(n, v) for n, v in param_flat.items() if _is_tensor(v)]
        live = []
        for _, v in tensors:
            local = v.to_local() if _is_dtensor(v) else v
            key = (local.data_ptr(), local.dtype, tuple(local.shape)) if local.device.type == "cpu" else None
            owner = owners.get(key) if key is not None else None
            live.append(owner if owner is not None else local)
        self.params = _Members("param.*", "param", [f"param.{n[len('model.'):]}" for n, _ in tensors],
                               [v for _, v in tensors])
        buffers = non_persistent_buffers(state.model) if state.model is not None else []
        self.buffers = _Members("buffer.*", "buffer", [f"buffer.{n}" for n, _ in buffers],
                                [b for _, b in buffers])
        host = [t for t in [*live, *self.buffers.locals] if t.device.type == "cpu"]
        self.digester = _Digester([self.optim, self.params, self.buffers], owners=host)


def _layout_signature(state: TrainState, structure: int) -> list[Any]:
    """Cheap to compute every step: what a change of the layout changes."""
    from itertools import chain

    sig: list[Any] = [structure, id(state.model), len(state.optimizers)]
    for opt in state.optimizers:
        st = opt.state
        sig.append(id(st))
        sig.append(len(st))
        sig.extend(map(id, chain.from_iterable(map(dict.values, st.values()))))
        sig.append(len(opt.param_groups))
        sig.extend([len(g) for g in opt.param_groups])
    return sig


class _Structure:
    """Counts parameter, buffer and submodule registrations anywhere (global module hooks): a cached list of
    a model's parameters or buffers holds while the count has not moved."""

    def __init__(self) -> None:
        from torch.nn.modules import module

        self.version = 0
        self._handles = [
            module.register_module_parameter_registration_hook(self._bump),
            module.register_module_buffer_registration_hook(self._bump),
            module.register_module_module_registration_hook(self._bump),
        ]

    def _bump(self, *args: Any) -> None:
        self.version += 1

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _counters(counters: Any) -> dict[str, Any]:
    """``counters.state_dict()``: for the built-in :class:`Counters` (integers), its fields read directly
    rather than through ``dataclasses.asdict``'s deep copy."""
    if not _COUNTERS:
        import dataclasses

        from ckptverify.state.train_state import Counters

        _COUNTERS.append(Counters)
        _COUNTERS.extend(f.name for f in dataclasses.fields(Counters))
    if type(counters) is _COUNTERS[0]:
        return {name: getattr(counters, name) for name in _COUNTERS[1:]}
    return counters.state_dict()


#: The built-in Counters class, then its field names (filled on first use: importing it here would import torch).
_COUNTERS: list[Any] = []


def _data_value(state: TrainState) -> Any:
    """``state``'s data position, as ``TrainState.fields()`` reads it. A ``DataLoader`` driven by a
    ``ResumableSampler`` gives its position without starting an iterator, so no random stream needs the
    capture-and-restore guard ``TrainState`` puts around other loaders."""
    from ckptverify.state.dataloader import find_resumable_sampler, loader_state
    from ckptverify.state.sampler import _is_stateful_dataloader

    loader = state.dataloader
    if not _is_stateful_dataloader(loader) and find_resumable_sampler(loader) is not None:
        return loader_state(loader)
    return state._loader_state()


# ------------------------------------------------------------------------------------------ recorder


class TraceRecorder:
    """Records one row per training step into ``<path>/rank<r>`` (a :class:`~ckptverify.trace.TraceWriter`).

    Args:
        path: the run's trace directory; rank ``r`` writes the store ``<path>/rank<r>``.
        header: what the trace describes; its level (``metrics`` | ``state`` | ``module``) decides what is
            recorded, its detail (``category`` | ``tensor``) whether tensor categories get a cell per tensor.
            ``rank``/``world_size`` are filled in from ``torch.distributed`` when left ``None``.
        flush_every: rows buffered before a (background) write.
        overwrite: replace an existing store instead of refusing.
    """

    def __init__(self, path: str | os.PathLike[str], *, header: TraceHeader, flush_every: int = DEFAULT_FLUSH_EVERY,
                 overwrite: bool = False) -> None:
        rank, world = rank_world()
        if header.rank is not None and header.rank != rank:
            raise UsageError(f"trace header says rank {header.rank}, but this process is rank {rank}")
        if header.world_size is not None and header.world_size != world:
            raise UsageError(f"trace header says world size {header.world_size}, but the job has {world}")
        self.header = header.with_rank(rank, world)
        self.level = self.header.level
        self.detail = self.header.detail
        self.rank = rank
        self.run_dir = Path(path)
        self.store_path = rank_store_path(path, rank)
        self.writer = TraceWriter(self.store_path, header=self.header, flush_every=flush_every, overwrite=overwrite)
        self._model: Any = None
        self._handles: list[Any] = []
        self._module_cells: list[Cell] = []
        self._occurrences: dict[tuple[str, str], int] = {}
        self._grad_cells: list[Item] | None = None
        self._hparam_cells: list[Cell] = []
        self._start_cells: list[Cell] = []
        self._optimizers: list[Any] = []
        self._paused = 0
        self._structure: _Structure | None = None
        self._gradients: _Gradients | None = None
        self._layout: _StateLayout | None = None
        self._streams: Any = None
        self._streams_key: Any = None
        self._rng_cells_made: dict[tuple[str, str], tuple[str, Cell]] = {}
        self._hparams = _HparamCells("hparam.", self.detail)
        self._start_hparams = _HparamCells("start.hparam.", self.detail)
        self._grad_version = -1
        self._field_kinds: dict[str, str] = {}
        self._last: tuple[int, list[Any], list[int]] | None = None
        self._pending: tuple[int, _ReadBack] | None = None
        self._pinned: dict[Any, Any] = {}

    @property
    def records_state(self) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index("state")

    @property
    def records_modules(self) -> bool:
        return self.level == "module"

    def _version(self) -> int:
        if self._structure is None:
            self._structure = _Structure()
        return self._structure.version

    # -------------------------------------------------------------- module hooks

    def attach(self, model: torch.nn.Module, *, optimizer: Any = None, backward: bool = True,
               include: Callable[[str, torch.nn.Module], bool] | None = None) -> None:
        """Remember ``model`` (for :meth:`record_grads`) and install the recording hooks.

        * ``optimizer`` (one or a list): at level ``state`` and above, a step pre-hook calls
          :meth:`record_grads` right before each ``optimizer.step()``, so gradients are recorded as the
          optimizer consumes them (after clipping and unscaling), wherever the loop calls ``zero_grad``.
        * At level ``module``, every module (``include(name, module)`` narrows the set) gets a forward hook
          recording its output's digest, a forward pre-hook recording its inputs' (so work a parent does
          in its own ``forward`` between children shows as a child input that differs while the parent's
          does not), and with ``backward`` a full backward hook recording the digest of the gradient
          with respect to its inputs. Sites are ``module.<name>.in#k`` / ``module.<name>.fwd#k`` /
          ``module.<name>.bwd#k``, ``k`` counting the hook's calls for that module in the step.
        """
        if self._model is not None:
            raise UsageError("a model is already attached; call detach() first")
        self._model = model
        if optimizer is not None and self.records_state:
            optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
            self._optimizers = list(optimizers)
            for opt in optimizers:
                self._handles.append(opt.register_step_pre_hook(self._optimizer_hook))
        if not self.records_modules:
            return
        inner = _unwrap(model)
        for raw_name, module in inner.named_modules():
            name = canonical_name(raw_name) or ROOT_MODULE
            if include is not None and not include(name, module):
                continue
            if any(p in _WRAPPER_PARTS for p in raw_name.split(".")[-1:]):
                continue  # a wrapper's inner module: the wrapper already records this output
            cls = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name, cls)))
            self._handles.append(module.register_forward_hook(self._forward_hook(name, cls)))
            if backward:
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name, cls)))

    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._paused:
            return  # a step that is not recorded (trace_every > 1): no digests to pay for
        if self._model is not None:
            self.record_grads(self._model)
        # The hyperparameters this optimizer step uses (a loop sets lr from its own counter right before it).
        self._hparam_cells = self._hparams(self._optimizers)

    def detach(self) -> None:
        """Remove the hooks and forget the attached model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._model = None
        self._gradients = None

    def _next(self, name: str, direction: str) -> int:
        key = (name, direction)
        k = self._occurrences.get(key, 0)
        self._occurrences[key] = k + 1
        return k

    def _input_hook(self, name: str, cls: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if not self._paused:
                site = module_site(name, "in", self._next(name, "in"))
                self._module_cells.append(_object_cell(site, "module_in", args, cls))

        return hook

    def _forward_hook(self, name: str, cls: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self._paused:
                site = module_site(name, "fwd", self._next(name, "fwd"))
                self._module_cells.append(_object_cell(site, "module_out", output, cls))

        return hook

    def _backward_hook(self, name: str, cls: str) -> Callable[..., None]:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            if not self._paused:
                site = module_site(name, "bwd", self._next(name, "bwd"))
                self._module_cells.append(_object_cell(site, "module_grad_in", grad_input, cls))

        return hook

    def begin_skipped_step(self) -> None:
        """A step that will not be recorded (``trace_every`` > 1) begins: hooks gather nothing until
        :meth:`skip_step`."""
        self._paused += 1

    def skip_step(self) -> None:
        """End a step begun with :meth:`begin_skipped_step`: forget anything gathered for it."""
        self._paused -= 1
        self._module_cells = []
        self._start_cells = []
        self._grad_cells = None
        self._hparam_cells = []
        self._occurrences.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Module hooks record nothing inside this block (e.g. an evaluation pass between steps)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -------------------------------------------------------------- gradients

    def _grads_of(self, model: Any) -> list[Item]:
        grads = self._gradients
        if grads is None or grads.model is not model or self._grad_version != self._version():
            self._grad_version = self._version()
            grads = self._gradients = _Gradients(model)
        return grads.cells(self.detail)

    def record_grads(self, model: torch.nn.Module | None = None) -> None:
        """Digest every parameter's ``.grad`` now, for the next :meth:`record_step`.

        ``attach(model, optimizer=...)`` calls it right before each ``optimizer.step()``. Without that hook,
        call it after ``backward()`` (and any gradient clipping) and before ``optimizer.zero_grad()`` in a
        loop that clears gradients before ``record_step``. A later call in the same step replaces the
        earlier one (with gradient accumulation, the last one before the step is what the step used).
        ``model`` defaults to the attached one. Does nothing below level ``state``.
        """
        if not self.records_state:
            return
        model = model if model is not None else self._model
        if model is None:
            raise UsageError("record_grads() needs a model: pass one or call attach(model) first")
        self._grad_cells = self._grads_of(model)

    # -------------------------------------------------------------- steps

    def _rng_cells(self, prefix: str, state: TrainState) -> list[Cell]:
        """A digest cell per random stream (``<prefix><kind>``); the cell of a stream that did not move is the
        one made before."""
        from ckptverify.trace.streams import StreamDigests

        gens = state.rng.generators
        key = (id(state), tuple((name, id(g)) for name, g in gens.items()))
        if self._streams is None or self._streams_key != key:
            self._streams, self._streams_key = StreamDigests(gens), key
        out = []
        cache = self._rng_cells_made
        for kind, value in self._streams.current().items():
            hit = cache.get((prefix, kind))
            if hit is None or hit[0] != value:
                hit = cache[(prefix, kind)] = (value, Cell(f"{prefix}{kind}", "rng", hex_lanes(value), "digest128"))
            out.append(hit[1])
        return out

    def record_step_start(self, state: TrainState | None) -> None:
        """The state a step starts from, for the next :meth:`record_step`: every random stream
        (``start.rng.<stream>``) and every optimizer hyperparameter (``start.hparam.<g>.<key>``) as they are
        before the step draws or computes anything. A stream that differs here is a cause (re-seeded, or drawn
        outside the steps), not a consequence of a different batch. Does nothing below level ``state``."""
        if not self.records_state or state is None:
            return
        self._start_cells = [*self._rng_cells("start.rng.", state), *self._start_hparams(state.optimizers)]

    def record_step(self, step: int, *, metrics: Mapping[str, Any] | None = None, batch: Any = None,
                    state: TrainState | None = None, batch_indices: Any = None) -> None:
        """Record the row of ``step``: call once at the end of each step, after ``optimizer.step()``.

        * every level: ``metrics`` (name -> number or tensor) by their exact bits;
        * ``state`` and ``module``: what :meth:`record_step_start` captured when the step began (random
          streams, hyperparameters), and the hyperparameters the optimizer step used (``hparam.<g>.<key>``,
          captured by the optimizer hook);
        * ``state`` and ``module``: ``batch_indices`` (the sample indices the batch was made from, with its
          epoch: ``data.indices``, a digest), then the ``batch`` digest (a tensor, or one site per element of a
          tuple/list/dict); the gradients (those captured by :meth:`record_grads` — or the optimizer hook —
          in this step, else the ``.grad`` of ``state.model`` / the attached model as they are now;
          parameters without a gradient are not recorded) as the category cell ``grad.*``; and from
          ``state``: optimizer state (``optim.param_groups.<i>``: hyperparameters digested per param group;
          the category cell ``optim.state.*``), parameters and buffers (``param.*``), buffers registered with
          ``persistent=False`` (``buffer.*``: no checkpoint holds them), and a digest of each non-tensor field
          (``scheduler.<i>``, ``rng.<stream>``, ``data``, ``counters``, ...). At detail ``tensor`` each
          tensor of a category also gets its own cell (``grad.<fqn>``, ``optim.state.<fqn>.<key>``,
          ``param.<fqn>``, ``buffer.<fqn>``), right before its category cell;
        * ``module``: the module outputs and input gradients recorded by the hooks since the last row.

        Lower levels ignore what they do not record, so the same loop works at every level. Steps must
        increase. On several ranks every rank must call this for every step.
        """
        import torch

        cells: list[Item] = list(self._start_cells) if self.records_state else []
        deep = self.records_state
        if deep and batch_indices is not None:
            cells.append(Cell("data.indices", "data", _value_lanes(batch_indices), "digest128"))
        if deep and batch is not None:
            cells.extend(self._batch_cells(batch, torch))
        cells.extend(self._module_cells)
        for name, value in (metrics or {}).items():
            cells.append(_metric_item(str(name), value))
        self._last = None
        if deep:
            grads = self._grad_cells
            if grads is None:
                model = state.model if state is not None and state.model is not None else self._model
                grads = self._grads_of(model) if model is not None else []
            cells.extend(self._hparam_cells)
            cells.extend(grads)
            if state is not None:
                cells.extend(self._state_cells(step, state))
        self._module_cells = []
        self._start_cells = []
        self._hparam_cells = []
        self._occurrences.clear()
        self._grad_cells = None
        # Values still on an accelerator (gradients, state, batch, metrics) are read back together, once: the
        # copy starts now and is taken when the next step is recorded (or at flush), so that nothing waits for
        # the device here.
        self._settle()
        if any(type(x) is _Deferred for x in cells):
            self._pending = (step, _ReadBack(cells, self._pinned))
        else:
            self.writer.append(step, cells)  # type: ignore[arg-type]

    def _settle(self) -> None:
        """Write the row whose values were still on their way from the device."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.writer.append(pending[0], pending[1].cells())

    @staticmethod
    def _batch_cells(batch: Any, torch: Any) -> list[Item]:
        if isinstance(batch, torch.Tensor):
            return [_tensor_item("batch", "batch", batch)]
        if isinstance(batch, Mapping):
            return [_object_item(f"batch.{k}", "batch", v) for k, v in batch.items()]
        if isinstance(batch, list | tuple):
            return [_object_item(f"batch.{i}", "batch", v) for i, v in enumerate(batch)]
        return [_object_item("batch", "batch", batch)]

    def _state_cells(self, step: int, state: TrainState) -> list[Item]:
        rng = self._rng_cells("rng.", state)  # first, as TrainState.fields() does: reading the rest may draw
        fields = self._field_cells(state, rng)
        scaler = [c for c in fields if c.kind == "optim"]
        others = sorted((c for c in fields if c.kind != "optim"), key=lambda c: _FIELD_ORDER[c.kind])
        layout, digests, lanes = self._members(state)
        lo, hi = layout.digester.bounds[1:3]
        optim: list[Item]
        params: list[Item]
        buffers: list[Item]
        if lanes is None:
            optim, params, buffers = layout.digester.cells(digests, self.detail)  # type: ignore[assignment]
            self._last = (step, layout.params.tensors, digests[lo:hi])
        else:
            # On an accelerator: the three categories' cells are made from one read-back, with the step's.
            made: list[list[list[Cell]]] = []

            def part(k: int) -> _Deferred:
                def make(values: list[int]) -> list[Cell]:
                    if not made:
                        full = layout.digester.fill(digests, values)
                        self._last = (step, layout.params.tensors, full[lo:hi])
                        made.append(layout.digester.cells(full, self.detail))
                    return made[0][k]

                return _Deferred(lanes, make)

            optim, params, buffers = [part(0)], [part(1)], [part(2)]
        return [*layout.optim_leaves.cells(), *scaler, *optim, *layout.param_leaves.cells(), *params, *buffers,
                *others]

    def _members(self, state: TrainState) -> tuple[_StateLayout, list[int], Any]:
        """The layout, the digests of its optimizer-state, parameter and buffer members now, and the lane sums
        of those on an accelerator (not read back yet; ``None`` when all are on the host)."""
        for _ in range(2):
            layout = self._layout
            version = self._version()
            if layout is None or layout.signature != _layout_signature(state, version):
                layout = self._layout = _StateLayout(state, version)
            got = layout.digester.digests_later()
            if got is not None:
                return layout, got[0], got[1]
            self._layout = None  # a storage moved under a parameter (p.data = ...): find the tensors again
        raise UsageError("the model's tensors keep moving while the trace reads them")

    def _field_cells(self, state: TrainState, rng: list[Cell]) -> list[Cell]:
        """One digest cell per non-tensor field of ``state``: exactly ``state_digest`` of what
        ``TrainState.fields()`` returns for it (the random streams' cells come in ``rng``)."""
        values: dict[str, Any] = {"counters": _counters(state.counters)}
        for i, sched in enumerate(state.schedulers):
            values[f"scheduler.{i}"] = sched.state_dict()
        if state.scaler is not None:
            values["scaler"] = state.scaler.state_dict()
        if state.dataloader is not None:
            values["data"] = _data_value(state)
        cells = [self._field_cell(name, value) for name, value in values.items()]
        cells.extend(rng)
        for name, obj in state.extras.items():
            cells.append(self._field_cell(f"extras.{name}", obj.state_dict()))
        return cells

    def _field_cell(self, name: str, value: Any) -> Cell:
        kind = self._field_kinds.get(name)
        if kind is None:
            kind = self._field_kinds[name] = _field_kind(name)
        return Cell(name, kind, _value_lanes(value), "digest128")

    def step_digests(self, step: int, tensors: list[Any]) -> list[int | None]:
        """The member digests the row of ``step`` (the last one recorded) holds for ``tensors`` (parameters, or
        their local shards), matched by storage; ``None`` for a tensor the row did not digest. Lets a check
        that runs right after :meth:`record_step` (the cross-replica check) reuse them instead of reading the
        tensors again."""
        if self._pending is not None and self._pending[0] == step:
            self._settle()
        if self._last is None or self._last[0] != step:
            return [None] * len(tensors)
        _, members, digests = self._last
        index: dict[tuple[Any, ...], int] = {}
        for t, d in zip(members, digests, strict=True):
            local = t.to_local() if _is_dtensor(t) else t
            if local.numel():
                index[(local.device, local.data_ptr(), local.dtype, tuple(local.shape), local.stride())] = d
        out: list[int | None] = []
        for t in tensors:
            local = t.to_local() if _is_dtensor(t) else t
            key = (local.device, local.data_ptr(), local.dtype, tuple(local.shape), local.stride())
            out.append(index.get(key) if local.numel() else None)
        return out

    # -------------------------------------------------------------- lifetime

    def flush(self) -> None:
        """Write the buffered rows and wait until they are committed."""
        self._settle()
        self.writer.flush()

    def close(self) -> None:
        """Remove the hooks and write the buffered rows."""
        self.detach()
        if self._structure is not None:
            self._structure.remove()
            self._structure = None
        self._settle()
        self.writer.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
