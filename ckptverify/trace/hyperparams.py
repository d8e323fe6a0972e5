"""Optimizer hyperparameters as cells: every numeric entry of every param group, made cheaply every step."""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptverify.trace.category import weight
from ckptverify.trace.cells import _SCALARS, _category_cells
from ckptverify.trace.readback import Item, _Deferred, _on_host
from ckptverify.trace.sites import is_dtensor
from ckptverify.trace.store import Cell, bits_float


def _on_device(values: list[Any]) -> list[int]:
    """Positions of the one-element tensors on an accelerator among ``values`` (reading one waits for it)."""
    import torch

    return [i for i, v in enumerate(values)
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.numel() == 1 and not _on_host(v)]


def _code(site: str, v: Any) -> str | None:
    """How hyperparameter ``site``'s value packs: ``q`` (int64), ``d`` (float64), ``None`` (not a number). An integer
    beyond 64 bits is a :class:`UsageError` naming ``site``, a complex tensor a ``TypeError``."""
    if isinstance(v, bool | np.bool_ | int | np.integer):
        Cell.from_int(site, "hparam", int(v))
        return "q"
    if isinstance(v, float | np.floating):
        return "d"
    if hasattr(v, "numel") and v.numel() == 1 and not is_dtensor(v):
        float(v.detach().reshape(()).item())
        return "d"
    return None


@dataclass
class _HparamSpec:
    """Where each param group's numbers are, found once: per group an ``itemgetter`` of its scalar keys (or
    ``None``), their count and its sequence keys; member names in that order, the ``struct`` format packing them,
    and their weights. ``convert``: some value is a numpy bool, which ``struct`` does not take, so every value is
    made an ``int`` or ``float`` before packing (same bits)."""

    reads: list[tuple[Any, int, list[str]]]
    names: list[str]
    fmt: str
    weights: list[int]
    comparable: bool  # no value can change in place: groups compare as a whole
    shape: list[int]  # len() of each group, and the number of optimizers, when found
    convert: bool


def _find(prefix: str, optimizers: list[Any]) -> _HparamSpec:
    """Which entries are numbers, and how to pack them: per group its numeric scalars, then its sequences whose
    entries all are numbers (``None``, strings and anything else are left out)."""
    reads: list[tuple[Any, int, list[str]]] = []
    names: list[str] = []
    fmt = "<"
    comparable = True
    convert = False
    for o, opt in enumerate(optimizers):
        head = f"{prefix}{o}." if len(optimizers) > 1 else prefix
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
                    codes = [_code(f"{head}{g}.{key}.{k}", v) for k, v in enumerate(value)]
                    if value and None not in codes:
                        seqs.append(key)
                        seq_names += [f"{head}{g}.{key}.{k}" for k in range(len(value))]
                        seq_fmt += "".join(codes)  # type: ignore[arg-type]
                        convert = convert or any(isinstance(v, np.bool_) for v in value)
                    continue
                code = _code(f"{head}{g}.{key}", value)
                if code is not None:
                    convert = convert or isinstance(value, np.bool_)
                    keys.append(key)
                    names.append(f"{head}{g}.{key}")
                    fmt += code
            names += seq_names
            fmt += seq_fmt
            reads.append((operator.itemgetter(*keys) if keys else None, len(keys), seqs))
    return _HparamSpec(reads, names, fmt, [weight(n) for n in names], comparable,
                       [*(len(g) for opt in optimizers for g in opt.param_groups), len(optimizers)], convert)


def _values(spec: _HparamSpec, groups: list[Any]) -> list[Any]:
    """The values ``spec`` packs, read from ``groups`` (``KeyError``/``TypeError``: the groups changed)."""
    values: list[Any] = []
    for g, (get, n, seqs) in zip(groups, spec.reads, strict=True):
        if n == 1:
            values.append(get(g))
        elif n:
            values.extend(get(g))
        for key in seqs:
            values.extend(g[key])
    return values


