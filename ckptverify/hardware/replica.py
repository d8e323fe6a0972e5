"""Cross-replica consistency: ranks that must hold identical values prove it every traced step.

Replicas (DDP, HSDP's replicate dimension, replicated TP parameters) hold bitwise-identical parameters after each
step; a silently flipped bit makes them drift unnoticed. Each rank folds its member digests (reused from the trace's
row when available) into one 128-bit value per replica group, compared with one 16-byte ``all_gather``; only on
mismatch does a second collective name the tensors and ranks. Traps: :meth:`ReplicaCheck.check_late` compares one
traced step late so device digests never force a wait (:meth:`~ReplicaCheck.flush_late` before a save and at the
end); NCCL exchanges run on a side stream that waits for queued collectives, not computation. Plain tensors replicate
over ``group`` (default: world): manual model parallelism must pass ``group`` or ``exclude``."""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ckptverify.errors import CkptVerifyWarning, ReplicaMismatchError
from ckptverify.fingerprint.logical import collective_device
from ckptverify.fingerprint.spec import signed
from ckptverify.options import failure_policy
from ckptverify.state.distributed import torch_group
from ckptverify.trace.category import HostViews, tensor_digests
from ckptverify.trace.sites import is_dtensor, local_view

__all__ = ["ReplicaCheck", "ReplicaMismatch"]

@dataclass(frozen=True)
class ReplicaMismatch:
    """One replica group whose members disagree at one step: ``sides`` lists each distinct copy's ranks and hosts;
    ``suspects`` are a strict minority's ranks when one copy has a strict majority."""

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


@dataclass
class _Bucket:
    """Parameters replicated over one process group, in the same order on every member."""

    key: tuple[Any, ...]
    group: Any
    ranks: tuple[int, ...]
    params: list[tuple[str, Any]] = field(default_factory=list)


