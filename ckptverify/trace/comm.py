"""Collectives and point-to-point ops as the dispatcher sees them (:class:`~ckptverify.trace.oplog.CommInfo`), and
the names of the sites holding their input and output fingerprints. c10d ops carry group and reduce op as TorchScript
objects; functional collectives name their group. Nothing here syncs with a device or another rank."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import xxhash

from ckptverify.trace.oplog import CommInfo

__all__ = ["COMM_NAMESPACES", "RECV", "UNSET", "argument", "bound", "comm_info", "comm_site", "group_label", "is_comm"]

#: Dispatcher namespaces of collective and point-to-point ops.
COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional"})

#: Point-to-point receives (c10d names); the one send is ``send``.
RECV = frozenset({"recv_", "recv_any_source_"})

#: ReduceOp enum values (``torch.distributed.ReduceOp.RedOpType``) by their integer.
_REDUCE_NAMES = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max", 5: "band", 6: "bor", 7: "bxor",
                 8: "premul_sum"}


def is_comm(func: Any) -> bool:
    """Whether the op overload ``func`` is a collective or point-to-point op (not ``wait_tensor``: waiting on a
    functional collective is where its output becomes valid)."""
    if func.namespace not in COMM_NAMESPACES:
        return False
    name = _name(func)
    return name != "wait_tensor" and not name.startswith(("barrier", "monitored_barrier", "_wrap_tensor"))


def _name(func: Any) -> str:
    """``allreduce_`` for ``c10d.allreduce_.default``."""
    return func._schema.name.split("::", 1)[-1]


#: What :func:`bound` gives for an argument not passed.
UNSET = object()


def bound(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """Each schema argument of an op call with the value passed for it, by position or name (:data:`UNSET` if
    none)."""
    for i, a in enumerate(func._schema.arguments):
        yield a, (args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name, UNSET))


def argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The value of argument ``name`` of an op call; ``None`` if not passed."""
    return next((v for a, v in bound(func, args, kwargs) if a.name == name and v is not UNSET), None)


def _group_of(obj: Any) -> tuple[int, ...] | None:
    """The global ranks of a process-group argument (a ProcessGroup script object or a functional group name);
    ``None`` if unreadable."""
    import torch
    import torch.distributed as dist

    if isinstance(obj, torch.ScriptObject):
        try:
            group = torch._C._distributed_c10d.ProcessGroup.unbox(obj)
        except (RuntimeError, TypeError, AttributeError):
            return None
    elif isinstance(obj, str):
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(obj)
        except (RuntimeError, ValueError, KeyError, ImportError):
            return None
    else:
        return None
    try:
        return tuple(int(r) for r in dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return None


def _reduce_op(obj: Any) -> str | None:
    import torch

    if isinstance(obj, str):  # functional collectives: "sum", "avg", ...
        return obj.lower()
    if isinstance(obj, torch.ScriptObject):
        try:
            value = obj.op()
        except (RuntimeError, AttributeError):
            return None
        value = int(getattr(value, "value", value))
        return _REDUCE_NAMES.get(value, str(value))
    return None


def _peer(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], group: tuple[int, ...]) -> int | None:
    """The global rank on the other side of a send or receive (its ``dstRank``/``srcRank`` is a group rank)."""
    if name != "send" and name not in RECV:
        return None
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            return group[value] if 0 <= value < len(group) else None
    return None


def comm_info(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], counter: Counter[tuple[int, ...]]
              ) -> CommInfo | None:
    """What collective ``func`` is; ``None`` when its process group cannot be read (it is then traced as an ordinary
    op). ``counter`` counts each group's collectives since the recorder started: the sequence numbers, equal on every
    member, as members issue a group's collectives in one order."""
    import torch

    name = _name(func)
    group = reduce_op = None
    for value in (*args, *kwargs.values()):
        if group is None:
            group = _group_of(value)
        if reduce_op is None and isinstance(value, torch.ScriptObject) and "ReduceOp" in str(value._type()):
            reduce_op = _reduce_op(value)
    if func.namespace == "_c10d_functional" and reduce_op is None:
        reduce_op = _reduce_op(argument(func, args, kwargs, "reduce_op"))
    if group is None:
        return None
    counter[group] += 1
    return CommInfo(collective=name, group=group, seq=counter[group] - 1, peer=_peer(name, args, kwargs, group),
                    reduce_op=reduce_op)


def group_label(group: tuple[int, ...]) -> str:
    """A short name of a group for site names: ``g0-7`` for consecutive ranks, ``g<hash>`` otherwise."""
    if group and list(group) == list(range(group[0], group[0] + len(group))):
        return f"g{group[0]}-{group[-1]}"
    return "g" + xxhash.xxh3_64_hexdigest(",".join(map(str, group)).encode())[:12]


def comm_site(info: CommInfo, occurrence: int, direction: str, part: int | None = None) -> str:
    """Site name of a collective's input (``in``, at issue) or output (``out``, at completion):
    ``comm.<group>.<collective>#<k>.<direction>[.<part>]``, ``k`` counting the step's earlier such collectives."""
    base = f"comm.{group_label(info.group)}.{info.collective}#{occurrence}.{direction}"
    return base if part is None else f"{base}.{part}"
