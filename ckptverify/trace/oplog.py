"""The op log: what levels ``comm`` and ``op`` record of one step on one rank, in that rank's execution order.

This module is the contract between the recorder (which writes op and collective records into the run's trace
store) and the analyses that read them (:mod:`ckptverify.trace.locate`: origin, receivers, untraced; the kernel
re-run). Everything here is plain data; reading a store into it is :func:`read_ops`.

Identity, never arrival order: an op is keyed ``(step, phase, module, op, occurrence)`` where ``occurrence``
counts the earlier ops of the same ``(phase, module, op)`` within the step on that rank. Two runs are aligned
by key; "first" on a rank is that rank's execution order (``index``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PHASES", "CommInfo", "OpEvent", "OpKey", "OpWindow"]

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


@dataclass(frozen=True, kw_only=True)
class OpEvent:
    """One op as one rank ran it. ``inputs`` and ``outputs``: the 128-bit fingerprints of its tensor arguments
    (inputs taken before an in-place op wrote them) and of its tensor results, in argument order, ``None`` for
    one that is not compared (an ``empty*`` output, an async collective's buffer still in flight, the destination
    of a non-blocking copy: artifacts, not differences). ``shapes``, ``dtypes``, ``numels`` describe ``outputs``.
    ``chunks``: for an order-sensitive output (sort indices, top-k, routing maps), per output, the fingerprints of
    its consecutive chunks of ``chunk_elements`` elements (``None`` for outputs without); ``comm`` is set for a
    collective or point-to-point op."""

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
