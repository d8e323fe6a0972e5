"""Levels ``comm`` and ``op``: a dispatch mode that sees every op of a traced step (phases, keys: ``docs/trace.md``).

Level ``comm``: each collective's input is fingerprinted at issue and its output at completion (a functional one's at
``wait_tensor``, a c10d op's in a callback on its work's future), so in-place changes made afterwards (FSDP2's
division) are excluded and no output is kept alive; on a device the read is ordered after the collective and before
the issuing stream's next work, without host synchronization. Level ``op``, inside an
:class:`~ckptverify.trace.oplog.OpWindow`: every op's inputs, arguments and outputs to ``ops/step<N>.json``. Memory
no op wrote (``empty*``, overwritten ``self``, ``out=`` buffers) is never compared. In backward an op may be
attributed to the wrong module when autograd interleaves independent branches."""

from __future__ import annotations

import functools
import io
import json
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import xxhash

from ckptverify.ownfiles.names import own_folder, write_atomic
from ckptverify.trace import kernel
from ckptverify.trace.category import host_digest, pair_digests
from ckptverify.trace.cells import _tensor_item
from ckptverify.trace.comm import COMM_NAMESPACES, RECV, UNSET, _name, argument, bound, comm_info, comm_site, is_comm
from ckptverify.trace.oplog import MAX_ARGUMENT_NAME, MAX_ARGUMENT_TEXT, OP_LOG_VERSION, CommInfo, OpWindow, op_log_path
from ckptverify.trace.readback import _on_host
from ckptverify.trace.sites import is_dtensor

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ORDER_SENSITIVE", "OpContext", "StepTracer", "write_op_log"]


#: Ops whose integer outputs are orders or positions: also chunk-wise cells, so a difference names its chunk.
ORDER_SENSITIVE = frozenset({
    "sort", "argsort", "topk", "max", "min", "kthvalue", "mode", "median", "nanmedian", "argmax", "argmin",
    "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "searchsorted", "bucketize", "nonzero",
    "multinomial", "histc", "bincount", "cummax", "cummin",
})

DEFAULT_CHUNK_ELEMENTS = 4096

#: In-place ops that overwrite ``self`` whole: its prior content (often never written) is not an input.
_OVERWRITE = frozenset({"copy_", "fill_", "zero_", "random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                        "geometric_", "log_normal_", "cauchy_", "set_", "resize_", "resize_as_", "_foreach_zero_",
                        "_foreach_copy_"})

#: Ops that resize ``self``: grown, it holds memory no op wrote.
_RESIZE = frozenset({"resize_", "resize_as_"})


#: c10d ops that read and write their first tensor list in place.
_INPLACE_COMM = frozenset({"allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"})


class OpContext:
    """Where the step is (module stacks, optimizer depth, whether a backward ran): written by the recorder's hooks,
    read by the tracer."""

    def __init__(self) -> None:
        #: Running forwards, innermost last: ``[module, occurrence, call, recompute, cursor]`` (the recorder's
        #: recompute pairing reads the rest).
        self.forward: list[list[Any]] = []
        self.backward: list[str] = []
        self.reset()

    def reset(self) -> None:
        self.forward.clear()
        self.backward.clear()
        self.optimizer = 0
        self.backward_seen = False

    def where(self) -> tuple[str, str]:
        """``(phase, module)`` of an op running now."""
        import torch

        if self.optimizer:
            return "optimizer", self.forward[-1][0] if self.forward else ""
        if self.forward and self.forward[-1][3]:
            return "recompute", self.forward[-1][0]
        if torch._C._current_graph_task_id() != -1:
            self.backward_seen = True
            return "backward", self.backward[-1] if self.backward else ""
        if self.forward:
            return "forward", self.forward[-1][0]
        return ("other" if self.backward_seen else "forward"), ""


