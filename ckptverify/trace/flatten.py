"""What a state-level row reads from a :class:`~ckptverify.state.train_state.TrainState`: found once and kept while
the layout holds (:class:`_StateLayout`), non-tensor state-dict leaves digested per parent (:class:`_Leaves`), fields
read as ``TrainState.fields()`` does."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import xxhash

from ckptverify.trace.category import digest_lanes
from ckptverify.trace.cells import _SCALARS, _json, _value_lanes
from ckptverify.trace.members import _Digester, _Members
from ckptverify.trace.sites import _unwrap, local_view, non_persistent_buffers
from ckptverify.trace.store import Cell

if TYPE_CHECKING:
    from ckptverify.state.train_state import TrainState


def _live_value(groups: list[Any], index: int, head: str, rest: str) -> Any:
    value = groups[index].get(head)
    if rest:  # a sequence hyperparameter flattened per element (e.g. betas.0)
        try:
            value = value[int(rest)]  # type: ignore[index]
        except (TypeError, ValueError, IndexError):
            return _MISSING
    return value


_MISSING = object()


class _Leaves:
    """Non-tensor leaves of a flattened state dict, one cell per parent (``{leaf: value}`` digest). Leaves that are
    hyperparameters of a live param group are read from it each step (a scheduler changes them); a parent whose live
    groups hold plain values only and are unchanged keeps its cell."""

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
        # JSON of fixed leaves and live names made once: a step encodes the live values only. Param groups
        # comparable as a whole (plain values): an unchanged group costs one tuple comparison.
        self._fixed: dict[str, bytes | None] = {}
        self._reads: dict[str, list[int] | None] = {}
        for site, leaves in self.parents.items():
            fixed = {leaf: value for leaf, value, where in leaves if where is None}
            names = [leaf for leaf, _, where in leaves if where is not None]
            try:
                self._fixed[site] = (_json(fixed) + "|" + _json(names) + "|").encode("utf-8", "surrogatepass")
            except (TypeError, ValueError):
                self._fixed[site] = None
            read = sorted({where[0] for _, _, where in leaves if where is not None})
            plain = all(isinstance(v, (*_SCALARS, tuple)) or k == "params"
                        for g in read for k, v in self.groups[g].items())
            self._reads[site] = read if plain else None

    def cells(self) -> list[Cell]:
        out = []
        for site, leaves in self.parents.items():
            read, hit = self._reads[site], self._cache.get(site)
            # Plain groups compare as a whole before their live values are read; others are digested every step.
            snap: Any = None if read is None else [tuple(self.groups[g].values()) for g in read]
            if hit is None or snap is None or hit[0] != snap:
                live = [_live_value(self.groups, *where) for _, _, where in leaves if where is not None]
                hit = self._cache[site] = (snap, self._cell(site, leaves, live))
            out.append(hit[1])
        return out

    def _cell(self, site: str, leaves: list[tuple[str, Any, tuple[int, str, str] | None]], live: list[Any]) -> Cell:
        fixed = self._fixed[site]
        if fixed is not None:
            try:
                d = xxhash.xxh3_128_intdigest(b"L" + fixed + _json(live).encode("utf-8", "surrogatepass"))
                return Cell(site, self.kind, digest_lanes(d), "digest128")
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
    """What a state-level row reads from a TrainState, found once through ``get_state_dict`` (milliseconds) and kept
    while :func:`_layout_signature` is unchanged (no registration, same optimizer state and groups) and no storage
    moved (checked when digesting)."""

    def __init__(self, state: TrainState, structure: int) -> None:
        from ckptverify.dcp.loading import flat_names

        model_sd, optim_sd = state.model_optim_state()
        optim_flat = flat_names({"optim": optim_sd}) if optim_sd else {}
        param_flat = flat_names({"model": model_sd}) if model_sd else {}
        groups = [g for opt in state.optimizers for g in opt.param_groups]
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
                local = local_view(t)
                if local.device.type == "cpu" and local.numel():
                    owners.setdefault((local.data_ptr(), local.dtype, tuple(local.shape)), t)
        tensors = [(n, v) for n, v in param_flat.items() if _is_tensor(v)]
        locals_ = [local_view(v) for _, v in tensors]
        live = [owners.get((t.data_ptr(), t.dtype, tuple(t.shape)), t) if t.device.type == "cpu" else t
                for t in locals_]
        self.params = _Members("param.*", "param", [f"param.{n[len('model.'):]}" for n, _ in tensors],
                               [v for _, v in tensors])
        buffers = non_persistent_buffers(state.model) if state.model is not None else []
        self.buffers = _Members("buffer.*", "buffer", [f"buffer.{n}" for n, _ in buffers],
                                [b for _, b in buffers])
        host = [t for t in [*live, *self.buffers.locals] if t.device.type == "cpu"]
        self.digester = _Digester([self.optim, self.params, self.buffers], owners=host)


def _layout_signature(state: TrainState, structure: int) -> list[Any]:
    """Cheap per step: what any change of the layout changes."""
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
    """Counts parameter, buffer and submodule registrations anywhere (global hooks): cached lists of a model's
    tensors hold while the count is unchanged."""

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


@functools.cache
def _counter_fields() -> tuple[type, tuple[str, ...]]:
    """The built-in :class:`Counters` class and its field names (imported on first use: it imports torch)."""
    from ckptverify.state.train_state import Counters

    return Counters, tuple(f.name for f in dataclasses.fields(Counters))


def _counters(counters: Any) -> dict[str, Any]:
    """``counters.state_dict()``, reading the built-in :class:`Counters` fields directly (no deep copy)."""
    cls, names = _counter_fields()
    if type(counters) is cls:
        return {name: getattr(counters, name) for name in names}
    return counters.state_dict()


def _data_value(state: TrainState) -> Any:
    """``state``'s data position as ``TrainState.fields()`` reads it. A ``ResumableSampler`` gives it without
    starting an iterator, so no random stream needs ``TrainState``'s capture-and-restore guard."""
    from ckptverify.state.dataloader import find_resumable_sampler, loader_state
    from ckptverify.state.sampler import is_stateful_dataloader

    loader = state.dataloader
    if not is_stateful_dataloader(loader) and find_resumable_sampler(loader) is not None:
        return loader_state(loader)
    return state.loader_state()

