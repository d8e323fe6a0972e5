"""The op log: what levels ``comm`` and ``op`` record of one step on one rank, in that rank's execution order.

This module is the contract between the recorder (which writes op and collective records into the run's trace
store) and the analyses that read them (:mod:`ckptverify.resume.locate.ops`: origin, receivers, untraced; the kernel
re-run). Everything here is plain data; reading a store into it is :func:`read_ops`.

Identity, never arrival order: an op is keyed ``(step, phase, module, op, occurrence)`` where ``occurrence``
counts the earlier ops of the same ``(phase, module, op)`` within the step on that rank. Two runs are aligned
by key; "first" on a rank is that rank's execution order (``index``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["OP_LOG_VERSION", "PHASES", "CommInfo", "OpArgument", "OpEvent", "OpKey", "OpWindow", "make_event",
           "op_log_path", "op_steps", "ops_dropped", "read_ops", "window_from_dict"]

#: The op log file format this code writes (``"version"``; a file without it is version 1, which records no
#: ``"a"``). A file of a later version is refused rather than half read.
OP_LOG_VERSION = 2

#: The longest argument name and readable value an op log may hold (the writer keeps within these).
MAX_ARGUMENT_NAME = 64
MAX_ARGUMENT_TEXT = 80

#: Where in the step an op ran: ``forward``; ``backward`` (inside the autograd engine); ``recompute`` (a module's
#: forward run again during backward by activation checkpointing); ``optimizer`` (inside ``optimizer.step``);
#: ``other`` (anything else between the start of the step and its record: a loss scaler, a clip outside a hook).
PHASES = ("forward", "backward", "recompute", "optimizer", "other")

#: ``(step, phase, module, op, occurrence)``.
OpKey = tuple[int, str, str, str, int]


@dataclass(frozen=True, kw_only=True)
class CommInfo:
    """What a collective or point-to-point op was. ``collective``: the c10d name without namespace and overload
    (``allreduce_``, ``broadcast_``, ``allgather_``, ``reduce_scatter_``, ``send``, ``recv_``, or a functional
    collective's name); ``group``: the global ranks of its process group, in group-rank order; ``seq``: this
    rank's count of earlier collectives on that group since the recorder started (equal on every member for the
    same collective); ``peer``: the global rank of the other side of a send or receive (``None`` otherwise);
    ``reduce_op``: ``sum``, ``avg``, ``max``, ... or ``None``."""

    collective: str
    group: tuple[int, ...]
    seq: int
    peer: int | None = None
    reduce_op: str | None = None


@dataclass(frozen=True, slots=True)
class OpArgument:
    """One argument of an op that is not a plain tensor (a scalar, a dtype, a shape, a list, a generator, ``None``
    for an optional tensor): ``name`` as the op's schema spells it, ``digest`` a 128-bit fingerprint of its value
    (a tensor inside a list stands as a placeholder there: its value is among the op's ``inputs``; a generator by
    its state), ``text`` a short readable form of the value when it is small (``None`` otherwise)."""

    name: str
    digest: int
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class OpEvent:
    """One op as one rank ran it. ``inputs`` and ``outputs``: the 128-bit fingerprints of its tensor arguments
    (inputs taken before an in-place op wrote them) and of its tensor results, in argument order, ``None`` for
    one that is not compared (an ``empty*`` output, an async collective's buffer still in flight, the destination
    of a non-blocking copy: artifacts, not differences). ``shapes``, ``dtypes``, ``numels`` describe ``outputs``.
    ``chunks``: for an order-sensitive output (sort indices, top-k, routing maps), per output, the fingerprints of
    its consecutive chunks of ``chunk_elements`` elements (``None`` for outputs without); ``comm`` is set for a
    collective or point-to-point op. ``arguments``: the op's other arguments (:class:`OpArgument`, in schema
    order, defaults filled in): they decide its outputs as much as its tensors do."""

    step: int
    phase: str
    module: str
    op: str
    occurrence: int
    index: int
    inputs: tuple[int | None, ...] = ()
    outputs: tuple[int | None, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    numels: tuple[int, ...] = ()
    chunks: tuple[tuple[int, ...] | None, ...] = ()
    chunk_elements: int = 0
    comm: CommInfo | None = None
    arguments: tuple[OpArgument, ...] = ()

    @property
    def key(self) -> OpKey:
        return (self.step, self.phase, self.module, self.op, self.occurrence)


@dataclass(frozen=True, kw_only=True)
class OpWindow:
    """Where level ``op`` records (level ``comm`` records every step, collectives only). ``steps``, ``ranks``:
    the steps and global ranks recorded (``None``: all); ``modules``: module-path prefixes whose ops are recorded
    (``None``: all, including ops outside any module); ``max_ops``: at most this many ops per step and rank
    (the rest are counted, not recorded, and the trace says it was cut); ``capture``: the key of one op whose
    inputs are saved (``torch.save`` of ``{"op", "args", "kwargs"}``, tensors detached and on the host) to
    ``capture_path``, for re-running it alone."""

    steps: tuple[int, ...] | None = None
    ranks: tuple[int, ...] | None = None
    modules: tuple[str, ...] | None = None
    max_ops: int = 100_000
    capture: OpKey | None = None
    capture_path: str | None = None


def op_log_path(store: str | os.PathLike[str], step: int) -> Path:
    """Where the op log of ``step`` lives in a rank's store."""
    return Path(store) / "ops" / f"step{int(step)}.json"


