"""Cross-replica consistency: ranks that must hold identical values prove it every traced step.

Data-parallel replicas (DDP; the replicate dimension of HSDP; parameters replicated under tensor parallelism)
hold bitwise-identical parameters after every optimizer step, and identical gradients after the all-reduce.
A device that silently flips a bit breaks that, and nothing in training notices: the replicas simply drift.

Each rank digests its copy of every parameter it shares with others (xxh3-128 of the bytes for host tensors,
the 128-bit logical fingerprint computed on the device otherwise: no copy to the host), folds them into one
128-bit value per replica group, and the group compares those with one small ``all_gather`` (16 bytes a rank).
Only when they differ does a second collective exchange the per-tensor digests, to name the tensors and the
ranks on each side. Which ranks replicate a parameter:

- a DTensor: the ranks along each mesh dimension on which its placement is ``Replicate()``;
- a plain tensor: every rank of ``group`` (default: the whole world, as under DDP). A model whose plain
  parameters differ by design across ranks (manual model parallelism) must pass the right ``group``, or
  ``exclude`` them.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import CkptVerifyError

__all__ = ["ReplicaCheck", "ReplicaMismatch", "ReplicaMismatchError", "ReplicaMismatchWarning"]

ON_MISMATCH = ("warn", "raise")


class ReplicaMismatchError(CkptVerifyError):
    """Replicas that must be identical differ (``on_mismatch="raise"``): a hardware fault is likely."""

    exit_code = 1

    def __init__(self, message: str, mismatch: ReplicaMismatch) -> None:
        super().__init__(message)
        self.mismatch = mismatch


class ReplicaMismatchWarning(UserWarning):
    """Replicas that must be identical differ (``on_mismatch="warn"``)."""


@dataclass(frozen=True)
class ReplicaMismatch:
    """One replica group whose members disagree at one step.

    ``sides`` lists each distinct copy: the global ranks holding it and their hosts. ``suspects`` are the ranks
    of a strict minority copy when one copy has a strict majority (with two replicas no side can be blamed).
    """

    step: int
    kind: str
    group: tuple[int, ...]
    sides: tuple[dict[str, Any], ...]
    tensors: tuple[str, ...]
    suspects: tuple[int, ...] = ()

    def describe(self) -> str:
        sides = "; ".join(f"ranks {s['ranks']} on {', '.join(sorted(set(s['hosts'])))}" for s in self.sides)
        names = ", ".join(self.tensors[:5]) + (f" and {len(self.tensors) - 5} more" if len(self.tensors) > 5 else "")
        blame = f"; the odd one out: rank(s) {list(self.suspects)}" if self.suspects else ""
        return (f"step {self.step}: replicas of the {self.kind} differ across ranks {list(self.group)} "
                f"({len(self.sides)} distinct copies: {sides}) in {names}{blame}")

    def to_event(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "group": list(self.group), "sides": list(self.sides),
                "tensors": list(self.tensors), "suspects": list(self.suspects)}


@dataclass
class _Bucket:
    """Parameters replicated over one process group, in the same order on every member."""

    key: tuple[Any, ...]
    group: Any
    ranks: tuple[int, ...]
    params: list[tuple[str, Any]] = field(default_factory=list)


class ReplicaCheck:
    """Compare parameters and optimizer state (or gradients) across replicas; see the module docstring.

    Every rank of the process group constructs it with the same model (and optimizer, whose per-parameter
    state is compared with the parameters: a flipped moment shows at once, not one update later) and calls
    :meth:`check` at the same points (it issues collectives). ``events`` (an
    :class:`~ckptverify.events.EventLog`) receives a ``replica-mismatch`` event, written by the lowest rank of
    the group; ``on_mismatch="raise"`` then raises :class:`ReplicaMismatchError` on every member, ``"warn"``
    warns on stderr and training goes on.
    """

    def __init__(self, model: Any, *, optimizer: Any = None, group: Any = None, on_mismatch: str = "warn",
                 events: Any = None, exclude: Iterable[str] = ()) -> None:
        import torch.distributed as dist

        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
        self.on_mismatch = on_mismatch
        self.events = events
        self.optimizer = optimizer
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.compared = 0  # tensors compared by the last check (this rank)
        self.mismatches: list[ReplicaMismatch] = []
        self._buckets: dict[tuple[Any, ...], _Bucket] = {}
        self._hosts: list[str] = []
        if not self.enabled:
            return
        import socket

        hosts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        self._hosts = [str(h) for h in hosts]
        module = getattr(model, "module", model)  # DDP
        skip = set(exclude)
        for name, p in module.named_parameters():
            if name in skip:
                continue
            for key, pg in _replica_groups(p, group):
                ranks = tuple(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
                if len(ranks) < 2:
                    continue
                self._buckets.setdefault(key, _Bucket(key, pg, ranks)).params.append((name, p))

    @property
    def tensors(self) -> int:
        """Parameters this rank shares with at least one replica (counted once per replica dimension)."""
        return sum(len(b.params) for b in self._buckets.values())

    def check(self, step: int, *, grads: bool = False) -> list[ReplicaMismatch]:
        """Compare the replicas' parameters and optimizer state (``grads=True``: their gradients) now; return
        the mismatches. ``compared`` then holds the number of tensors this rank compared."""
        if not self.enabled:
            return []
        kind = "gradients" if grads else "parameters"
        found: list[ReplicaMismatch] = []
        self.compared = 0
        for bucket in self._buckets.values():
            names, tensors = self._tensors(bucket, grads)
            mismatch = self._check_bucket(bucket, names, tensors, step, kind)
            if mismatch is not None:
                found.append(mismatch)
        for mismatch in found:
            self._report(mismatch)
        return found

    def _tensors(self, bucket: _Bucket, grads: bool) -> tuple[list[str], list[Any]]:
        names: list[str] = []
        tensors: list[Any] = []
        for name, p in bucket.params:
            if grads:
                names.append(name)
                tensors.append(None if p.grad is None else _local(p.grad))
                continue
            names.append(name)
            tensors.append(_local(p))
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for key in sorted(state, key=str):
                value = state[key]
                if hasattr(value, "dtype") and hasattr(value, "device"):
                    names.append(f"optim:{name}.{key}")
                    tensors.append(_local(value))
        return names, tensors

    def _check_bucket(self, bucket: _Bucket, names: list[str], tensors: list[Any], step: int,
                      kind: str) -> ReplicaMismatch | None:
        present = [n for n, t in enumerate(tensors) if t is not None]
        self.compared += len(present)
        device = _collective_device(bucket.group)
        gathered = _all_gather(torch_tensor([_stream_digest(tensors)], device), bucket.group, len(bucket.ranks))
        if all(g == gathered[0] for g in gathered):
            return None
        # They differ: now (only now) a digest per tensor, padded to a common length (a member may hold
        # optimizer state the others lack): missing tensors count as all-zero digests.
        lanes = [_lanes(d) for d in _digests([tensors[n] for n in present])]
        width = _all_gather(torch_tensor([(len(tensors), 0)], device), bucket.group, len(bucket.ranks))
        longest = max(w[0][0] for w in width)
        rows = [(0, 0)] * longest
        for n, value in zip(present, lanes, strict=True):
            rows[n] = value
        table = _all_gather(torch_tensor(rows, device), bucket.group, len(bucket.ranks))
        differing = [names[n] if n < len(names) else f"<tensor {n}>" for n in range(longest)
                     if len({t[n] for t in table}) > 1]
        copies: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for member, row in zip(bucket.ranks, table, strict=True):
            copies.setdefault(tuple(row), []).append(member)
        sides = tuple({"ranks": members, "hosts": [self._hosts[r] for r in members]}
                      for members in sorted(copies.values(), key=lambda m: (-len(m), m)))
        suspects: tuple[int, ...] = ()
        if len(sides) > 1 and len(sides[0]["ranks"]) > len(sides[1]["ranks"]):
            suspects = tuple(r for s in sides[1:] for r in s["ranks"])
        return ReplicaMismatch(step=step, kind=kind, group=bucket.ranks, sides=sides, tensors=tuple(differing),
                               suspects=suspects)

    def _report(self, mismatch: ReplicaMismatch) -> None:
        import torch.distributed as dist

        self.mismatches.append(mismatch)
        if self.events is not None and dist.get_rank() == min(mismatch.group):
            self.events.emit("replica-mismatch", **mismatch.to_event())
        message = f"ckptverify: replica mismatch at {mismatch.describe()}"
        if self.on_mismatch == "raise":
            raise ReplicaMismatchError(message, mismatch)
        if dist.get_rank() == min(mismatch.group):
            warnings.warn(message, ReplicaMismatchWarning, stacklevel=3)
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------- helpers


def _replica_groups(p: Any, group: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key, process group)`` for each set of ranks that replicate ``p``; keys agree across ranks."""
    from ckptverify.trace.recorder import _is_dtensor

    if _is_dtensor(p):
        mesh = p.device_mesh
        out = []
        for dim, placement in enumerate(p.placements):
            if placement.is_replicate() and mesh.size(dim) > 1:
                out.append((("mesh", tuple(mesh.mesh.shape), mesh.mesh_dim_names, dim), mesh.get_group(dim)))
        return out
    return [(("plain",), group)]


