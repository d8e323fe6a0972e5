"""The per-step trace recorder: fingerprints of what a training step saw and produced, one row per step.

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

Every rank writes its own store, ``<run_dir>/rank<r>``. Fingerprints of DTensors (FSDP2 parameters,
gradients and optimizer state) are collective, so every rank records the same sites in the same order:
the recorder walks them in a fixed order (state dict order, ``named_parameters`` order).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptverify._distributed import rank_world
from ckptverify.errors import UsageError
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

#: Plain tensors up to this many elements are fingerprinted together (see :func:`fingerprint_many`). Larger
#: ones amortize the per-call cost and go through the blocked kernel, which is faster per element.
SMALL_TENSOR = 1 << 12
#: Elements fingerprinted in one batched pass (keeps the int64 temporaries in cache).
_BATCH_ELEMENTS = 1 << 16


def _batched_lanes(flats: list[torch.Tensor], seeds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Lane sums of several whole tensors in one pass: the fingerprint formula of
    :mod:`ckptverify._fingerprint_kernels` (each element's bits, sign-extended to 64, xor ``g * K + S``,
    mixed, summed modulo 2**64, ``g`` its index in its own tensor) with a segmented sum instead of one
    call per tensor: one set of operations and one host synchronisation for the lot."""
    import torch

    from ckptverify import _fingerprint_kernels as kern

    device = flats[0].device
    counts = torch.tensor([f.numel() for f in flats], dtype=torch.int64)
    bits = torch.cat([f.to(torch.int64) for f in flats])
    total = bits.numel()
    starts = torch.cumsum(counts, 0) - counts
    seg = torch.repeat_interleave(torch.arange(len(flats)), counts).to(device)
    g = torch.arange(total, dtype=torch.int64, device=device) - starts.to(device)[seg]
    g.mul_(kern._signed(kern.INDEX_MULTIPLIER))
    out = torch.zeros((2, len(flats)), dtype=torch.int64, device=device)
    for lane, mixer in enumerate(kern.LANES):
        lane_seeds = torch.tensor([kern._signed(sd[lane]) for sd in seeds], dtype=torch.int64, device=device)
        y = kern._mix_tensor(bits ^ (g + lane_seeds[seg]), mixer)
        out[lane].index_add_(0, seg, y)
    a, b = out.tolist()
    return list(zip(a, b, strict=True))


def fingerprint_many(tensors: list[torch.Tensor]) -> list[str]:
    """:func:`~ckptverify.fingerprint.tensor_fingerprint` values of ``tensors``, in order.

    Small plain tensors are fingerprinted together, grouped by device and element size, which saves the
    per-call cost that dominates for biases, norms and scalars (and, on accelerators, one host sync per
    tensor). DTensors and large tensors go through ``tensor_fingerprint`` one by one, in list order (DTensor
    fingerprints are collective: every rank passes the same list)."""
    import torch

    from ckptverify import _fingerprint_kernels as kern
    from ckptverify.fingerprint import TensorFingerprint, tensor_fingerprint

    out: list[str | None] = [None] * len(tensors)
    groups: dict[tuple[Any, int], list[tuple[int, torch.Tensor, str]]] = {}
    for i, t in enumerate(tensors):
        if _is_dtensor(t) or t.numel() > SMALL_TENSOR:
            out[i] = tensor_fingerprint(t).value
            continue
        name = kern.dtype_name(t.dtype)
        flat = t.detach()
        if flat.is_complex():
            flat = torch.view_as_real(flat)
        flat = flat.contiguous().reshape(-1)
        flat = flat.view(kern._INT_VIEW_BY_SIZE[flat.element_size()])
        groups.setdefault((flat.device, flat.element_size()), []).append((i, flat, name))
    for members in groups.values():
        batch: list[tuple[int, torch.Tensor, str]] = []
        size = 0
        for k, member in enumerate(members):
            batch.append(member)
            size += member[1].numel()
            if size >= _BATCH_ELEMENTS or k == len(members) - 1:
                seeds = [(kern.dtype_seed(name, 0), kern.dtype_seed(name, 1)) for _, _, name in batch]
                for (i, _, _), lanes in zip(batch, _batched_lanes([f for _, f, _ in batch], seeds), strict=True):
                    out[i] = TensorFingerprint.from_lanes(lanes, "", (), 0).value
                batch, size = [], 0
    return [v for v in out if v is not None]