def make_event(step: int, index: int, raw: dict[str, Any], chunk_elements: int) -> OpEvent:
    """An :class:`OpEvent` from one record of an op log file (already checked by the reader)."""
    def fp(v: Any) -> int | None:
        return None if v is None else int(v, 16)

    x = raw.get("x")
    comm = None if x is None else CommInfo(collective=x["collective"], group=tuple(x["group"]), seq=x["seq"],
                                           peer=x["peer"], reduce_op=x["reduce_op"])
    chunks = raw.get("c")
    return OpEvent(step=step, phase=raw["p"], module=raw["m"], op=raw["o"], occurrence=raw["k"], index=index,
                   inputs=tuple(fp(v) for v in raw["i"]), outputs=tuple(fp(v) for v in raw["u"]),
                   shapes=tuple(tuple(s) for s in raw["s"]), dtypes=tuple(raw["d"]), numels=tuple(raw["n"]),
                   chunks=() if chunks is None else tuple(None if c is None else tuple(fp(v) for v in c)
                                                          for c in chunks),
                   chunk_elements=chunk_elements if chunks is not None else 0, comm=comm,
                   arguments=tuple(OpArgument(n, int(d, 16), t) for n, d, t in raw.get("a") or ()))


#: The largest op log file read (one step of one rank).
MAX_OP_LOG_BYTES = 1 << 30


def _op_log(trace_dir_or_store: str | os.PathLike[str], rank: int, step: int) -> tuple[Any, Path]:
    """The parsed op log of ``step`` on ``rank`` (checked), and its path."""
    from ckptverify.errors import CkptVerifyError
    from ckptverify.safeparse import safejson
    from ckptverify.trace.store import rank_store_path

    base = Path(trace_dir_or_store)
    store = base if (base / "zarr.json").is_file() else rank_store_path(base, rank)
    path = op_log_path(store, step)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_OP_LOG_BYTES + 1)
    except FileNotFoundError:
        raise CkptVerifyError(f"no op log of step {step} in {store} (level op records only the steps and "
                                 "ranks of its window)") from None
    except OSError as exc:
        raise CkptVerifyError(f"{path}: cannot read the op log: {exc}") from None
    try:
        data = safejson.loads(raw, max_bytes=MAX_OP_LOG_BYTES)
        _check_log(data, step)
    except (safejson.JSONError, ValueError, TypeError, KeyError) as exc:
        raise CkptVerifyError(f"{path}: damaged op log: {exc}"[:400]) from None
    return data, path


def _check_log(data: Any, step: int) -> None:
    """Refuse an op log file whose structure is not what :func:`~ckptverify.trace.ops.write_op_log` writes."""
    if not isinstance(data, dict) or data.get("step") != step or not isinstance(data.get("events"), list):
        raise ValueError("not an op log of this step")
    version = data.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= OP_LOG_VERSION:
        raise ValueError(f"op log version {str(version)[:20]!r} is not one this ckptverify reads (1..{OP_LOG_VERSION})")
    for name in ("dropped", "chunk_elements"):
        if not isinstance(data.get(name), int) or isinstance(data.get(name), bool) or data[name] < 0:
            raise ValueError(f"{name} is not a count")

    def hexdigest(x: Any) -> bool:
        return isinstance(x, str) and len(x) == 32 and all(c in "0123456789abcdef" for c in x)

    def fps(v: Any) -> bool:
        return isinstance(v, list) and all(x is None or hexdigest(x) for x in v)

    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)

    def arguments(v: Any) -> bool:
        # [[name, digest, text or null], ...]; only version 2 writes them.
        return v is None or (version >= 2 and isinstance(v, list) and all(
            isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and 0 < len(x[0]) <= MAX_ARGUMENT_NAME
            and hexdigest(x[1]) and (x[2] is None or (isinstance(x[2], str) and len(x[2]) <= MAX_ARGUMENT_TEXT))
            for x in v))

    for e in data["events"]:
        if not isinstance(e, dict):
            raise ValueError("an event is not an object")
        ok = (e.get("p") in PHASES and isinstance(e.get("m"), str) and isinstance(e.get("o"), str)
              and isinstance(e.get("k"), int) and fps(e.get("i")) and fps(e.get("u"))
              and isinstance(e.get("s"), list) and all(ints(s) for s in e["s"])
              and isinstance(e.get("d"), list) and all(isinstance(d, str) for d in e["d"]) and ints(e.get("n"))
              and (e.get("c") is None or (isinstance(e["c"], list) and all(c is None or fps(c) for c in e["c"])))
              and arguments(e.get("a")))
        x = e.get("x")
        if ok and x is not None:
            ok = (isinstance(x, dict) and isinstance(x.get("collective"), str) and ints(x.get("group"))
                  and isinstance(x.get("seq"), int) and (x.get("peer") is None or isinstance(x["peer"], int))
                  and (x.get("reduce_op") is None or isinstance(x["reduce_op"], str)))
        if not ok:
            raise ValueError(f"event {str(e)[:120]} is not an op record")