class _Digests:
    """Fingerprints of the tensors an op reads and writes: host tensors now, device tensors on the device (read back
    with the row). A tensor met again with the same version counter reuses its digest; values are ints or ``("dev",
    i)`` handles into the device lanes."""

    def __init__(self) -> None:
        self.lanes: list[Any] = []  # (1, 2) int64 tensors on a device
        self._seen: dict[int, tuple[Any, int, Any]] = {}
        # Collective outputs are digested on gloo's worker thread: append and index must be atomic.
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.lanes = []
        self._seen.clear()

    def __call__(self, t: Any) -> Any:
        import torch

        if is_dtensor(t):
            t = t.to_local()
        elif type(t).__name__ == "AsyncCollectiveTensor":
            # Waited on anyway; what was known while in flight is stale (no version bump).
            t = t.trigger_wait()
            self.forget(t)
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_meta:
            return None
        version = t._version
        hit = self._seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        value = self._fresh(t)
        self._seen[id(t)] = (weakref.ref(t), version, value)
        return value

    def forget(self, t: Any) -> None:
        """``t`` was written without its version counter moving (a collective): digest it afresh next time."""
        self._seen.pop(id(t), None)

    def fresh(self, t: Any) -> Any:
        """The digest of ``t`` now, whatever was known of it."""
        self.forget(t)
        return self(t)

    def uninitialised(self, t: Any) -> None:
        """Mark ``t`` as uninitialised memory (an ``empty*`` output): not compared until written."""
        self._seen[id(t)] = (weakref.ref(t), t._version, None)

    def chunks(self, t: Any, size: int) -> list[Any]:
        """Digests of consecutive chunks of ``size`` elements of ``t`` (flattened)."""
        flat = t.detach().reshape(-1)
        return [self._fresh(flat[i:i + size]) for i in range(0, flat.numel(), size)]

    def _fresh(self, t: Any) -> Any:
        if _on_host(t):
            return host_digest(t)
        from ckptverify.fingerprint import kernels as kern

        lanes = kern.lanes_many([t.detach()])
        with self._lock:
            self.lanes.append(lanes)
            return "dev", len(self.lanes) - 1


def _after_read(tensors: list[Any]) -> tuple[Any, Any] | None:
    """``(device, event)`` after the fingerprint kernels just enqueued for ``tensors`` (``None`` on the host). The
    tensors are recorded on that stream, so memory their owner frees meanwhile is not reused before the read."""
    cuda = [t for t in tensors if t.device.type == "cuda"]
    if not cuda:
        return None
    import torch

    device = cuda[0].device
    stream = torch.cuda.current_stream(device)
    for t in cuda:
        t.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return device, event


def _wait_for(events: list[tuple[Any, Any]]) -> None:
    """Make each device's current stream wait for ``events``, without a host wait."""
    import torch

    for device, event in events:
        torch.cuda.current_stream(device).wait_event(event)


def _leaves(obj: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(obj) if isinstance(x, torch.Tensor)]


