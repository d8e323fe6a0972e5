"""Category digests: a category's tensors digested together, one cell per category (plus one per tensor at detail
``tensor``)."""

from __future__ import annotations

import ctypes
from itertools import accumulate
from operator import xor
from typing import Any

import xxhash

from ckptverify.trace.category import HostViews, device_digests, pair_digests, signature, weight
from ckptverify.trace.cells import _category_cells
from ckptverify.trace.readback import (
    Item,
    _digests_later,
    _has_parts,
    _on_host,
)
from ckptverify.trace.sites import _unwrap, canonical_name, is_dtensor, local_view
from ckptverify.trace.store import Cell


class _Members:
    """The tensors of one category, in a fixed order: their site names, weights and encodings."""

    def __init__(self, group: str, kind: str, names: list[str], tensors: list[Any]) -> None:
        self.group, self.kind, self.names = group, kind, names
        self.weights = [weight(n) for n in names]
        self.tensors = tensors
        self.locals = [local_view(t) for t in tensors]
        self.encodings = ["digest128" if _on_host(t) else "fp128" for t in self.locals]


class _Digester:
    """Digests several categories' members in one pass: host tensors through views kept across steps, device tensors
    in one batched pass per device; category sums in Python ints."""

    def __init__(self, categories: list[_Members], owners: list[Any]) -> None:
        """``owners``: what to read data pointers from to see a host member's storage move; the optimizer state is
        followed by identity elsewhere."""
        self.categories = categories
        tensors = [t for c in categories for t in c.locals]
        self._host = [i for i, t in enumerate(tensors) if _on_host(t) or _has_parts(t)]
        self._device: dict[Any, list[int]] = {}
        for i, t in enumerate(tensors):
            if not _on_host(t) and not _has_parts(t):
                self._device.setdefault(t.device, []).append(i)
        self._tensors = tensors
        self._views = HostViews([tensors[i] for i in self._host], owners=owners)
        self.bounds = list(accumulate((len(c.names) for c in categories), initial=0))
        self._spans = [(k, self.bounds[k], self.bounds[k + 1]) for k, c in enumerate(categories) if c.names]

    def digests_later(self) -> tuple[list[int], Any] | None:
        """Every member's digest in category order, one accelerator's members left there: the digests (zero at those)
        and that device's ``(m, 2)`` lane sums (``None``: all read, several devices being read back now); ``None``
        when a host storage moved (rebuild)."""
        host = self._views.digests()
        if host is None or not self._device:
            return None if host is None else (host, None)
        out = [0] * len(self._tensors)
        for i, d in zip(self._host, host, strict=True):
            out[i] = d
        if len(self._device) == 1:
            (members,) = self._device.values()
            from ckptverify.fingerprint import kernels as kern

            return out, kern.lanes_many([self._tensors[i] for i in members])
        for members in self._device.values():
            for i, d in zip(members, device_digests([self._tensors[i] for i in members]), strict=True):
                out[i] = d
        return out, None

    def fill(self, digests: list[int], values: list[int]) -> list[int]:
        """``digests`` with the device members' read-back lane sums ``values`` filled in."""
        out = list(digests)
        (members,) = self._device.values()
        for i, d in zip(members, pair_digests(values), strict=True):
            out[i] = d
        return out

    def cells(self, digests: list[int], detail: str) -> list[list[Cell]]:
        """Each category's cells, from ``digests`` (see :meth:`digests_later`)."""
        out: list[list[Cell]] = [[] for _ in self.categories]
        for k, lo, hi in self._spans:
            c = self.categories[k]
            out[k] = _category_cells(c.group, c.kind, c.names, c.weights, c.encodings, digests[lo:hi], detail)
        return out


class _Gradients:
    """Every parameter of a model, for reading their ``.grad`` in ``named_parameters`` order."""

    def __init__(self, model: Any) -> None:
        import torch

        named = [(f"grad.{canonical_name(n)}", p) for n, p in _unwrap(model).named_parameters()]
        self.model = model
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.weights = [weight(n) for n in self.names]
        locals_ = [local_view(p) for p in self.params]
        self.dtensor = [is_dtensor(p) for p in self.params]
        self.host = [_on_host(t) for t in locals_]
        self.signatures = [signature(t.dtype, tuple(t.shape)) for t in locals_]
        self.encodings = ["digest128" if h else "fp128" for h in self.host]
        # Plain host parameters: views straight from each gradient's address (a third of .numpy()'s cost).
        self.fast = bool(self.params) and all(self.host) and not any(self.dtensor) and all(
            t.numel() for t in locals_)
        self._makers = [(ctypes.c_char * (t.numel() * t.element_size())).from_address for t in locals_]
        self._contiguous = torch.Tensor.is_contiguous
        self._ptr = torch.Tensor.data_ptr

    def cells(self, detail: str) -> list[Item]:
        if self.fast:
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
        grads = [local_view(self.params[i].grad) for i in present]
        names = [self.names[i] for i in present]
        weights = [self.weights[i] for i in present]
        encodings = [self.encodings[i] for i in present]

        def finish(digests: list[int]) -> list[Cell]:
            return _category_cells("grad.*", "grad", names, weights, encodings, digests, detail)

        return _digests_later(grads, finish)