def _local(t: Any) -> Any:
    from ckptverify.trace.recorder import _is_dtensor

    return t.to_local() if _is_dtensor(t) else t


def _digests(tensors: list[Any]) -> list[str]:
    """128-bit hex digest of each tensor's bits: bytes on the host, the logical fingerprint on a device."""
    from ckptverify.trace.recorder import fingerprint_many, host_digest

    out: list[str | None] = [None] * len(tensors)
    device_side = []
    for n, t in enumerate(tensors):
        if t.device.type == "cpu":
            out[n] = host_digest(t)
        else:
            device_side.append(n)
    if device_side:
        for n, value in zip(device_side, fingerprint_many([tensors[n].detach() for n in device_side]), strict=True):
            out[n] = value
    return [v for v in out if v is not None]


def _lanes(hex128: str) -> tuple[int, int]:
    value = int(hex128, 16)
    return _signed(value >> 64), _signed(value & ((1 << 64) - 1))


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _stream_digest(tensors: list[Any]) -> tuple[int, int]:
    """One 128-bit value for a bucket, in one pass: xxh3-128 over every host tensor's dtype, shape and bytes
    in order (one hash stream, no per-tensor digest: ~4x cheaper than digesting each), with the device-side
    fingerprints of accelerator tensors folded in."""
    import struct

    import torch
    import xxhash

    from ckptverify.trace.recorder import fingerprint_many

    h = xxhash.xxh3_128(struct.pack("<q", len(tensors)))
    device_side = [t.detach() for t in tensors if t is not None and t.device.type != "cpu"]
    device_values = iter(fingerprint_many(device_side)) if device_side else iter(())
    for n, t in enumerate(tensors):
        if t is None:
            h.update(struct.pack("<qq", n, -1))
            continue
        h.update(struct.pack(f"<qq{t.dim()}q", n, t.dim(), *t.shape) + str(t.dtype).encode())
        if t.device.type != "cpu":
            h.update(next(device_values).encode())
        elif t.numel():
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return _lanes(h.hexdigest())


def _collective_device(group: Any) -> Any:
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def torch_tensor(rows: list[tuple[int, int]], device: Any) -> Any:
    import torch

    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


def _all_gather(t: Any, group: Any, n: int) -> list[tuple[tuple[int, int], ...]]:
    import torch
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return [tuple(tuple(int(x) for x in row) for row in o.cpu().tolist()) for o in out]