class StepTracer:
    """The dispatch mode of one recorder, entered per traced step (:meth:`begin`) and left at :meth:`end`.
    ``emit(item) -> index`` appends a step item; ``fill(index, item)`` fills a slot ``emit(None)`` kept."""

    def __init__(self, context: OpContext, *, rank: int, window: OpWindow | None,
                 emit: Callable[[Any], int], fill: Callable[[int, Any], None],
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        self.context = context
        self.rank = rank
        self.window = window
        self.chunk_elements = chunk_elements
        self._emit, self._fill = emit, fill
        self._counter: Counter[tuple[int, ...]] = Counter()
        self._digests = _Digests()
        self._mode: Any = None
        #: A step is begun and not yet ended.
        self.active = False
        self._kernels = False
        self._hooks: list[Any] = []
        self.step = 0
        self.ops_on = False
        #: Above 0 during the recorder's own tensor work: not traced.
        self.quiet = 0
        #: Moves at each begin and end, so a late callback of another step takes nothing.
        self._generation = 0
        self._nvtx = False
        self._new_step()

    def _new_step(self) -> None:
        """Forget the ops and collectives of the step before."""
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self._occ: dict[tuple[str, str, str], int] = {}
        self._comm_occ: dict[tuple[tuple[int, ...], str], int] = {}
        #: Collectives whose output is held until taken: (tensors, sites, note, event index or -1, slots).
        self._pending: list[tuple[list[Any], list[str], str, int, list[int]]] = []
        self._callbacks: list[Any] = []
        self._read_events: list[Any] = []
        #: Functional collective results not waited on (in flight). A c10d op's buffers are not tracked: its
        #: ``Work`` is waited on out of sight, so later readers read them complete.
        self._flying: set[int] = set()
        self._digests.reset()
        self.context.reset()

    def begin(self, step: int) -> None:
        """Start traced step ``step``: enter the dispatch mode in the op window, else route collectives through
        :func:`_comm_kernels` to this tracer."""
        global _ACTIVE

        self.step, w = step, self.window
        self.ops_on = (w is not None and (w.steps is None or step in w.steps)
                       and (w.ranks is None or self.rank in w.ranks))
        self._new_step()
        self._generation += 1
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        ctx = self.context

        def pre(*_: Any) -> None:
            ctx.optimizer += 1

        def post(*_: Any) -> None:
            ctx.optimizer = max(0, ctx.optimizer - 1)

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self.active = True
        if self.ops_on:
            # NVTX range per op so `nsys` maps kernels to sites (docs/locate.md).
            self._nvtx = kernel.nvtx_enabled()
            self._mode = _mode_class()(self)
            self._mode.__enter__()
        else:
            if not self._kernels:
                _comm_kernels(True)
                self._kernels = True
            _ACTIVE = self

    def close(self) -> None:
        """Leave a step begun and never ended; give up the collectives' kernels."""
        if self.active:
            self.end()
        if self._kernels:
            self._kernels = False
            _comm_kernels(False)

    def end(self) -> tuple[list[Any], list[dict[str, Any]], int]:
        """Leave the mode, wait for running c10d collectives' outputs, take those not waited on. Returns the device
        lanes, the op records and the count of ops left out."""
        global _ACTIVE

        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        if _ACTIVE is self:
            _ACTIVE = None
        self.active = False
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        callbacks, self._callbacks = self._callbacks, []
        for future in callbacks:
            future.wait()  # raises what a callback of ours raised; a failed collective it ignores
        self._generation += 1
        for entry in self._pending:
            self._complete(entry)
        self._pending = []
        events, self._read_events = self._read_events, []
        _wait_for(events)
        self.context.reset()
        lanes, self._digests.lanes = self._digests.lanes, []
        return lanes, self.events, self.dropped

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.quiet:
            return func(*args, **kwargs)
        comm = is_comm(func)
        if func.namespace == "_c10d_functional" and _name(func) == "wait_tensor" and self._pending:
            out = func(*args, **kwargs)
            self._waited(args[0] if args else kwargs["tensor"])
            return self._record(func, args, kwargs, already=out) if self.ops_on else out
        if not comm and not self.ops_on:
            return func(*args, **kwargs)
        info = comm_info(func, args, kwargs, self._counter) if comm else None
        if info is None:
            return self._record(func, args, kwargs) if self.ops_on else func(*args, **kwargs)
        ins, outs = self._comm_tensors(func, args)
        k = self._comm_occ.get((info.group, info.collective), 0)
        self._comm_occ[(info.group, info.collective)] = k + 1
        note = _comm_note(info, ins or outs)
        many = len(ins) > 1
        for i, t in enumerate(ins):
            self._emit(_tensor_item(comm_site(info, k, "in", i if many else None), "comm_in", t.detach(), note))
        before = len(self.events)
        result = self._record(func, args, kwargs, comm=info) if self.ops_on else func(*args, **kwargs)
        functional = func.namespace == "_c10d_functional"
        if functional:
            outs = _leaves(result)
            self._flying.update(id(t) for t in outs)
        if outs:
            many = len(outs) > 1
            sites = [comm_site(info, k, "out", i if many else None) for i in range(len(outs))]
            index = before if len(self.events) > before else -1
            places = [self._emit(None) for _ in outs]
            entry = (outs, sites, note, index, places)
            if functional or not self._at_completion(result, entry, argument(func, args, kwargs, "async_op")):
                self._pending.append(entry)
        return result

    def _at_completion(self, result: Any, entry: tuple[list[Any], list[str], str, int, list[int]],
                       async_op: Any) -> bool:
        """Take the c10d op's outputs when its work completes (a future callback holding weak references only);
        ``False`` when the work has no future, so the caller keeps them until the step ends."""
        import torch

        # The ``Work`` the op returned (alone, or after its tensors).
        boxed = [x for x in (result if isinstance(result, tuple | list) else (result,))
                 if isinstance(x, torch.ScriptObject)]
        try:  # no Work, or one without a future ("Work::getFuture not implemented": gloo's send and recv)
            future = torch._C._distributed_c10d.Work.unbox(boxed[0]).get_future()
        except (IndexError, RuntimeError, TypeError, AttributeError):
            return False
        outs, sites, note, index, places = entry
        refs = [weakref.ref(t) for t in outs]
        generation = self._generation
        read: list[Any] = []

        def taken(done: Any) -> None:
            try:
                done.value()
            except Exception:  # the collective failed: its caller is told so by its own wait()
                return
            tensors = [r() for r in refs]
            if generation != self._generation or any(t is None for t in tensors):
                return  # another step's, or gone before its work completed: nothing to take
            self._complete((tensors, sites, note, index, places))  # type: ignore[arg-type]
            after = _after_read(tensors)
            if after is not None:
                read.append(after)
                self._read_events.append(after)

        self._callbacks.append(future.then(taken))
        if async_op is False:
            # NCCL runs the callback inline at enqueue: the issuing stream must not overwrite the output (FSDP2's
            # division) before the fingerprint has read it.
            _wait_for(read)
        return True

    def _comm_tensors(self, func: Any, args: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
        """The tensors a collective reads at issue and those it writes, by its kind."""
        name = _name(func)
        if func.namespace != "c10d":
            return _leaves(args), []
        first = _leaves(args[0]) if args else []
        if name in _INPLACE_COMM:
            return first, first
        if name == "send":
            return first, []
        if name in RECV:
            return [], first
        return (_leaves(args[1]) if len(args) > 1 else []), first

    def _waited(self, tensor: Any) -> None:
        """A functional collective's output was waited on: take it now."""
        keep = []
        for entry in self._pending:
            if any(t is tensor for t in entry[0]):
                self._complete(entry)
            else:
                keep.append(entry)
        self._pending = keep

    def _complete(self, entry: tuple[list[Any], list[str], str, int, list[int]]) -> None:
        tensors, sites, note, index, places = entry
        self._flying.difference_update(id(t) for t in tensors)
        for t, site, place in zip(tensors, sites, places, strict=True):
            self._fill(place, _tensor_item(site, "comm_out", t.detach(), note))
        if index >= 0:
            self.events[index]["u"] = [self._digests.fresh(t) for t in tensors]

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, comm: CommInfo | None = None,
                already: Any = None) -> Any:
        phase, module = self.context.where()
        w = self.window
        assert w is not None
        if w.modules is not None and not any(module == m or module.startswith(m + ".") for m in w.modules):
            return func(*args, **kwargs) if already is None else already
        if len(self.events) >= w.max_ops:
            self.dropped += 1
            return func(*args, **kwargs) if already is None else already
        op = str(func)
        key3 = (phase, module, op)
        occ = self._occ.get(key3, 0)
        self._occ[key3] = occ + 1
        if w.capture is not None and tuple(w.capture) == (self.step, phase, module, op, occ):
            _capture(w.capture_path, op, args, kwargs)
        name = _name(func)
        digest = self._digests
        if comm is not None and name in RECV:
            ins: list[Any] = [None for _ in _leaves(args)]
        else:
            # Not inputs: out= buffers, collective buffers in flight, a self the op overwrites whole.
            outs_named = _out_arguments(func)
            read = {k: v for k, v in kwargs.items() if k not in outs_named} if outs_named else kwargs
            flying = self._flying
            ins = [None if id(t) in flying else digest(t) for t in _leaves((args, read))]
            if name in _OVERWRITE and args:
                overwritten = len(_leaves(args[0]))
                ins[:overwritten] = [None] * overwritten
        arguments = _arguments(func, args, kwargs)
        size_before = args[0].numel() if name in _RESIZE and args and hasattr(args[0], "numel") else None
        if already is not None:
            out = already
        elif self._nvtx:
            with kernel.nvtx_site(kernel.site_name((self.step, phase, module, op, occ))):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        results = _leaves(out)
        if comm is None and not results:
            # Returns nothing but writes its arguments (``_foreach_add_``).
            results = _written(func, args, kwargs)
        if comm is not None:
            outs: list[Any] = [None] * len(results)  # in flight: taken at completion
            for t in (*_leaves(args), *results):
                digest.forget(t)
        elif (name == "empty" or name.startswith(("empty_", "new_empty", "_empty"))
              or (size_before is not None and any(t.numel() > size_before for t in results))):
            outs = [None] * len(results)  # memory no op wrote: an allocation, or what a resize added
            for t in results:
                digest.uninitialised(t)
        elif name in ("copy_", "_to_copy", "to") and argument(func, args, kwargs, "non_blocking"):
            outs = [None] * len(results)
        else:
            returns = func._schema.returns
            outs = []
            for i, t in enumerate(results):
                alias = returns[i].alias_info if i < len(returns) and len(returns) == len(results) else None
                if alias is not None and not alias.is_write:
                    outs.append(None)  # a view: its values are its base's
                elif alias is not None or not returns:
                    # In place: the version counter moves only after this mode returns, so digest afresh.
                    outs.append(digest.fresh(t))
                else:
                    outs.append(digest(t))
        chunks: list[Any] = []
        if name in ORDER_SENSITIVE:
            import torch

            for t, fp in zip(results, outs, strict=True):
                sensitive = fp is not None and not t.dtype.is_floating_point and not t.dtype.is_complex \
                    and t.dtype != torch.bool
                chunks.append(digest.chunks(t, self.chunk_elements) if sensitive else None)
        self.events.append({
            "p": phase, "m": module, "o": op, "k": occ, "i": ins, "u": outs,
            "s": [list(t.shape) for t in results], "d": [str(t.dtype).removeprefix("torch.") for t in results],
            "n": [t.numel() for t in results], "c": chunks if any(c is not None for c in chunks) else None,
            "x": None if comm is None else {"collective": comm.collective, "group": list(comm.group),
                                            "seq": comm.seq, "peer": comm.peer, "reduce_op": comm.reduce_op},
            "a": arguments or None,
        })
        return out


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors an op writes through its arguments (``Tensor(a!)``), in schema order."""
    return [t for a, value in bound(func, args, kwargs) if a.alias_info is not None and a.alias_info.is_write
            for t in _leaves(value)]


def _arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[Any]]:
    """``[name, digest, text]`` of each non-tensor argument in schema order, a default standing for an omitted
    argument (so both calls match); ``text`` only for small values."""
    import torch

    out: list[list[Any]] = []
    for a, value in bound(func, args, kwargs):
        if getattr(a, "is_out", False):
            continue
        if value is UNSET:
            if not a.has_default_value():
                continue
            value = a.default_value
        if isinstance(value, torch.Tensor):
            continue
        parts: list[str] = []
        text = _text(value) if _encode(value, parts) else None  # small and plain: shown
        out.append([a.name[:MAX_ARGUMENT_NAME], xxhash.xxh3_128_hexdigest("\x1f".join(parts).encode()), text])
    return out


def _encode(value: Any, parts: list[str]) -> bool:
    """Append an exact, process-independent encoding of ``value`` to ``parts`` (tensors as placeholders, generators
    by state); returns whether it is small and plain enough to show as text."""
    import torch

    if value is None:
        parts.append("N")
    elif isinstance(value, bool):
        parts.append(f"b{int(value)}")
    elif isinstance(value, int):
        parts.append(f"i{value}")
    elif isinstance(value, float):
        parts.append(f"f{value.hex()}")  # every bit: 0.1 and its neighbour, 0.0 and -0.0 differ
    elif isinstance(value, complex):
        parts.append(f"c{value.real.hex()},{value.imag.hex()}")
    elif isinstance(value, str):
        parts.append(f"s{value}")
    elif isinstance(value, torch.dtype | torch.device | torch.layout | torch.memory_format):
        parts.append(f"d{value}")
    elif isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        parts.append(f"y{value}")
    elif isinstance(value, torch.Tensor):
        parts.append("T")
        return False
    elif isinstance(value, list | tuple):
        parts.append("[")
        small = len(value) <= 16
        for x in value:
            small = _encode(x, parts) and small
        parts.append("]")
        return small
    elif isinstance(value, torch.Generator):
        state = value.get_state()
        parts.append(f"g{value.device}:{xxhash.xxh3_128_hexdigest(state.numpy().tobytes())}")
        return False
    else:
        # Opaque objects by type only: a repr may hold an address.
        parts.append(f"o{type(value).__module__}.{type(value).__qualname__}")
        return False
    return True


def _text(value: Any) -> str | None:
    text = repr(value) if isinstance(value, float | int | bool | complex | str | list | tuple) or value is None \
        else str(value)
    return text if len(text) <= MAX_ARGUMENT_TEXT else None


@functools.cache
def _out_arguments(func: Any) -> frozenset[str]:
    """Names of the out= arguments of an op overload (write-only buffers)."""
    return frozenset(a.name for a in func._schema.arguments if getattr(a, "is_out", False))


def _comm_note(info: CommInfo, tensors: list[Any]) -> str:
    """A collective's site ``info``: what it was and the sizes it moved. The group sequence number is left out: it
    counts from recorder start, so a resumed run's differs."""
    return json.dumps({"collective": info.collective, "group": list(info.group), "peer": info.peer,
                       "reduce_op": info.reduce_op, "sizes": [int(t.numel()) for t in tensors]},
                      separators=(",", ":"))


def _capture(path: str | None, op: str, args: Any, kwargs: Any) -> None:
    """Save ``{"op", "args", "kwargs"}`` of one op, tensors detached, cloned and on the host, to ``path``."""
    import torch
    from torch.utils._pytree import tree_map

    if not path:
        return

    def host(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, torch.ScriptObject):
            return None  # a process group or a reduce op: not saved (a collective cannot be re-run alone)
        return x

    own_folder(os.path.dirname(os.path.abspath(path)))
    data = io.BytesIO()
    torch.save({"op": op, "args": tree_map(host, tuple(args)), "kwargs": tree_map(host, dict(kwargs))}, data)
    write_atomic(path, data.getvalue(), prefix=".ckptverify-capture-", durable=False)


#: The tracer the collectives' kernels hand calls to outside an op window; one recording loop per process.
_ACTIVE: StepTracer | None = None
_LIBRARY: Any = None
_USERS = 0

#: c10d ops have no autograd kernel: a Python one there sees every call (DDP's reducer included) and costs the
#: other ops nothing, unlike a dispatch mode.
_KERNEL_KEYS = ("AutogradCPU", "AutogradCUDA")


def _comm_kernels(use: bool) -> None:
    """Register (``use``) or release a Python kernel in front of every c10d and functional collective; it hands calls
    to :data:`_ACTIVE` below autograd, or runs the op unchanged."""
    global _LIBRARY, _USERS
    import torch

    if not use:
        _USERS = max(0, _USERS - 1)
        if _USERS == 0 and _LIBRARY is not None:
            for lib in _LIBRARY:
                lib._destroy()
            _LIBRARY = None
        return
    _USERS += 1
    if _LIBRARY is not None:
        return
    import torch.distributed  # registers the c10d ops

    libs = {ns: torch.library.Library(ns, "IMPL") for ns in COMM_NAMESPACES}
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, name = full.partition("::")
        if ns not in libs or "." in name:
            continue
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            func = getattr(packet, overload)
            qualified = name if overload == "default" else f"{name}.{overload}"
            if not (is_comm(func) or name == "wait_tensor"):
                continue
            for key in _KERNEL_KEYS:
                if torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{qualified}", key):
                    continue  # someone's kernel is there: leave it (the op is then seen at level op only)
                libs[ns].impl(qualified, _kernel(func), key)
    _LIBRARY = list(libs.values())


def _kernel(func: Any) -> Callable[..., Any]:
    import torch

    below = torch._C._AutoDispatchBelowAutograd

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with below():
            tracer = _ACTIVE
            return func(*args, **kwargs) if tracer is None else tracer.dispatch(func, args, kwargs)

    return kernel


@functools.cache
def _mode_class() -> Any:
    """The ``TorchDispatchMode`` subclass, made on first use (importing this module must not import torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class TraceMode(TorchDispatchMode):
        def __init__(self, tracer: StepTracer) -> None:
            super().__init__()
            self.tracer = tracer

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return self.tracer.dispatch(func, tuple(args), kwargs or {})

    return TraceMode


def write_op_log(store: str | os.PathLike[str], step: int, records: list[dict[str, Any]], dropped: int,
                 values: list[int], chunk_elements: int) -> None:
    """Write the op log of ``step``, resolving device handles from ``values`` (flattened lane pairs)."""
    digests = pair_digests(values)

    def resolve(v: Any) -> str | None:
        return None if v is None else f"{digests[v[1]] if isinstance(v, tuple) else v:032x}"

    events = [{**r, "i": [resolve(v) for v in r["i"]], "u": [resolve(v) for v in r["u"]],
               "c": None if r["c"] is None else [None if c is None else [resolve(x) for x in c] for c in r["c"]]}
              for r in records]
    path = op_log_path(store, step)
    own_folder(path.parent)
    write_atomic(path, json.dumps({"version": OP_LOG_VERSION, "step": int(step), "dropped": int(dropped),
                                   "chunk_elements": int(chunk_elements), "events": events}, separators=(",", ":")),
                 prefix=f".{path.name}.", durable=False)