def read_ops(trace_dir_or_store: str | os.PathLike[str], rank: int, step: int) -> list[OpEvent]:
    """The op log of ``step`` on ``rank``, in that rank's execution order (``index`` 0 first).

    ``trace_dir_or_store``: a run's trace directory (its store ``rank<rank>/`` is read) or one rank's store.
    :class:`~ckptverify.errors.CkptVerifyError` when that step was not recorded at level ``op`` on that rank
    (outside the window); :class:`~ckptverify.errors.CkptVerifyError` for a damaged file."""
    data, _ = _op_log(trace_dir_or_store, rank, step)
    return [make_event(step, i, e, data["chunk_elements"]) for i, e in enumerate(data["events"])]


def ops_dropped(trace_dir_or_store: str | os.PathLike[str], rank: int, step: int) -> int:
    """How many ops of ``step`` on ``rank`` the window's ``max_ops`` left out of the op log (0: it is whole)."""
    data, _ = _op_log(trace_dir_or_store, rank, step)
    return int(data["dropped"])


def op_steps(trace_dir_or_store: str | os.PathLike[str], rank: int) -> list[int]:
    """The steps of ``rank`` that have an op log, in order."""
    from ckptverify.trace.store import rank_store_path

    base = Path(trace_dir_or_store)
    store = base if (base / "zarr.json").is_file() else rank_store_path(base, rank)
    out = []
    try:
        names = os.listdir(store / "ops")
    except OSError:
        return []
    for name in names:
        digits = name.removeprefix("step").removesuffix(".json")
        if name.startswith("step") and name.endswith(".json") and digits.isascii() and digits.isdigit() \
                and len(digits) < 19:
            out.append(int(digits))
    return sorted(out)


def window_from_dict(data: Any) -> OpWindow:
    """An :class:`OpWindow` from its JSON form (``dataclasses.asdict``: lists for tuples);
    :class:`~ckptverify.errors.UsageError` for anything else."""
    from ckptverify.errors import UsageError

    if isinstance(data, OpWindow):
        return data
    if not isinstance(data, dict):
        raise UsageError(f"an op window is a JSON object, not {type(data).__name__}")
    known = {"steps", "ranks", "modules", "max_ops", "capture", "capture_path"}
    extra = set(data) - known
    if extra:
        raise UsageError(f"unknown op window field(s): {', '.join(sorted(extra))}")

    def ints(name: str) -> tuple[int, ...] | None:
        v = data.get(name)
        if v is None:
            return None
        if not isinstance(v, list | tuple) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise UsageError(f"op window {name}: a list of integers, got {v!r}")
        return tuple(v)

    mods = data.get("modules")
    if mods is not None and (not isinstance(mods, list | tuple) or not all(isinstance(m, str) for m in mods)):
        raise UsageError(f"op window modules: a list of module paths, got {mods!r}")
    max_ops = data.get("max_ops", 100_000)
    if not isinstance(max_ops, int) or isinstance(max_ops, bool) or max_ops < 0:
        raise UsageError(f"op window max_ops: a count, got {max_ops!r}")
    cap = data.get("capture")
    if cap is not None:
        ok = (isinstance(cap, list | tuple) and len(cap) == 5 and isinstance(cap[0], int) and cap[1] in PHASES
              and isinstance(cap[2], str) and isinstance(cap[3], str) and isinstance(cap[4], int))
        if not ok:
            raise UsageError(f"op window capture: a key [step, phase, module, op, occurrence], got {cap!r}")
        cap = tuple(cap)
        if not data.get("capture_path"):
            raise UsageError("op window capture needs capture_path")
    path = data.get("capture_path")
    if path is not None and not isinstance(path, str):
        raise UsageError("op window capture_path: a path")
    return OpWindow(steps=ints("steps"), ranks=ints("ranks"), modules=None if mods is None else tuple(mods),
                    max_ops=max_ops, capture=cap, capture_path=path)
