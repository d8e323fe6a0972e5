"""The per-step trace recorder: digests of what a training step saw and produced, one row per step.

Use (see ``docs/trace.md``)::

    with TraceRecorder(run_dir, header=TraceHeader(run="a", level="state")) as rec:
        rec.attach(model, optimizer=optimizer)  # gradient and module hooks
        for step in range(1, steps + 1):
            ...  # forward, backward, optimizer.step(), scheduler.step()
            rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=train_state)

Traps: ``record_step`` reads the state *after* the step. Gradients are taken right before ``optimizer.step()`` by the
``attach(..., optimizer=...)`` hook, or by :meth:`TraceRecorder.record_grads`; else from ``p.grad`` at
``record_step``, which a loop that zeroes gradients at the end of its step has already cleared."""


from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptverify.errors import UsageError
from ckptverify.state.distributed import rank_world
from ckptverify.trace.cells import (
    _metric_item,
    _scaler_item,
    _tensor_leaves,
    _value_item,
    _value_lanes,
)
from ckptverify.trace.flatten import _counters, _data_value, _layout_signature, _StateLayout, _Structure
from ckptverify.trace.hyperparams import _HparamCells
from ckptverify.trace.members import _Gradients
from ckptverify.trace.oplog import OpWindow
from ckptverify.trace.ops import DEFAULT_CHUNK_ELEMENTS, OpContext, StepTracer, write_op_log
from ckptverify.trace.readback import Item, _Deferred, _ReadBack, digest_encoding
from ckptverify.trace.sites import (
    _FIELD_ORDER,
    _WRAPPER_PARTS,
    ROOT_MODULE,
    _field_kind,
    _unwrap,
    canonical_name,
    local_view,
    module_site,
)
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

__all__ = ["TraceRecorder"]

