"""The op log: what levels ``comm`` and ``op`` record of one step on one rank, in its execution order.

The plain-data contract between the recorder and the analyses (:mod:`ckptverify.resume.locate.ops`, the kernel
re-run); :func:`read_ops` reads a store into it. Trap: ops are aligned by identity, never arrival order: the key is
``(step, phase, module, op, occurrence)``, ``occurrence`` counting earlier ops of that ``(phase, module, op)`` in the
step; "first" on a rank is its execution order (``index``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptverify.errors import CkptVerifyError, JSONError, UsageError
from ckptverify.safeparse import safejson

__all__ = ["OP_LOG_VERSION", "PHASES", "CommInfo", "OpArgument", "OpEvent", "OpKey", "OpWindow", "make_event",
           "op_log_path", "ops_dropped", "read_ops", "window_from_dict"]

#: Op log format version; a file of any other version is refused rather than half read.
OP_LOG_VERSION = 1

MAX_ARGUMENT_NAME = 64
MAX_ARGUMENT_TEXT = 80

#: Where in the step an op ran (``docs/trace.md``).
PHASES = ("forward", "backward", "recompute", "optimizer", "other")

#: ``(step, phase, module, op, occurrence)``.
OpKey = tuple[int, str, str, str, int]


@dataclass(frozen=True, kw_only=True)
class CommInfo:
    """What a collective or point-to-point op was: ``collective`` its c10d name; ``group`` the global ranks in group
    order; ``seq`` this rank's count of earlier collectives on the group (equal on every member); ``peer`` the other
    side of a send/receive; ``reduce_op`` or ``None``."""

    collective: str
    group: tuple[int, ...]
    seq: int
    peer: int | None = None
    reduce_op: str | None = None


@dataclass(frozen=True, slots=True)
class OpArgument:
    """A non-tensor argument of an op: schema ``name``, 128-bit ``digest`` of its value (tensors in a list as
    placeholders, generators by state), and ``text`` when small."""

    name: str
    digest: int
    text: str | None = None


@dataclass(frozen=True, kw_only=True)
class OpEvent:
    """One op as one rank ran it. ``inputs``/``outputs``: fingerprints of its tensor arguments (before an in-place
    write) and results, ``None`` where not compared (``empty*`` outputs, buffers in flight, non-blocking copy
    targets: artifacts, not differences). ``chunks``: per order-sensitive output, fingerprints of its chunks.
    ``arguments`` decide the outputs as much as the tensors do."""

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
    """Where level ``op`` records: ``steps``, ``ranks``, ``modules`` (path prefixes; ``None``: all, ops outside
    modules included); ``max_ops`` per step and rank (the rest counted, the trace marked cut); ``capture``: key of
    one op whose inputs are saved to ``capture_path`` for re-running it alone."""

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


MAX_OP_LOG_BYTES = 1 << 30


def _op_log(trace_dir_or_store: str | os.PathLike[str], rank: int, step: int) -> Any:
    """The parsed op log of ``step`` on ``rank``, checked; ``trace_dir_or_store`` is rank ``rank``'s store itself, or
    the run's trace directory holding it as ``rank<r>``."""
    from ckptverify.trace.store import _read_file, is_store, rank_store_path

    store = Path(trace_dir_or_store) if is_store(trace_dir_or_store) else rank_store_path(trace_dir_or_store, rank)
    path = op_log_path(store, step)
    raw = _read_file(path, MAX_OP_LOG_BYTES)  # as the store's own files: a regular file, size capped
    if raw is None:
        raise CkptVerifyError(f"no op log of step {step} in {store} (level op records only the steps and "
                              "ranks of its window)")
    try:
        data = safejson.loads(raw, max_bytes=MAX_OP_LOG_BYTES)
        _check_log(data, step)
    except (JSONError, ValueError, TypeError, KeyError) as exc:
        raise CkptVerifyError(f"{path}: damaged op log: {exc}"[:400]) from None
    return data


def _check_log(data: Any, step: int) -> None:
    """Refuse an op log file whose structure is not what :func:`~ckptverify.trace.ops.write_op_log` writes."""
    if not isinstance(data, dict) or data.get("step") != step or not isinstance(data.get("events"), list):
        raise ValueError("not an op log of this step")
    version = data.get("version")
    if type(version) is not int or version != OP_LOG_VERSION:
        raise ValueError(f"op log version {str(version)[:20]!r} is not one this ckptverify reads ({OP_LOG_VERSION})")
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
        return v is None or (isinstance(v, list) and all(
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
    """The op log of ``step`` on ``rank`` in execution order, from a run's trace directory or one rank's store.
    :class:`~ckptverify.errors.CkptVerifyError` when the step was not recorded (outside the window) or is damaged."""
    data = _op_log(trace_dir_or_store, rank, step)
    return [make_event(step, i, e, data["chunk_elements"]) for i, e in enumerate(data["events"])]


def ops_dropped(trace_dir_or_store: str | os.PathLike[str], rank: int, step: int) -> int:
    """How many ops of ``step`` on ``rank`` the window's ``max_ops`` left out of the op log (0: it is whole)."""
    return int(_op_log(trace_dir_or_store, rank, step)["dropped"])


def window_from_dict(data: Any) -> OpWindow:
    """An :class:`OpWindow` from its JSON form; :class:`~ckptverify.errors.UsageError` otherwise."""
    if not isinstance(data, dict):
        raise UsageError(f"an op window is a JSON object, not {type(data).__name__}")
    extra = set(data) - {"steps", "ranks", "modules", "max_ops", "capture", "capture_path"}
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