class ReplicaCheck:
    """Compare parameters and optimizer state (or gradients) across replicas.

    Every rank constructs it with the same model (and optimizer: a flipped moment shows at once) and calls the checks
    at the same points (they issue collectives). ``on_replica_mismatch``: ``raise`` on every member, or ``warn``.
    Mismatches group into episodes (until all agree again): the group's lowest rank warns once at the start and
    reports the count at the end; ``events`` gets ``replica-mismatch`` and ``replica-mismatch-end``. :meth:`suspect`
    says what a checkpoint saved now must record."""

    def __init__(self, model: Any, *, optimizer: Any = None, group: Any = None,
                 on_replica_mismatch: str = "warn", events: Any = None, exclude: Iterable[str] = ()) -> None:
        self.on_replica_mismatch = failure_policy("on_replica_mismatch", on_replica_mismatch)
        self.events = events
        self.optimizer = optimizer
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.compared = 0  # tensors compared by the last check (this rank)
        self.reused = 0  # of which the trace had digested already
        #: A recorder whose ``step_digests(step, tensors)`` gives the row's digests.
        self.digest_source: Any = None
        self._views: dict[tuple[Any, ...], Any] = {}
        self.episodes: list[_Episode] = []
        self._episode: _Episode | None = None
        self._buckets: dict[tuple[Any, ...], _Bucket] = {}
        self._hosts: list[str] = []
        self._late: int | None = None
        self._rank = dist.get_rank() if self.enabled else 0
        if not self.enabled:
            return
        self._hosts = [str(h) for h in torch_group().gathered(socket.gethostname())]
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
        """Compare the replicas' parameters and optimizer state (``grads``: gradients) now; returns the mismatches."""
        if not self.enabled:
            return []
        kind = "gradients" if grads else "parameters"
        found: list[ReplicaMismatch] = []
        self.compared = self.reused = 0
        for bucket in self._buckets.values():
            names, tensors = self._tensors(bucket, grads)
            digests = self._digests_of(bucket, tensors, step, reuse=not grads)
            mismatch = self._check_bucket(bucket, names, digests, step, kind)
            if mismatch is not None:
                found.append(mismatch)
        for mismatch in found:
            self._report(mismatch)
        if not found and not grads and self._episode is not None:
            self._close_episode(agreed_at=step)  # every replica group agreed: the open episode ends here
        return found

    def check_late(self, step: int) -> list[ReplicaMismatch]:
        """At the end of traced step ``step``: compare the previous call's step (its trace digests are on the host by
        now) and remember ``step``. Untraced tensors (optimizer state) are read as they are now; without a
        state-recording ``digest_source``, compares ``step`` now."""
        if not getattr(self.digest_source, "records_state", False):
            return self.check(step)
        previous, self._late = self._late, step
        return [] if previous is None else self.check(previous)

    def flush_late(self) -> list[ReplicaMismatch]:
        """Compare the step :meth:`check_late` still holds, now. Every member calls it at the same points
        (collectives)."""
        step, self._late = self._late, None
        return [] if step is None else self.check(step)

    def _tensors(self, bucket: _Bucket, grads: bool) -> tuple[list[str], list[Any]]:
        names: list[str] = []
        tensors: list[Any] = []
        for name, p in bucket.params:
            names.append(name)
            if grads:
                tensors.append(None if p.grad is None else local_view(p.grad))
                continue
            tensors.append(local_view(p))
            state = self.optimizer.state.get(p, {}) if self.optimizer is not None else {}
            for key in sorted(state, key=str):
                value = state[key]
                if hasattr(value, "dtype") and hasattr(value, "device"):
                    names.append(f"optim:{name}.{key}")
                    tensors.append(local_view(value))
        return names, tensors

    def _digests_of(self, bucket: _Bucket, tensors: list[Any], step: int, *, reuse: bool) -> list[int | None]:
        """Each tensor's member digest (``None`` if absent): from the trace's row of ``step`` when it has them, else
        computed (host tensors through views kept across checks)."""
        present = [n for n, t in enumerate(tensors) if t is not None]
        self.compared += len(present)
        out: list[int | None] = [None] * len(tensors)
        todo = present
        if reuse and self.digest_source is not None:
            known = self.digest_source.step_digests(step, [tensors[n] for n in present])
            for n, d in zip(present, known, strict=True):
                out[n] = d
            todo = [n for n in present if out[n] is None]
            self.reused += len(present) - len(todo)
        host = [n for n in todo if tensors[n].device.type == "cpu"]
        if reuse and host:
            key = (bucket.key, tuple(id(tensors[n]) for n in host))
            views = self._views.get(key)
            digests = views.digests() if views is not None else None
            if digests is None:
                views = self._views[key] = HostViews([tensors[n] for n in host])
                digests = views.digests()
            assert digests is not None
            for n, d in zip(host, digests, strict=True):
                out[n] = d
            todo = [n for n in todo if tensors[n].device.type != "cpu"]
        for n, d in zip(todo, tensor_digests([tensors[n] for n in todo]), strict=True):
            out[n] = d
        return out

    def _check_bucket(self, bucket: _Bucket, names: list[str], digests: list[int | None], step: int,
                      kind: str) -> ReplicaMismatch | None:
        device = collective_device(bucket.group, torch.device("cpu"))  # host rows: over gloo where served
        gathered = _all_gather([_bucket_digest(digests)], device, bucket.group, len(bucket.ranks))
        if all(g == gathered[0] for g in gathered):
            return None
        # Only now per-tensor digests, padded: a member may hold optimizer state the others lack.
        width = _all_gather([(len(digests), 0)], device, bucket.group, len(bucket.ranks))
        longest = max(w[0][0] for w in width)
        rows = [(0, 0)] * longest
        for n, d in enumerate(digests):
            if d is not None:
                rows[n] = _lanes(f"{d:032x}")
        table = _all_gather(rows, device, bucket.group, len(bucket.ranks))
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
        message = f"ckptverify: replica mismatch at {mismatch.describe()}"
        first = self._episode is None
        if first:
            self._episode = _Episode(first=mismatch, number=len(self.episodes) + 1)
            self.episodes.append(self._episode)
        episode = self._episode
        assert episode is not None
        episode.add(mismatch)
        reporter = self._rank == min(episode.first.group)
        if self.events is not None and reporter and first:
            # One event per episode start: a bit that stays flipped would otherwise log every step.
            self.events.emit("replica-mismatch", **asdict(mismatch), episode=episode.number)
        if self.on_replica_mismatch == "raise":
            raise ReplicaMismatchError(message, mismatch)
        if reporter and first:
            warnings.warn(f"{message}; further mismatched steps of this episode are counted, not repeated",
                          CkptVerifyWarning, stacklevel=3)
            sys.stderr.flush()

    def _close_episode(self, *, agreed_at: int | None) -> None:
        episode = self._episode
        assert episode is not None
        self._episode = None
        episode.agreed_at = agreed_at
        if self._rank == min(episode.first.group):  # the group may be gone already (the end of the job)
            print(f"ckptverify: {episode.describe()}", file=sys.stderr, flush=True)
            if self.events is not None:
                self.events.emit("replica-mismatch-end", **episode.to_event())

    def finish(self) -> None:
        """At the end of the job: close an open episode and report its count; no collective."""
        if self._episode is not None:
            self._close_episode(agreed_at=None)

    def suspect(self) -> dict[str, Any] | None:
        """The replica-mismatch record a checkpoint saved now must carry; ``None`` if replicas always agreed."""
        if not self.episodes:
            return None
        first, last = self.episodes[0], self.episodes[-1]
        return {"reason": "replica-mismatch", "first_step": first.first.step, "last_step": last.last_step,
                "mismatched_steps": sum(e.count for e in self.episodes), "episodes": len(self.episodes),
                "ongoing": self._episode is not None, "group": list(first.first.group),
                "sides": list(first.first.sides), "tensors": sorted({t for e in self.episodes for t in e.tensors})}