class TraceRecorder:
    """Records one row per training step into ``<path>/rank<r>`` (a :class:`~ckptverify.trace.TraceWriter`).

    The header's level decides what is recorded and its detail whether categories get a cell per tensor;
    ``rank``/``world_size`` come from ``torch.distributed`` when ``None``. ``window``: at level ``op``, the steps,
    ranks and modules whose ops are logged (``None``: all, capped by ``OpWindow().max_ops``)."""

    def __init__(self, path: str | os.PathLike[str], *, header: TraceHeader, flush_every: int = DEFAULT_FLUSH_EVERY,
                 overwrite: bool = False, window: OpWindow | None = None,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        rank, world = rank_world()
        if header.rank is not None and header.rank != rank:
            raise UsageError(f"trace header says rank {header.rank}, but this process is rank {rank}")
        if header.world_size is not None and header.world_size != world:
            raise UsageError(f"trace header says world size {header.world_size}, but the job has {world}")
        self.header = replace(header, rank=rank, world_size=world)
        #: What the level records (each level includes the ones before it).
        self.records_state, self.records_comm, self.records_modules, self.records_ops = (
            LEVELS.index(header.level) >= LEVELS.index(x) for x in ("state", "comm", "module", "op"))
        self.detail = self.header.detail
        self.store_path = rank_store_path(path, rank)
        self.writer = TraceWriter(self.store_path, header=self.header, flush_every=flush_every, overwrite=overwrite)
        self._model: Any = None
        self._handles: list[Any] = []
        self._optimizers: list[Any] = []
        self._paused = 0
        self._structure: _Structure | None = None
        self._gradients: _Gradients | None = None
        self._layout: _StateLayout | None = None
        self._streams: tuple[Any, Any] | None = None  # (generators' key, their StreamDigests)
        self._rng_cells_made: dict[tuple[str, str], tuple[str, Cell]] = {}
        self._hparams = _HparamCells("hparam.", self.detail)
        self._start_hparams = _HparamCells("start.hparam.", self.detail)
        self._grad_version = -1
        self._last: tuple[int, list[Any], list[int]] | None = None
        self._kept: tuple[int, list[Any], list[int]] | None = None
        self._hook_warning = _HookWarningGuard()
        self._pending: tuple[int, _ReadBack] | None = None
        self._pinned: dict[Any, Any] = {}
        # Running forwards are the context's frames (the tracer reads where an op runs from them).
        self._context = OpContext()
        self._frames = self._context.forward
        self._forget_step()
        self._tracer: StepTracer | None = None
        self._step_started: int | None = None
        self._last_step = 0
        self._encoding_seen = False
        if self.records_comm:
            if chunk_elements < 1:
                raise UsageError(f"chunk_elements must be positive, got {chunk_elements}")
            self._tracer = StepTracer(self._context, rank=rank,
                                      window=(window or OpWindow()) if self.records_ops else None, emit=self._emit,
                                      fill=self._fill, chunk_elements=chunk_elements)

    def _emit(self, item: Any) -> int:
        """Append a step item (``None``: a slot to :meth:`_fill` later); returns its index."""
        self._module_cells.append(item)
        return len(self._module_cells) - 1

    def _fill(self, index: int, item: Any) -> None:
        self._module_cells[index] = item

    @contextlib.contextmanager
    def _own_work(self) -> Iterator[None]:
        """The recorder's own tensor work in a traced step (digests in hooks): not traced as the step's ops."""
        tracer = self._tracer
        if tracer is None or not tracer.active:
            yield
            return
        tracer.quiet += 1
        try:
            yield
        finally:
            tracer.quiet -= 1

    def _version(self) -> int:
        if self._structure is None:
            self._structure = _Structure()
        return self._structure.version

    def attach(self, model: torch.nn.Module, *, optimizer: Any = None, backward: bool = True,
               include: Callable[[str, torch.nn.Module], bool] | None = None) -> None:
        """Remember ``model`` and install the recording hooks.

        ``optimizer`` (one or a list), level ``state`` and up: a step pre-hook calls :meth:`record_grads`, so
        gradients are recorded as the optimizer consumes them (after clipping, unscaling). Level ``module``: every
        module (narrowed by ``include(name, module)``) gets hooks for its inputs, outputs and, with ``backward``,
        input gradients; input sites show work a parent does between its children."""
        if self._model is not None:
            raise UsageError("a model is already attached; call detach() first")
        self._model = model
        if optimizer is not None and self.records_state:
            self._optimizers = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
            self._handles.extend(opt.register_step_pre_hook(self._optimizer_hook) for opt in self._optimizers)
        if not self.records_modules:
            return
        inner = _unwrap(model)
        for raw_name, module in inner.named_modules():
            name = canonical_name(raw_name) or ROOT_MODULE
            # A wrapper's inner module is skipped: the wrapper already records this output.
            if (include is not None and not include(name, module)) or raw_name.split(".")[-1] in _WRAPPER_PARTS:
                continue
            cls = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._input_hook(name, cls)))
            # always_call: non-reentrant checkpointing stops a recompute by raising; the frame must still pop.
            self._handles.append(module.register_forward_hook(self._forward_hook(name, cls), always_call=True))
            if backward:
                self._handles.append(module.register_full_backward_pre_hook(self._backward_pre_hook(name)))
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name, cls)))

    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._paused:
            return  # a step that is not recorded (trace_every > 1): no digests to pay for
        with self._own_work():
            if self._model is not None:
                self.record_grads(self._model)
            # Read here: a loop may set lr right before the step.
            self._hparam_cells = self._hparams(self._optimizers)

    def detach(self) -> None:
        """Remove the hooks and forget the attached model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hook_warning.reset()
        self._model = None
        self._gradients = None

    def _next(self, name: str, direction: str) -> int:
        key = (name, direction)
        k = self._occurrences.get(key, 0)
        self._occurrences[key] = k + 1
        return k

    def _input_hook(self, name: str, cls: str) -> Callable[..., None]:
        import torch

        task = torch._C._current_graph_task_id

        guard = self._hook_warning

        def hook(module: Any, args: Any) -> None:
            guard.called(name, args)
            if self._paused:
                return
            if task() == -1:
                occ = self._next(name, "in")
                with self._own_work():
                    self._module_cells.append(_value_item(module_site(name, "in", occ), "module_in", args, cls))
                call = len(self._calls)
                self._calls.append((name, occ, []))
                self._calls_of.setdefault(name, []).append(call)
                if self._frames and not self._frames[-1][3]:
                    self._calls[self._frames[-1][2]][2].append(call)
                self._frames.append([name, occ, call, False, 0])
            else:
                # A forward while the autograd engine runs: activation checkpointing recomputes it.
                call = self._repeated_call(name)
                self._frames.append([name, None if call is None else self._calls[call][1], call, True, 0])

        return hook

    def _repeated_call(self, name: str) -> int | None:
        """The forward call of ``name`` a recompute starting now repeats: inside a recomputed parent, its next child
        call of that module; else the latest call not yet repeated (regions recompute last first)."""
        parent = self._frames[-1] if self._frames and self._frames[-1][3] else None
        found = None
        if parent is not None:
            if parent[2] is not None:
                children = self._calls[parent[2]][2]
                while parent[4] < len(children):
                    child = children[parent[4]]
                    parent[4] += 1
                    if self._calls[child][0] == name:
                        found = child
                        break
        else:
            for call in reversed(self._calls_of.get(name, ())):
                if call not in self._paired:
                    found = call
                    break
        if found is not None:
            self._paired.add(found)
        return found

    def _forward_hook(self, name: str, cls: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._paused:
                return
            frame = self._frames.pop() if self._frames else None
            if sys.exc_info()[0] is not None:
                return  # called while the forward raises: it has no output
            with self._own_work():
                if frame is not None and frame[3]:
                    if frame[1] is not None:  # the pair of forward occurrence frame[1]
                        site = module_site(name, "recompute", frame[1])
                        self._module_cells.append(_value_item(site, "module_recompute", output, cls))
                    return
                site = module_site(name, "fwd", self._next(name, "fwd"))
                self._module_cells.append(_value_item(site, "module_out", output, cls))

        return hook

    def _backward_pre_hook(self, name: str) -> Callable[..., None]:
        guard = self._hook_warning

        def hook(module: Any, grad_output: Any) -> None:
            guard.enter(name, module)
            if not self._paused and self.records_ops:
                self._context.backward.append(name)

        hook._ckptverify_hook = True  # type: ignore[attr-defined]
        return hook

    def _backward_hook(self, name: str, cls: str) -> Callable[..., None]:
        guard = self._hook_warning

        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            guard.leave(name)
            if self._paused:
                return
            stack = self._context.backward
            if name in stack:
                del stack[len(stack) - 1 - stack[::-1].index(name)]
            with self._own_work():
                site = module_site(name, "bwd", self._next(name, "bwd"))
                self._module_cells.append(_value_item(site, "module_grad_in", grad_input, cls))

        hook._ckptverify_hook = True  # type: ignore[attr-defined]
        return hook

    def _forget_step(self) -> None:
        """Drop what the hooks gathered for the step."""
        self._module_cells: list[Item | None] = []
        self._start_cells: list[Cell] = []
        self._grad_cells: list[Item] | None = None
        self._hparam_cells: list[Item] = []
        self._occurrences: dict[tuple[str, str], int] = {}
        self._frames.clear()
        # Recompute pairing: the step's calls (name, occurrence, children), calls per module, calls already repeated.
        self._calls: list[tuple[str, int, list[int]]] = []
        self._calls_of: dict[str, list[int]] = {}
        self._paired: set[int] = set()

    def begin_skipped_step(self) -> None:
        """A step that will not be recorded begins: hooks gather nothing until :meth:`skip_step`."""
        self._paused += 1

    def skip_step(self) -> None:
        """End a step begun with :meth:`begin_skipped_step`: forget anything gathered for it."""
        self._paused -= 1
        self._forget_step()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Module hooks record nothing inside this block (e.g. an evaluation pass between steps)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _grads_of(self, model: Any) -> list[Item]:
        grads = self._gradients
        if grads is None or grads.model is not model or self._grad_version != self._version():
            self._grad_version = self._version()
            grads = self._gradients = _Gradients(model)
        return grads.cells(self.detail)

    def record_grads(self, model: torch.nn.Module | None = None) -> None:
        """Digest every parameter's ``.grad`` now, for the next :meth:`record_step` (no-op below level ``state``).
        Without the optimizer hook, call it after ``backward()`` and clipping, before ``zero_grad()``; a later call
        in the step replaces the earlier one. ``model`` defaults to the attached one."""
        if not self.records_state:
            return
        model = model if model is not None else self._model
        if model is None:
            raise UsageError("record_grads() needs a model: pass one or call attach(model) first")
        with self._own_work():
            self._grad_cells = self._grads_of(model)

    def _rng_cells(self, prefix: str, state: TrainState) -> list[Cell]:
        """A digest cell per random stream (``<prefix><kind>``), reusing the cell of a stream that did not move."""
        from ckptverify.trace.streams import StreamDigests

        gens = state.rng.generators
        key = (id(state), tuple((name, id(g)) for name, g in gens.items()))
        if self._streams is None or self._streams[0] != key:
            self._streams = (key, StreamDigests(gens))
        out = []
        cache = self._rng_cells_made
        for kind, value in self._streams[1].current().items():
            hit = cache.get((prefix, kind))
            if hit is None or hit[0] != value:
                hit = cache[(prefix, kind)] = (value, Cell(f"{prefix}{kind}", "rng", hex_lanes(value), "digest128"))
            out.append(hit[1])
        return out

    def record_step_start(self, state: TrainState | None, *, step: int | None = None) -> None:
        """Capture the state a step starts from for the next :meth:`record_step`: random streams (``start.rng.*``)
        and hyperparameters (``start.hparam.*``), so a stream that differs here is a cause (re-seeded, drawn outside
        the steps), not a consequence. At level ``comm`` and up also starts tracing the step's ops; ``step``
        (default: last recorded + 1) is what the op window matches."""
        if self.records_state and state is not None:
            self._start_cells = [*self._rng_cells("start.rng.", state), *self._start_hparams(state.optimizers)]
        if self._tracer is not None:
            if self._tracer.active:
                self._tracer.end()  # a step started twice: the first start's ops are forgotten
            self._step_started = self._last_step + 1 if step is None else int(step)
            self._tracer.begin(self._step_started)

    def record_step(self, step: int, *, metrics: Mapping[str, Any] | None = None, batch: Any = None,
                    state: TrainState | None = None, batch_indices: Any = None) -> None:
        """Record the row of ``step``; call once at the end of each step, after ``optimizer.step()``.

        Records metrics by their exact bits at every level; from ``state`` up, the step-start cells, hyperparameters,
        ``batch_indices``, batch, gradients (from :meth:`record_grads` or the hook, else the current ``.grad``) and
        the state's categories and fields; ``comm``/``module``/``op`` add their sites (site names:
        ``docs/trace.md``). Lower levels ignore what they do not record. Steps must increase; on several ranks every
        rank must call this for every step."""
        op_items: list[Item] = []
        if self._tracer is not None and self._tracer.active:
            lanes, records, dropped = self._tracer.end()
            if self._tracer.ops_on:
                if self._step_started != step:
                    raise UsageError(f"the step began as step {self._step_started} (record_step_start) but is "
                                     f"recorded as step {step}")
                op_items = self._op_log_items(step, lanes, records, dropped, self._tracer.chunk_elements)
        self._last_step = int(step)
        if self.header.digest_encoding == "unknown" and not self._encoding_seen:
            self._encoding_seen = True
            self._fill_encoding(state, batch, metrics)
        cells: list[Item] = list(self._start_cells) if self.records_state else []
        deep = self.records_state
        if deep and batch_indices is not None:
            cells.append(Cell("data.indices", "data", _value_lanes(batch_indices), "digest128"))
        if deep and isinstance(batch, Mapping):
            cells.extend(_value_item(f"batch.{k}", "batch", v) for k, v in batch.items())
        elif deep and isinstance(batch, list | tuple):
            cells.extend(_value_item(f"batch.{i}", "batch", v) for i, v in enumerate(batch))
        elif deep and batch is not None:
            cells.append(_value_item("batch", "batch", batch))
        cells.extend(x for x in self._module_cells if x is not None)
        for name, value in (metrics or {}).items():
            cells.append(_metric_item(str(name), value))
        if self._last is not None:
            self._kept = self._last  # the row before: what a check one step late reads
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
        cells.extend(op_items)
        self._forget_step()
        # Device values are read back once, when the next step is recorded (or at flush): nothing waits here.
        self._settle()
        if any(type(x) is _Deferred for x in cells):
            self._pending = (step, _ReadBack(cells, self._pinned))
        else:
            self.writer.append(step, cells)  # type: ignore[arg-type]

    def _fill_encoding(self, state: TrainState | None, batch: Any, metrics: Mapping[str, Any] | None) -> None:
        """Set the header's ``digest_encoding`` from where the first row's tensors live (the model's parameters, else
        the batch or a metric); a row of numbers only leaves it ``unknown``."""
        if self.records_state:
            model = state.model if state is not None and state.model is not None else self._model
            found = next(iter(model.parameters()), None) if model is not None else None
            if found is None:
                found = next(iter(_tensor_leaves([batch, dict(metrics or {})], [])), None)
        else:
            found = next((t for t in _tensor_leaves(dict(metrics or {}), []) if t.numel() != 1), None)
        if found is None:
            return
        self.header = replace(self.header, digest_encoding=digest_encoding(local_view(found).device.type == "cpu"))
        self.writer.set_header(self.header)

    def _op_log_items(self, step: int, lanes: list[Any], records: list[dict[str, Any]], dropped: int,
                      chunk: int) -> list[Item]:
        """Write the op log of ``step`` now (all digests on the host), or return the item that writes it once the
        device digests are read back with the row."""
        if not lanes:
            write_op_log(self.store_path, step, records, dropped, [], chunk)
            return []
        import torch

        def make(values: list[int]) -> list[Cell]:
            write_op_log(self.store_path, step, records, dropped, values, chunk)
            return []

        return [_Deferred(torch.cat(lanes), make)]

    def _settle(self) -> None:
        """Write the row whose values were still on their way from the device."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.writer.append(pending[0], pending[1].cells())

    def _state_cells(self, step: int, state: TrainState) -> list[Item]:
        rng = self._rng_cells("rng.", state)  # first, as TrainState.fields() does: reading the rest may draw
        fields = self._field_cells(state, rng)
        # The scaler's tensors are read back with the row, not by state_dict()'s two .item() syncs.
        scaler = [] if state.scaler is None else [_scaler_item("scaler", _field_kind("scaler"), state.scaler)]
        others = sorted(fields, key=lambda c: _FIELD_ORDER[c.kind])
        layout, digests, lanes = self._members(state)
        lo, hi = layout.digester.bounds[1:3]
        if lanes is None:
            optim, params, buffers = layout.digester.cells(digests, self.detail)
            self._last = (step, layout.params.tensors, digests[lo:hi])
        else:
            made: list[list[list[Cell]]] = []

            def part(k: int) -> _Deferred:
                def make(values: list[int]) -> list[Cell]:
                    if not made:
                        full = layout.digester.fill(digests, values)
                        self._last = (step, layout.params.tensors, full[lo:hi])
                        made.append(layout.digester.cells(full, self.detail))
                    return made[0][k]

                return _Deferred(lanes, make)

            optim, params, buffers = [part(0)], [part(1)], [part(2)]  # type: ignore[list-item]
        return [*layout.optim_leaves.cells(), *scaler, *optim, *layout.param_leaves.cells(), *params, *buffers,
                *others]

    def _members(self, state: TrainState) -> tuple[_StateLayout, list[int], Any]:
        """The layout, its optimizer-state/parameter/buffer member digests, and the device lane sums not yet read
        back (``None`` when all are on the host)."""
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
        """One digest cell per non-tensor field of ``state``, exactly ``state_digest`` of what
        ``TrainState.fields()`` returns for it (random streams come in ``rng``); the caller orders them by kind."""
        values: dict[str, Any] = {"counters": _counters(state.counters)}
        values.update((f"scheduler.{i}", sched.state_dict()) for i, sched in enumerate(state.schedulers))
        if state.dataloader is not None:
            values["data"] = _data_value(state)
        values.update((f"extras.{name}", obj.state_dict()) for name, obj in state.extras.items())
        return [*(Cell(name, _field_kind(name), _value_lanes(v), "digest128") for name, v in values.items()), *rng]

    def step_digests(self, step: int, tensors: list[Any]) -> list[int | None]:
        """The member digests the row of ``step`` (one of the last two) holds for ``tensors``, matched by storage;
        ``None`` where not digested. Waits for the last row's device read-back if still pending."""
        if self._pending is not None and self._pending[0] == step:
            self._settle()
        found = next((x for x in (self._last, self._kept) if x is not None and x[0] == step), None)
        if found is None:
            return [None] * len(tensors)
        _, members, digests = found

        def storage(t: Any) -> tuple[Any, ...] | None:
            local = local_view(t)
            return (local.device, local.data_ptr(), local.dtype, tuple(local.shape), local.stride()) \
                if local.numel() else None

        index = {storage(t): d for t, d in zip(members, digests, strict=True)}
        index.pop(None, None)
        return [index.get(storage(t)) for t in tensors]

    def flush(self) -> None:
        """Write the buffered rows and wait until they are committed."""
        self._settle()
        self.writer.flush()

    def close(self) -> None:
        """Remove the hooks and write the buffered rows."""
        if self._tracer is not None:
            self._tracer.close()  # a step begun and never recorded: nothing of it is written
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