def _lanes(spec: _HparamSpec, values: list[Any]) -> tuple[list[int], list[str]]:
    """Each value's 64 bits (lane 0 of its cell) and encoding, packed in one ``struct`` call (made numbers first
    where ``spec.convert``)."""
    if spec.convert:
        values = [int(v) if k == "q" else float(v) for k, v in zip(spec.fmt[1:], values, strict=True)]
    packed = struct.pack(spec.fmt, *values)
    return list(struct.unpack(f"<{len(packed) // 8}Q", packed)), ["f64" if k == "d" else "i64" for k in spec.fmt[1:]]


def hparam_cells(prefix: str, optimizers: list[Any]) -> list[Cell]:
    """One exact-value cell per numeric hyperparameter of every param group: ``<prefix>[<o>.]<g>.<key>[.<i>]``, as
    the recorder records them at detail ``tensor``. Non-numbers (``None``, strings) are left out, and so is a
    sequence not all numbers: what drives a step's arithmetic is numeric."""
    spec = _find(prefix, optimizers)
    lows, encodings = _lanes(spec, _values(spec, [g for opt in optimizers for g in opt.param_groups]))
    return [Cell(n, "hparam", (b, 0), e) for n, b, e in zip(spec.names, lows, encodings, strict=True)]


class _HparamCells:
    """Every param group's hyperparameters as cells, cheaply per step: the category cell ``<prefix>*`` (its members'
    values are their bits, so a ``tensor``-detail replay names the one that differs), preceded at detail ``tensor``
    by one cell per hyperparameter (:func:`hparam_cells`). Packed with one ``struct`` call; unchanged groups reuse
    last step's cells."""

    def __init__(self, prefix: str, detail: str) -> None:
        self.prefix, self.detail = prefix, detail
        self._snap: Any = None
        self._cells: list[Item] = []
        self._spec: _HparamSpec | None = None

    def __call__(self, optimizers: list[Any]) -> list[Item]:
        groups = [g for opt in optimizers for g in opt.param_groups]
        snap = None
        if self._spec is not None and self._spec.comparable:
            snap = (len(optimizers), [tuple(g.values()) for g in groups])
            if snap == self._snap:
                return self._cells
        cells = self._make(optimizers, groups)
        self._snap, self._cells = snap, cells
        return cells

    def _make(self, optimizers: list[Any], groups: list[Any]) -> list[Item]:
        spec = self._spec
        fresh = spec is None or spec.shape != [*map(len, groups), len(optimizers)]
        if fresh:
            spec = self._spec = _find(self.prefix, optimizers)
        assert spec is not None
        try:
            values = _values(spec, groups)
            on_device = _on_device(values)
            if on_device:
                return [self._later(values, on_device, spec)]
            return self._packed(spec, values)
        except (struct.error, KeyError, IndexError, TypeError):
            if fresh:
                raise
            self._spec = None  # the groups changed types: find the entries again
            return self._make(optimizers, groups)

    def _packed(self, spec: _HparamSpec, values: list[Any]) -> list[Cell]:
        """The cells of ``values``, packed by ``spec`` (see :func:`_lanes`): each member's value is its 64 bits."""
        if not spec.names:
            return []
        lows, encodings = _lanes(spec, values)
        return _category_cells(f"{self.prefix}*", "hparam", spec.names, spec.weights, encodings, lows, self.detail,
                               lanes=lambda b: (b, 0))

    def _later(self, values: list[Any], on_device: list[int], spec: _HparamSpec) -> Item:
        """:meth:`_make` when some hyperparameters are device tensors (a ``capturable`` optimizer's lr): those are
        widened to float64 there, exactly as ``float(tensor)``, and read back with the step."""
        import torch

        bits = torch.cat([values[i].detach().reshape(1).to(torch.float64).view(torch.int64) for i in on_device])
        kept = [None if i in on_device else v for i, v in enumerate(values)]  # device values not held: read back

        def make(read: list[int]) -> list[Cell]:
            filled = list(kept)
            for i, b in zip(on_device, read, strict=True):
                filled[i] = bits_float(b)
            return self._packed(spec, filled)

        return _Deferred(bits, make)