@dataclass
class _Episode:
    """Consecutive checked steps at which some replicas disagreed, from the first until they agree again."""

    first: ReplicaMismatch
    number: int
    count: int = 0
    last_step: int = 0
    tensors: set[str] = field(default_factory=set)
    agreed_at: int | None = None
    _steps: set[int] = field(default_factory=set)

    def add(self, mismatch: ReplicaMismatch) -> None:
        if mismatch.step not in self._steps:  # several groups may disagree at one step: one step counted once
            self._steps.add(mismatch.step)
            self.count += 1
        self.last_step = max(self.last_step, mismatch.step)
        self.tensors.update(mismatch.tensors)

    def describe(self) -> str:
        span = f"steps {self.first.step}-{self.last_step}" if self.last_step != self.first.step else \
            f"step {self.first.step}"
        end = (f"replicas agree again at step {self.agreed_at}" if self.agreed_at is not None
               else "replicas still differ at the end of the job")
        return (f"replica mismatch episode {self.number}: {self.count} checked step(s) mismatched ({span}); "
                f"{end}")

    def to_event(self) -> dict[str, Any]:
        return {"episode": self.number, "first_step": self.first.step, "last_step": self.last_step,
                "mismatched_steps": self.count, "agreed_at": self.agreed_at, "group": list(self.first.group),
                "tensors": sorted(self.tensors)}


def _replica_groups(p: Any, group: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(key, process group)`` for each set of ranks that replicate ``p``; keys agree across ranks."""
    if is_dtensor(p):
        mesh = p.device_mesh
        out = []
        for dim, placement in enumerate(p.placements):
            if placement.is_replicate() and mesh.size(dim) > 1:
                out.append((("mesh", tuple(mesh.mesh.shape), mesh.mesh_dim_names, dim), mesh.get_group(dim)))
        return out
    return [(("plain",), group)]


def _lanes(hex128: str) -> tuple[int, int]:
    value = int(hex128, 16)
    return signed(value >> 64), signed(value)


def _bucket_digest(digests: list[int | None]) -> tuple[int, int]:
    """xxh3-128 over a bucket's tensor digests in order (an absent tensor as position and marker)."""
    h = xxhash.xxh3_128(struct.pack("<q", len(digests)))
    for n, d in enumerate(digests):
        h.update(struct.pack("<qq", n, -1) if d is None else d.to_bytes(16, "little"))
    return _lanes(h.hexdigest())


#: One side stream per CUDA device (creating one costs a driver call).
_SIDE_STREAMS: dict[Any, Any] = {}


def _all_gather(rows: list[tuple[int, int]], device: Any, group: Any, n: int) -> list[tuple[tuple[int, int], ...]]:
    """Every member's ``rows`` gathered over ``group``. On CUDA on a side stream: it waits for queued collectives,
    not for the step's computation on the current stream."""
    side: Any = contextlib.nullcontext()
    if device.type == "cuda":
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        side = torch.cuda.stream(stream)
    with side:
        t = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        return [tuple(tuple(int(x) for x in row) for row in o.cpu().tolist()) for o in out]