# --------------------------------------------------------------------------------------------- cells


def _tensor_cell(site: str, kind: str, t: torch.Tensor, info: str = "") -> Cell:
    cell = _tensor_cells([(site, kind, t)])[0]
    return Cell(cell.site, cell.kind, cell.lanes, cell.encoding, info)


def _tensor_cells(specs: list[tuple[str, str, torch.Tensor]]) -> list[Cell]:
    """One cell per ``(site, kind, tensor)``.

    Traces compare runs of one configuration (equal headers: same world size, same sharding), so a site only
    needs a value that changes with the bits this rank holds; sharding-independence is not needed. Tensors
    in host memory therefore get an xxh3-128 digest of this rank's bytes (with dtype and shape), which
    costs a fraction of the logical fingerprint on a CPU; tensors on an accelerator get the logical
    fingerprint, computed there, in one batch (no copy to the host)."""
    out: list[Cell | None] = [None] * len(specs)
    device_side = []
    for n, (site, kind, t) in enumerate(specs):
        local = t.to_local() if _is_dtensor(t) else t
        if local.device.type == "cpu":
            out[n] = Cell(site, kind, hex_lanes(host_digest(local)), "digest128")
        else:
            device_side.append(n)
    if device_side:
        values = fingerprint_many([specs[n][2] for n in device_side])
        for n, value in zip(device_side, values, strict=True):
            out[n] = Cell(specs[n][0], specs[n][1], hex_lanes(value), "fp128")
    return [c for c in out if c is not None]