_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"


class _HookWarningGuard:
    """Keeps torch's "Full backward hook is firing ... since no inputs require gradients" warning from showing at the
    user's ``backward()`` for our own hooks.

    Torch gives it between a module's backward pre-hooks and full hooks when no input needed a gradient. Only for a
    module whose every call was like that and that has no backward hook but ours (and no global one) is it silenced;
    otherwise the user's hooks would give it anyway."""

    def __init__(self) -> None:
        self._grad_free: set[str] = set()  # modules called with no input that needs a gradient
        self._needs_grad: set[str] = set()  # modules called with an input that does
        self._held: list[tuple[str, Any]] = []

    def called(self, name: str, args: Any) -> None:
        """A forward call of module ``name`` with positional ``args`` (what torch checks) starts."""
        import torch

        needs = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        (self._needs_grad if needs else self._grad_free).add(name)

    def enter(self, name: str, module: Any) -> None:
        """Module ``name``'s backward pre-hook fires: silence the warning if it is about to be given for us."""
        if name not in self._grad_free or name in self._needs_grad or not _only_our_hooks(module):
            return
        held = warnings.catch_warnings()
        held.__enter__()
        warnings.filterwarnings("ignore", message=_HOOK_WARNING, category=UserWarning)
        self._held.append((name, held))

    def leave(self, name: str) -> None:
        """Module ``name``'s full backward hook fires: the warning, if any, has been given."""
        if self._held and self._held[-1][0] == name:
            self._held.pop()[1].__exit__(None, None, None)

    def reset(self) -> None:
        while self._held:
            self._held.pop()[1].__exit__(None, None, None)
        self._grad_free.clear()
        self._needs_grad.clear()


def _only_our_hooks(module: Any) -> bool:
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_backward_hooks", None) or \
            getattr(torch_module, "_global_backward_pre_hooks", None):
        return False
    hooks = [*module._backward_hooks.values(), *module._backward_pre_hooks.values()]
    return all(getattr(h, "_ckptverify_hook", False) for h in hooks)
