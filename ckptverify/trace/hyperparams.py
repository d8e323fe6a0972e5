"""Optimizer hyperparameters as cells: every numeric entry of every param group, made cheaply every step."""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptverify.trace.category import combine, weight
from ckptverify.trace.cells import _SCALARS
from ckptverify.trace.readback import Item, _Deferred, _on_host
from ckptverify.trace.sites import is_dtensor
from ckptverify.trace.store import Cell, bits_float


def _on_device(values: list[Any]) -> list[int]:
    """Positions of the one-element tensors on an accelerator among ``values`` (reading one waits for it)."""
    import torch

    return [i for i, v in enumerate(values)
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.numel() == 1 and not _on_host(v)]


def _hparam_cell(site: str, v: Any) -> Cell | None:
    if isinstance(v, bool | np.bool_ | int | np.integer):
        return Cell.from_int(site, "hparam", int(v))
    if isinstance(v, float | np.floating):
        return Cell.from_float(site, "hparam", float(v))
    if hasattr(v, "numel") and v.numel() == 1 and not is_dtensor(v):
        return Cell.from_float(site, "hparam", float(v.detach().reshape(()).item()))
    return None


def hparam_cells(prefix: str, optimizers: list[Any]) -> list[Cell]:
    """One exact-value cell per numeric hyperparameter of every param group: ``<prefix>[<o>.]<g>.<key>[.<i>]``.
    Non-numbers (``None``, strings) are left out: what drives a step's arithmetic is numeric."""
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
    """Where each param group's numbers are, found once: scalar keys (one ``itemgetter``), sequence keys, member
    names in that order, the ``struct`` format packing them, and their weights."""

    scalars: list[Any]  # per group: an itemgetter of its scalar keys, or None
    counts: list[int]  # per group: how many scalar keys
    sequences: list[list[str]]  # per group: keys of sequence entries
    names: list[str]
    fmt: str
    weights: list[int]
    comparable: bool  # no value can change in place: groups compare as a whole
    shape: list[int]  # len() of each group, and the number of optimizers, when found


class _HparamCells:
    """Every param group's hyperparameters as cells, cheaply per step: the category cell ``<prefix>*`` (its members'
    values are their bits, so a ``tensor``-detail replay names the one that differs), preceded at detail ``tensor``
    by one cell per hyperparameter. Packed with one ``struct`` call; unchanged groups reuse last step's cells."""

    def __init__(self, prefix: str, detail: str) -> None:
        self.prefix, self.detail = prefix, detail
        self._snap: Any = None
        self._cells: list[Cell] = []
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
            on_device = _on_device(values)
            if on_device:
                return [self._later(values, on_device, spec, group)]
            return self._packed(spec, values, group)
        except (struct.error, KeyError, IndexError, TypeError):
            self._spec = None  # the groups changed shape or types: find the entries again next time
            slow = hparam_cells(self.prefix, optimizers)
            names = [c.site for c in slow]
            return self._cells_of(names, [c.lanes[0] for c in slow], [weight(n) for n in names],
                                  [c.encoding for c in slow], group)

    def _packed(self, spec: _HparamSpec, values: list[Any], group: str) -> list[Cell]:
        """The cells of ``values``, packed by ``spec``: each member's value is its 64 bits."""
        packed = struct.pack(spec.fmt, *values)
        lows = list(struct.unpack(f"<{len(packed) // 8}Q", packed))
        encodings = ["f64" if k == "d" else "i64" for k in spec.fmt[1:]]
        return self._cells_of(spec.names, lows, spec.weights, encodings, group)

    def _later(self, values: list[Any], on_device: list[int], spec: _HparamSpec, group: str) -> Item:
        """:meth:`_make` when some hyperparameters are device tensors (a ``capturable`` optimizer's lr): those are
        widened to float64 there, exactly as ``float(tensor)``, and read back with the step."""
        import torch

        bits = torch.cat([values[i].detach().reshape(1).to(torch.float64).view(torch.int64) for i in on_device])
        kept = list(values)
        for i in on_device:
            kept[i] = None  # not held: read back

        def make(read: list[int]) -> list[Cell]:
            filled = list(kept)
            for i, b in zip(on_device, read, strict=True):
                filled[i] = bits_float(b)
            return self._packed(spec, filled, group)

        return _Deferred(bits, make)

    def _cells_of(self, names: list[str], lows: list[int], weights: list[int], encodings: list[str],
                  group: str) -> list[Cell]:
        if not names:
            return []
        cells = []
        if self.detail == "tensor":
            cells = [Cell(n, "hparam", (b, 0), e, "", group)
                     for n, b, e in zip(names, lows, encodings, strict=True)]
        cells.append(Cell(group, "hparam", combine(lows, weights), "set128"))
        return cells

    def _find(self, optimizers: list[Any], groups: list[Any]) -> _HparamSpec:
        """Which entries are numbers, and how to pack them."""
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
        return _HparamSpec(scalars, counts, sequences, names, fmt, [weight(n) for n in names], comparable,
                           [*map(len, groups), len(optimizers)])