def host_digest(t: torch.Tensor) -> str:
    """xxh3-128 of a host tensor's dtype, shape and bytes (row-major)."""
    import struct

    import torch
    import xxhash

    t = t.detach().contiguous()
    h = xxhash.xxh3_128()
    h.update(str(t.dtype).encode() + b"|" + struct.pack(f"<{t.dim()}q", *t.shape))
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _summary(obj: Any) -> Any:
    """``obj`` with every tensor replaced by its fingerprint, dtype and shape (for composite digests)."""
    import torch

    from ckptverify import _fingerprint_kernels as kern

    if isinstance(obj, torch.Tensor):
        return {"fingerprint": fingerprint_many([obj])[0], "dtype": kern.dtype_name(obj.dtype),
                "shape": list(obj.shape)}
    if isinstance(obj, Mapping):
        return {str(k): _summary(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_summary(v) for v in obj]
    return obj


def _object_cell(site: str, kind: str, obj: Any, info: str = "") -> Cell:
    """A tensor's fingerprint, or the state digest of anything else (tensors inside by fingerprint)."""
    import torch

    from ckptverify.state.digest import state_digest

    if isinstance(obj, torch.Tensor):
        return _tensor_cell(site, kind, obj, info)
    return Cell(site, kind, hex_lanes(state_digest(_summary(obj))), "digest128", info)


def _metric_cell(name: str, value: Any) -> Cell:
    """A metric's exact value: numbers (and one-element real tensors) by their bits, as float64 or int64 —
    widening any real float dtype to float64 is exact — anything else by fingerprint or digest."""
    import numpy as np
    import torch

    site = f"metric.{name}"
    if isinstance(value, torch.Tensor):
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


def hparam_cells(prefix: str, optimizers: list[Any]) -> list[Cell]:
    """One exact-value cell per hyperparameter of every param group: ``<prefix><g>.<key>`` (``<prefix><o>.<g>.<key>``
    with several optimizers; a sequence such as ``betas`` one cell per element). Numbers by their bits;
    other values (``None``, strings) are left out: what drives a step's arithmetic is numeric."""
    import numpy as np

    cells: list[Cell] = []
    for o, opt in enumerate(optimizers):
        head = f"{prefix}{o}." if len(optimizers) > 1 else prefix
        for g, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key == "params":
                    continue
                items = list(enumerate(value)) if isinstance(value, list | tuple) else [(None, value)]
                for k, v in items:
                    site = f"{head}{g}.{key}" + ("" if k is None else f".{k}")
                    if isinstance(v, bool | np.bool_ | int | np.integer):
                        cells.append(Cell.from_int(site, "hparam", int(v)))
                    elif isinstance(v, float | np.floating):
                        cells.append(Cell.from_float(site, "hparam", float(v)))
                    elif hasattr(v, "numel") and v.numel() == 1 and not _is_dtensor(v):
                        cells.append(Cell.from_float(site, "hparam", float(v.detach().reshape(()).item())))
    return cells


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


def _split_leaves(flat: Mapping[str, Any], prefix: str, site_prefix: str,
                  kind: str) -> tuple[list[Cell], list[tuple[str, str, Any]]]:
    """A flattened state dict's non-tensor leaves digested together per parent name (e.g. one cell per
    optimizer param group), and its tensors as ``(site, kind, tensor)``, one site each."""
    import torch

    groups: dict[str, dict[str, Any]] = {}
    tensors: list[tuple[str, str, Any]] = []
    for name, value in flat.items():
        rest = name[len(prefix):] if name.startswith(prefix) else name
        if isinstance(value, torch.Tensor):
            tensors.append((site_prefix + rest, kind, value))
        else:
            parent, _, leaf = rest.rpartition(".")
            groups.setdefault(parent, {})[leaf] = value
    digests = [_object_cell(site_prefix + parent if parent else site_prefix.rstrip("."), kind, leaves)
               for parent, leaves in groups.items()]
    return digests, tensors


def _state_signature(state: TrainState) -> tuple[Any, ...]:
    """Identity and storage of every parameter and optimizer state tensor, and the param group layout."""
    import torch

    def key(t: Any) -> tuple[int, int]:
        local = t.to_local() if _is_dtensor(t) else t
        return id(t), local.untyped_storage().data_ptr() if local.numel() else 0

    params = tuple(key(p) for p in state.model.parameters()) if state.model is not None else ()
    buffers = tuple(key(b) for b in state.model.buffers()) if state.model is not None else ()
    optim = tuple(
        (id(p), k, key(v)) for opt in state.optimizers for p, st in opt.state.items() for k, v in st.items()
        if isinstance(v, torch.Tensor)
    )
    groups = tuple(tuple(sorted(g)) for opt in state.optimizers for g in opt.param_groups)
    return params, buffers, optim, groups


# ------------------------------------------------------------------------------------------ recorder


class TraceRecorder:
    """Records one row per training step into ``<path>/rank<r>`` (a :class:`~ckptverify.trace.TraceWriter`).

    Args:
        path: the run's trace directory; rank ``r`` writes the store ``<path>/rank<r>``.
        header: what the trace describes; its level (``metrics`` | ``state`` | ``module``) decides what is
            recorded. ``rank``/``world_size`` are filled in from ``torch.distributed`` when left ``None``.
        flush_every: rows buffered before a write.
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
        self.rank = rank
        self.run_dir = Path(path)
        self.store_path = rank_store_path(path, rank)
        self.writer = TraceWriter(self.store_path, header=self.header, flush_every=flush_every, overwrite=overwrite)
        self._model: Any = None
        self._handles: list[Any] = []
        self._module_cells: list[Cell] = []
        self._occurrences: dict[tuple[str, str], int] = {}
        self._grad_cells: list[Cell] | None = None
        self._hparam_cells: list[Cell] = []
        self._start_cells: list[Cell] = []
        self._optimizers: list[Any] = []
        self._paused = 0
        self._flat_cache: tuple[Any, dict[str, Any], dict[str, Any]] | None = None

    @property
    def records_state(self) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index("state")

    @property
    def records_modules(self) -> bool:
        return self.level == "module"

    # -------------------------------------------------------------- module hooks

    def attach(self, model: torch.nn.Module, *, optimizer: Any = None, backward: bool = True,
               include: Callable[[str, torch.nn.Module], bool] | None = None) -> None:
        """Remember ``model`` (for :meth:`record_grads`) and install the recording hooks.

        * ``optimizer`` (one or a list): at level ``state`` and above, a step pre-hook calls
          :meth:`record_grads` right before each ``optimizer.step()``, so gradients are recorded as the
          optimizer consumes them (after clipping and unscaling), wherever the loop calls ``zero_grad``.
        * At level ``module``, every module (``include(name, module)`` narrows the set) gets a forward hook
          recording its output's fingerprint, a forward pre-hook recording its inputs' (so work a parent does
          in its own ``forward`` between children shows as a child input that differs while the parent's
          does not), and with ``backward`` a full backward hook recording the fingerprint of the gradient
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
            return  # a step that is not recorded (trace_every > 1): no fingerprints to pay for
        if self._model is not None:
            self.record_grads(self._model)
        # The hyperparameters this optimizer step uses (a loop sets lr from its own counter right before it).
        self._hparam_cells = hparam_cells("hparam.", self._optimizers)

    def detach(self) -> None:
        """Remove the hooks and forget the attached model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._model = None

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

    @contextlib.contextmanager
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

    def paused(self) -> Iterator[None]:
        """Module hooks record nothing inside this block (e.g. an evaluation pass between steps)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -------------------------------------------------------------- gradients

    def _grads_of(self, model: Any) -> list[Cell]:
        return _tensor_cells([(f"grad.{canonical_name(raw_name)}", "grad", p.grad)
                              for raw_name, p in _unwrap(model).named_parameters() if p.grad is not None])

    def record_grads(self, model: torch.nn.Module | None = None) -> None:
        """Fingerprint every parameter's ``.grad`` now, for the next :meth:`record_step`.

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

    def record_step_start(self, state: TrainState | None) -> None:
        """The state a step starts from, for the next :meth:`record_step`: every random stream
        (``start.rng.<stream>``) and every optimizer hyperparameter (``start.hparam.<g>.<key>``) as they are
        before the step draws or computes anything. A stream that differs here is a cause (re-seeded, or drawn
        outside the steps), not a consequence of a different batch. Does nothing below level ``state``."""
        if not self.records_state or state is None:
            return
        from ckptverify.state.digest import state_digest
        from ckptverify.state.rng import capture_rng

        self._start_cells = [Cell(f"start.rng.{kind}", "rng", hex_lanes(state_digest(value)), "digest128")
                             for kind, value in capture_rng(state.rng.generators).items()]
        self._start_cells.extend(hparam_cells("start.hparam.", state.optimizers))

    def record_step(self, step: int, *, metrics: Mapping[str, Any] | None = None, batch: Any = None,
                    state: TrainState | None = None) -> None:
        """Record the row of ``step``: call once at the end of each step, after ``optimizer.step()``.

        * every level: ``metrics`` (name -> number or tensor) by their exact bits;
        * ``state`` and ``module``: what :meth:`record_step_start` captured when the step began (random
          streams, hyperparameters), and the hyperparameters the optimizer step used (``hparam.<g>.<key>``,
          captured by the optimizer hook);
        * ``state`` and ``module``: the ``batch`` fingerprint (a tensor, or one site per element of a
          tuple/list/dict), the gradients (those captured by :meth:`record_grads` — or the optimizer hook —
          in this step, else the ``.grad`` of ``state.model`` / the attached model as they are now;
          parameters without a gradient are not recorded), and from ``state``: optimizer state
          (``optim.<name>``, hyperparameters digested per param group), parameters and buffers
          (``param.<fqn>``), buffers registered with ``persistent=False`` (``buffer.<fqn>``: no checkpoint holds
          them), and a digest of each non-tensor field (``scheduler.<i>``, ``rng.<stream>``,
          ``data``, ``counters``, ...);
        * ``module``: the module outputs and input gradients recorded by the hooks since the last row.

        Lower levels ignore what they do not record, so the same loop works at every level. Steps must
        increase. On several ranks every rank must call this for every step (DTensor fingerprints are
        collective).
        """
        import torch

        cells: list[Cell] = list(self._start_cells) if self.records_state else []
        deep = self.records_state
        if deep and batch is not None:
            cells.extend(self._batch_cells(batch, torch))
        cells.extend(self._module_cells)
        for name, value in (metrics or {}).items():
            cells.append(_metric_cell(str(name), value))
        if deep:
            grads = self._grad_cells
            if grads is None:
                model = state.model if state is not None and state.model is not None else self._model
                grads = self._grads_of(model) if model is not None else []
            cells.extend(self._hparam_cells)
            cells.extend(grads)
            if state is not None:
                cells.extend(self._state_cells(state))
        self._module_cells = []
        self._start_cells = []
        self._hparam_cells = []
        self._occurrences.clear()
        self._grad_cells = None
        self.writer.append(step, cells)

    @staticmethod
    def _batch_cells(batch: Any, torch: Any) -> list[Cell]:
        if isinstance(batch, torch.Tensor):
            return [_tensor_cell("batch", "batch", batch)]
        if isinstance(batch, Mapping):
            return [_object_cell(f"batch.{k}", "batch", v) for k, v in batch.items()]
        if isinstance(batch, list | tuple):
            return [_object_cell(f"batch.{i}", "batch", v) for i, v in enumerate(batch)]
        return [_object_cell("batch", "batch", batch)]

    def _state_cells(self, state: TrainState) -> list[Cell]:
        from ckptverify.state.digest import state_digest

        fields = state.fields()  # first: it captures the random streams before anything else runs
        optim_flat, param_flat = self._flat_state(state)
        optim_digests, optim_tensors = _split_leaves(optim_flat, "optim.", "optim.", "optim")
        param_digests, param_tensors = _split_leaves(param_flat, "model.", "param.", "param")
        field_cells = [Cell(name, _field_kind(name), hex_lanes(state_digest(value)), "digest128")
                       for name, value in fields.items()]
        scaler = [c for c in field_cells if c.kind == "optim"]
        others = sorted((c for c in field_cells if c.kind != "optim"), key=lambda c: _FIELD_ORDER[c.kind])
        buffers = ([(f"buffer.{name}", "buffer", buf) for name, buf in non_persistent_buffers(state.model)]
                   if state.model is not None else [])
        tensor_cells = _tensor_cells([*optim_tensors, *param_tensors, *buffers])
        n_opt, n_par = len(optim_tensors), len(param_tensors)
        optim_cells, param_cells = tensor_cells[:n_opt], tensor_cells[n_opt:n_opt + n_par]
        buffer_cells = tensor_cells[n_opt + n_par:]
        return [*optim_digests, *scaler, *optim_cells, *param_digests, *param_cells, *buffer_cells, *others]

    def _flat_state(self, state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
        """Flattened optimizer and model state dicts, as ``get_state_dict`` names them.

        ``get_state_dict`` costs milliseconds a call, and between steps the tensors it returns are the same
        storage updated in place; so the names and tensors are cached while every parameter and optimizer
        state tensor keeps its identity and storage, and only the param groups' hyperparameters (which a
        scheduler changes every step) are re-read live."""
        from ckptverify.dcp.loading import flat_names

        signature = _state_signature(state)
        cached = self._flat_cache
        if cached is None or cached[0] != signature:
            model_sd, optim_sd = state._model_optim()
            optim_flat = flat_names({"optim": optim_sd}) if optim_sd else {}
            param_flat = flat_names({"model": model_sd}) if model_sd else {}
            self._flat_cache = cached = (signature, optim_flat, param_flat)
            return optim_flat, param_flat
        optim_flat = dict(cached[1])
        groups = [g for opt in state.optimizers for g in opt.param_groups]
        for name in optim_flat:
            if name.startswith("optim.param_groups."):
                index, _, key = name[len("optim.param_groups."):].partition(".")
                head, _, rest = key.partition(".")
                if head == "params" or not index.isdigit() or int(index) >= len(groups):
                    continue
                value = groups[int(index)].get(head)
                if rest:  # a sequence hyperparameter flattened per element (e.g. betas.0)
                    try:
                        value = value[int(rest)]  # type: ignore[index]
                    except (TypeError, ValueError, IndexError):
                        continue
                optim_flat[name] = value
        return optim_flat, cached[2]

    # -------------------------------------------------------------- lifetime

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Remove the hooks and write the buffered rows."""
        self.detach()
        self.writer.close()

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
