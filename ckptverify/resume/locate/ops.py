"""Locate where a divergence is born from one step's op logs: the origin op, the receivers, the untraced.

Input per side and rank: ``N`` repeats of the step (repeat ``i`` of every rank is one run). Repeat ``i`` of A is
paired with repeat ``i`` of B, and each side's repeats with its first. Ops align by :attr:`OpEvent.key`, never index;
"first" is the rank's execution order. A rank's first differing op is an **origin** (``op``: equal inputs, different
outputs, one-sided, or another non-tensor argument; ``collective``: every member's input equal), a **receiver**
(equal inputs here, a member's input differed), or **untraced**/**state** (inputs differ though no earlier op made
them differently: code the dispatcher does not see, or the starting state). Traps: a ``None`` fingerprint is an
artifact, never a difference; a rank is named only when the logs single it out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.findings import Finding, Location, info, warning
from ckptverify.resume.causes import ranks_text
from ckptverify.trace.comm import RECV
from ckptverify.trace.compare import merged_order
from ckptverify.trace.oplog import OpEvent, OpKey

__all__ = ["ORIGIN_KINDS", "Located", "OpSite", "Origin", "Receiver", "SideVariation", "Via", "locate"]

ORIGIN_KINDS = ("op", "collective", "untraced", "state")

RankLogs = Mapping[int, Sequence[Sequence[OpEvent]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpSite:
    """One op of one rank, by identity."""

    rank: int
    step: int
    phase: str
    module: str
    op: str
    occurrence: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.op} ({_where(self.occurrence, self.phase, self.module)})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """Where the divergence is born. ``rank`` ``None``: several ranks are origins on their own (see
    :attr:`Located.origins`), and fields they differ in are ``None``. For ``untraced``/``state`` the op is the first
    that read the differing value (one hop after it was made). ``repeats_differing``: pairs where this holds."""

    kind: str
    rank: int | None
    step: int
    phase: str | None
    module: str | None
    op: str | None
    occurrence: int | None
    repeats_differing: int

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of ``stats.verdict.origin``."""
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Via:
    """The collective through which a receiver got the difference; ``senders``: members whose input differed (for a
    receive, the peer), empty when no log shows it."""

    collective: str
    group: tuple[int, ...]
    seq: int
    senders: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"collective": self.collective, "group": list(self.group), "seq": self.seq,
                "senders": list(self.senders)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Receiver:
    """A rank whose first difference came from another rank. ``op``: the collective itself when its output was
    compared (``seen``), else the first op that read a differing value after it."""

    rank: int
    step: int
    op: str
    via: Via
    occurrence: int = 0
    seen: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of one entry of ``stats.verdict.receivers``."""
        return {"rank": self.rank, "step": self.step, "op": self.op, "via": self.via.to_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class SideVariation:
    """One side's repeats differ among themselves on ``rank`` (not deterministic): ``site`` is the first op differing
    from the side's first repeat."""

    side: str
    rank: int
    site: OpSite
    repeats_differing: int
    repeats: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Located:
    """The located divergence of one step.

    ``origin`` ``None``: no log shows where it is born; ``origins``: each rank's own when several. For a single
    origin rank: ``one_side`` (ran on one side only), ``rewired`` (read another value both sides had: a changed
    call), ``output`` (first differing output, with chunk range), ``arguments`` (differing non-tensor arguments),
    ``last_equal`` and ``produced_in_step`` (for ``untraced``/``state``). ``seen_in``: ``ab`` or the side whose own
    repeats showed it; ``within_side``: sides whose repeats differ; ``deterministic``: sides the caller found bitwise
    equal run to run (never called naturally varying)."""

    step: int
    ranks: tuple[int, ...]
    repeats: int
    origin: Origin | None = None
    origins: tuple[Origin, ...] = ()
    receivers: tuple[Receiver, ...] = ()
    one_side: str | None = None
    rewired: bool = False
    output: dict[str, Any] | None = None
    last_equal: OpSite | None = None
    produced_in_step: bool | None = None
    state_equal: bool | None = None
    within_side: tuple[SideVariation, ...] = ()
    missing: tuple[int, ...] = ()
    arguments: tuple[dict[str, Any], ...] = ()
    seen_in: str = "ab"
    names: tuple[str, str] = ("A", "B")
    deterministic: tuple[str, ...] = ()
    side_pairs: tuple[int, int] = (0, 0)

    @property
    def diverged(self) -> bool:
        return self.origin is not None or bool(self.receivers)

    def to_dict(self) -> dict[str, Any]:
        """``origin`` and ``receivers`` as in ``stats.verdict``, plus what the analysis knows beside them."""
        return {
            "origin": self.origin.to_dict() if self.origin is not None else None,
            "receivers": [r.to_dict() for r in self.receivers],
            "step": self.step,
            "ranks": list(self.ranks),
            "repeats": self.repeats,
            "origins": [o.to_dict() for o in self.origins],
            "one_side": self.one_side,
            "rewired": self.rewired,
            "output": self.output,
            "last_equal": self.last_equal.to_dict() if self.last_equal is not None else None,
            "produced_in_step": self.produced_in_step,
            "state_equal": self.state_equal,
            "within_side": [v.to_dict() for v in self.within_side],
            "missing": list(self.missing),
            "arguments": [dict(x) for x in self.arguments],
            "seen_in": self.seen_in,
            "sentence": self.sentence(),
        }

    def findings(self) -> list[Finding]:
        """The verdict as findings: ``locate-origin``, ``locate-receiver`` each, ``locate-nondeterministic``
        warnings, or ``locate-clean``; none is an error (they explain a divergence the calling check judged)."""
        out: list[Finding] = []
        if not self.diverged:
            out.append(info("locate-clean", self.sentence(), location=Location(record=f"step {self.step}")))
        if self.origin is not None:
            out.append(info("locate-origin", self.sentence(), actual=self.origin.to_dict(),
                            location=Location(rank=self.origin.rank, record=_record(self.origin))))
        for r in self.receivers:
            v = r.via
            out.append(info("locate-receiver", f"rank {r.rank} received the difference of step {r.step} through "
                            f"{v.collective} (group {list(v.group)}, seq {v.seq})"
                            + (f" from {ranks_text(v.senders)}" if v.senders else ""),
                            actual=r.to_dict(), location=Location(rank=r.rank, record=f"step {r.step} {r.op}")))
        for v in self.within_side:
            out.append(warning("locate-nondeterministic", f"the {v.repeats} repeats of {self._side(v.side)} differ "
                               f"among themselves on rank {v.rank} ({v.repeats_differing} differ from the first), "
                               f"first at {v.site.describe()}", actual=v.to_dict(),
                               location=Location(rank=v.rank, record=f"step {v.site.step} {v.site.op}")))
        return out

    def _side(self, side: str) -> str:
        return f"side {self.names[0] if side == 'a' else self.names[1]}"

    def sentence(self) -> str:
        """The verdict in one sentence."""
        if not self.diverged:
            text = (f"No divergence at step {self.step}: every op on {ranks_text(self.ranks)} has equal inputs and "
                    f"outputs in {self.repeats} repeat pair{'s' if self.repeats != 1 else ''}")
        else:
            text = self._origin_text() + self._receivers_text()
        return text + self._within_text() + "."

    def _origin_text(self) -> str:
        o = self.origin
        if o is None:
            return f"Step {self.step} differs on {ranks_text([r.rank for r in self.receivers])}, but no log " \
                   f"here shows where it is born"
        who = f"rank {o.rank}" if o.rank is not None else \
            f"{ranks_text(tuple(x.rank for x in self.origins if x.rank is not None))} (each on its own)"
        born = f"The divergence at step {self.step} is born on {who}"
        if o.op is None or o.occurrence is None:
            return (f"{born} at different ops: "
                    + "; ".join(f"rank {x.rank}: {x.op} (occurrence {x.occurrence})" for x in self.origins))
        site = f"{o.op} ({_where(o.occurrence, o.phase, o.module)})"
        count = f"in {o.repeats_differing} of {self.repeats} repeat pairs"
        if self.seen_in in ("a", "b"):
            pairs = self.side_pairs[0 if self.seen_in == "a" else 1]
            count = f"in {o.repeats_differing} of {pairs} pairs of repeats of {self._side(self.seen_in)}"
        if o.kind == "op":
            return self._op_text(o, born, site, count)
        if o.kind == "collective":
            return f"{born} in the collective {site}: every member's input to it was equal and its output differs " \
                   f"{count}"
        return self._unseen_text(o, who, site, count)

    def _op_text(self, o: Origin, born: str, site: str, count: str) -> str:
        """An origin op: nondeterministic within one side, another argument, another tensor read, on one side
        only, or equal inputs and different outputs."""
        if self.seen_in in ("a", "b"):
            how = "ran in only some of its repeats" if self.output is None and not self.arguments else \
                "has equal inputs and different outputs across its repeats"
            return (f"{born}: {site} {how} ({count}): it is nondeterministic within {self._side(self.seen_in)}, "
                    "whether or not the pairs of the two sides happened to differ there")
        if self.arguments:
            one = len(self.arguments) == 1
            named = ", ".join(f"{x['name']}: {x['a']} vs {x['b']}" if x["a"] is not None and x["b"] is not None
                              else f"{x['name']} differs" for x in self.arguments)
            return (f"{born} at {o.op} {named} ({_where(o.occurrence, o.phase, o.module)}): its tensor inputs are "
                    f"equal and {'one argument' if one else f'{len(self.arguments)} arguments'} other than a tensor "
                    f"{'differs' if one else 'differ'} ({count})")
        if self.rewired:
            return (f"{born}: {site} reads other values than on the other side, each a value both sides had (it is "
                    f"called on another tensor: the call or the op sequence changed) ({count})")
        if self.one_side is not None:
            return f"{born}: {site} ran on {self._side(self.one_side)} only ({count})"
        where = ""
        if self.output is not None:
            where = f" (output {self.output['index']}"
            if "chunk" in self.output:
                start, end = self.output["elements"]
                where += f", chunk {self.output['chunk']}: elements {start}..{end - 1}"
            where += ")"
        return f"{born}: {site} has equal inputs and different outputs{where} {count}"

    def _unseen_text(self, o: Origin, who: str, site: str, count: str) -> str:
        """A value born where the op trace does not see (``untraced``), or already in the starting state."""
        if o.rank is None:  # several ranks: each has its own last equal op (see origins)
            after = "each after its last equal op"
        elif self.last_equal is not None:
            after = f"after the last equal op {self.last_equal.describe()}"
        else:
            after = "before the first op of the step"
        if o.kind == "state":
            return f"The difference was already in the state step {self.step} started from on {who}: " \
                   f"{site} is the first op to read it ({count}); the restore comparison names the state"
        unless = ""
        if not self.produced_in_step and self.state_equal is None:
            unless = " (unless the state the step started from differed: compare the state before the step)"
        place = o.module or "the step"
        if self.last_equal is not None and self.last_equal.module != o.module:
            place = f"{self.last_equal.module or 'the step'} and {place}"
        return (f"The difference is born outside what the op trace sees on {who} at step {self.step}, "
                f"{after}: {site} read a value that differs and that no traced op produced differently "
                f"({count}){unless}; probe the code that runs between them in {place} (numpy, a C extension, a "
                f"kernel called outside the dispatcher)")

    def _receivers_text(self) -> str:
        parts = []
        for r in self.receivers:
            v = r.via
            senders = f"from {ranks_text(v.senders)}" if v.senders else "from a member whose log is not here"
            through = f"{v.collective} (group {list(v.group)}, seq {v.seq})"
            if r.seen:
                parts.append(f"rank {r.rank} received it through {through} {senders}")
            else:
                parts.append(f"rank {r.rank} first reads it at {r.op} (occurrence {r.occurrence}), after {through}, "
                             f"whose output was not fingerprinted and into which {ranks_text(v.senders)} fed a "
                             f"difference: it most likely arrived through it")
        return ("; " + "; ".join(parts)) if parts else ""

    def _within_text(self) -> str:
        """What each side's repeats say of themselves, never contradicting evidence: a side found deterministic is
        not said to vary naturally; "natural variation" only where a side varies at the op where the sides part."""
        if not self.within_side:
            return ""
        sides = sorted({v.side for v in self.within_side})
        first = self.within_side[0]
        which = self._side(sides[0]) if len(sides) == 1 else "both sides"
        text = f"; the repeats of {which} differ among themselves (first at {first.site.describe()} on rank " \
               f"{first.rank})"
        known = [x for x in sides if x in self.deterministic]
        if known:
            names = " and ".join(self._side(x) for x in known)
            return (text + f": {names} agreed bitwise in every run of the check, so it is nondeterministic only some "
                    "of the time (what varies here does not vary in every run)")
        o = self.origin
        if self.seen_in in ("a", "b") and o is not None:
            return text
        if o is None or any(v.site.op == o.op and v.site.occurrence == o.occurrence and v.site.phase == o.phase
                            and v.site.module == o.module for v in self.within_side):
            return text + ": the step is not deterministic, so a difference between the sides may be its natural " \
                          "variation"
        return text + ": the step is not deterministic there, but the sides part elsewhere"


def _where(occurrence: int | None, phase: str | None, module: str | None) -> str:
    """``occurrence k, phase[ in module]``: where an op ran, as every sentence names it."""
    return f"occurrence {occurrence}, {phase}{f' in {module}' if module else ''}"


def _record(o: Origin) -> str:
    parts = [f"step {o.step}"] + [str(x) for x in (o.phase, o.module, o.op) if x]
    if o.occurrence is not None and o.op:
        parts[-1] += f"#{o.occurrence}"
    return " ".join(parts)


def _differs(x: int | None, y: int | None) -> bool:
    # None is an artifact (empty output, in-flight buffer, non-blocking copy): never a difference.
    return x is not None and y is not None and x != y


def _inputs_differ(a: OpEvent, b: OpEvent) -> bool:
    return len(a.inputs) != len(b.inputs) or any(_differs(x, y) for x, y in zip(a.inputs, b.inputs, strict=True))


def _argument_difference(a: OpEvent, b: OpEvent) -> tuple[dict[str, Any], ...]:
    """Non-tensor arguments whose values differ between two events of one key, as ``{"name", "a", "b"}`` (readable
    value, or ``None`` when too large or absent)."""
    if a.arguments == b.arguments:
        return ()
    xa = {x.name: x for x in a.arguments}
    xb = {x.name: x for x in b.arguments}
    return tuple({"name": n, "a": xa[n].text if n in xa else None, "b": xb[n].text if n in xb else None}
                 for n in dict.fromkeys([*xa, *xb]) if n not in xa or n not in xb or xa[n].digest != xb[n].digest)


def _own_difference(a: OpEvent, b: OpEvent) -> tuple[dict[str, Any] | None, tuple[dict[str, Any], ...]] | None:
    """``(first differing output, arguments that count)`` of two events with equal inputs; ``None``: equal."""
    output = _output_difference(a, b)
    arguments = _argument_difference(a, b)
    # An argument that changes nothing is no difference; one whose effect was not compared (no output
    # fingerprinted: an artifact's is not) is.
    if arguments and output is None and all(any(x is not None for x in e.outputs) for e in (a, b)):
        arguments = ()
    return (output, arguments) if output is not None or arguments else None


def _output_difference(a: OpEvent, b: OpEvent) -> dict[str, Any] | None:
    """The first differing output of two events of one key (``None``: outputs equal)."""
    if len(a.outputs) != len(b.outputs):
        return {"index": min(len(a.outputs), len(b.outputs))}
    def at(values: Sequence[Any], i: int) -> Any:
        return values[i] if i < len(values) else None

    for i, (x, y) in enumerate(zip(a.outputs, b.outputs, strict=True)):
        chunk = _chunk_difference(at(a.chunks, i), at(b.chunks, i))
        if (_differs(x, y) or at(a.shapes, i) != at(b.shapes, i) or at(a.dtypes, i) != at(b.dtypes, i)
                or chunk is not None):
            out: dict[str, Any] = {"index": i}
            if chunk is not None and a.chunk_elements > 0:
                start = chunk * a.chunk_elements
                end = start + a.chunk_elements
                if i < len(a.numels):
                    end = min(end, a.numels[i])
                out.update(chunk=chunk, elements=[start, end])
            return out
    return None


def _chunk_difference(xs: Sequence[int] | None, ys: Sequence[int] | None) -> int | None:
    if xs is None or ys is None:
        return None
    first = next((c for c, (x, y) in enumerate(zip(xs, ys, strict=False)) if _differs(x, y)), None)
    return first if first is not None or len(xs) == len(ys) else min(len(xs), len(ys))


def _by_key(events: Sequence[OpEvent], *, what: str) -> dict[OpKey, OpEvent]:
    out: dict[OpKey, OpEvent] = {}
    for e in events:
        if not isinstance(e, OpEvent):
            raise UsageError(f"{what}: expected OpEvent records, got {type(e).__name__}")
        key = (e.step, e.phase, e.module, e.op, e.occurrence)  # OpEvent.key, without the property call
        if key in out:
            raise UsageError(f"{what}: the op {key} is recorded twice (an op log keys each op once)")
        out[key] = e
    return out


def _same(a: OpEvent, b: OpEvent) -> bool:
    """Fast path: two events of one key identical in everything compared."""
    return (a.inputs == b.inputs and a.outputs == b.outputs and a.shapes == b.shapes and a.dtypes == b.dtypes
            and a.chunks == b.chunks and a.arguments == b.arguments)


@dataclass(frozen=True, slots=True)
class _First:
    """The first difference of one rank in one pair."""

    what: str  # "one-sided", "outputs" (inputs equal), "arguments" (tensors equal, other arguments not), "inputs"
    event: OpEvent  # side A's event (side B's when the op ran on B only)
    side: str | None = None  # for one-sided: the side it ran on
    output: dict[str, Any] | None = None
    arguments: tuple[dict[str, Any], ...] = ()  # for "arguments": those that differ
    last_equal: OpEvent | None = None
    produced_in_step: bool = False
    rewired: bool = False  # for "inputs": each side read a value both sides had


class _Pair:
    """One rank's logs of one repeat on both sides, aligned by key."""

    def __init__(self, a: Sequence[OpEvent], b: Sequence[OpEvent], *, what: str) -> None:
        self.ka = _by_key(a, what=what)  # checks the records before anything reads them
        self.kb = _by_key(b, what=what)
        self.a = sorted(self.ka.values(), key=lambda e: e.index)
        self.b = sorted(self.kb.values(), key=lambda e: e.index)

    @cached_property
    def _comm(self) -> tuple[dict[tuple[tuple[int, ...], int], OpEvent], ...]:
        return tuple({(e.comm.group, e.comm.seq): e for e in reversed(events) if e.comm is not None}
                     for events in (self.a, self.b))

    def comm_event(self, group: tuple[int, ...], seq: int) -> tuple[OpEvent | None, OpEvent | None]:
        """Each side's collective of ``group`` with sequence number ``seq``."""
        return self._comm[0].get((group, seq)), self._comm[1].get((group, seq))

    def first(self) -> _First | None:
        """Walks both logs in one execution order (:func:`~ckptverify.trace.compare.merged_order`)."""
        merged = merged_order([e.key for e in self.a], [e.key for e in self.b])
        for n, key in enumerate(merged):
            ea, eb = self.ka.get(key), self.kb.get(key)
            if ea is not None and eb is not None and _same(ea, eb):
                continue
            last_equal = self.ka[merged[n - 1]] if n > 0 else None
            if ea is None or eb is None:
                return _First("one-sided", ea or self.kb[key], side="a" if eb is None else "b",
                              last_equal=last_equal)
            if _inputs_differ(ea, eb):
                produced, seen = self._values_before(merged, n)
                pairs = [(x, y) for x, y in zip(ea.inputs, eb.inputs, strict=False) if _differs(x, y)]
                # Each side read a value both sides had: a changed call, not an outside change.
                rewired = len(ea.inputs) != len(eb.inputs) or all(x in seen and y in seen for x, y in pairs)
                made = any(x in produced or y in produced for x, y in pairs)
                return _First("inputs", ea, last_equal=last_equal, produced_in_step=made, rewired=rewired)
            own = _own_difference(ea, eb)
            if own is not None:
                output, arguments = own
                return _First("arguments" if arguments else "outputs", ea, output=output, arguments=arguments,
                              last_equal=last_equal)
        return None

    def _values_before(self, merged: list[OpKey], n: int) -> tuple[set[int], set[int]]:
        """Outputs of the equal ops before position ``n``, and all their values: values both sides had."""
        produced: set[int] = set()
        seen: set[int] = set()
        for key in merged[:n]:
            for e in (self.ka[key], self.kb[key]):
                produced.update(x for x in e.outputs if x is not None)
                seen.update(x for x in e.inputs if x is not None)
        seen |= produced
        return produced, seen


def _site(rank: int, e: OpEvent) -> OpSite:
    return OpSite(rank=rank, step=e.step, phase=e.phase, module=e.module, op=e.op, occurrence=e.occurrence)


@dataclass(frozen=True, slots=True)
class _Verdict:
    """What one rank's first difference in one pair is."""

    kind: str  # an origin kind, or "receiver"
    first: _First
    via: Via | None = None
    seen: bool = True  # for a receiver: whether the collective's output itself was compared

    @property
    def identity(self) -> tuple[str, OpKey]:
        return self.kind, self.first.event.key


def _classify(rank: int, pairs: Mapping[int, _Pair], state_equal: bool | None) -> _Verdict | None:
    first = pairs[rank].first()
    if first is None:
        return None
    if first.what in ("one-sided", "arguments") or first.rewired:
        return _Verdict("op", first)
    if first.what == "inputs":
        via = _through_unseen_output(rank, first, pairs)
        if via is not None:
            return _Verdict("receiver", first, via, seen=False)
        if state_equal is False and not first.produced_in_step:
            return _Verdict("state", first)
        return _Verdict("untraced", first)
    if first.event.comm is None:
        return _Verdict("op", first)
    via, fed = _fed(rank, first.event, pairs)
    return _Verdict("collective", first) if fed is False else _Verdict("receiver", first, via)


def _fed(rank: int, event: OpEvent, pairs: Mapping[int, _Pair]) -> tuple[Via, bool | None]:
    """The collective or receive ``event`` as a :class:`Via` (senders: the members, same group and seq, whose input
    differed, or a receive's peer), and whether another rank fed it a difference (``None``: no log tells); the k-th
    receive from a peer pairs with the peer's k-th send here."""
    c = event.comm
    assert c is not None
    if c.peer is not None and c.collective in RECV:
        via = Via(collective=c.collective, group=c.group, seq=c.seq, senders=(c.peer,))
        peer = pairs.get(c.peer)
        if peer is None:
            return via, None
        mine = [e for e in pairs[rank].a if e.comm is not None and e.comm.peer == c.peer and e.comm.collective in RECV]
        k = next((i for i, e in enumerate(mine) if e.key == event.key), None)
        # The peer's sends to this rank in A's order, each with B's event of the same key.
        sends = [(e, peer.kb.get(e.key)) for e in peer.a
                 if e.comm is not None and e.comm.peer == rank and e.comm.collective not in RECV]
        if k is None or k >= len(sends) or sends[k][1] is None:
            return via, None
        return via, _inputs_differ(*sends[k])  # type: ignore[arg-type]
    senders: list[int] = []
    complete = True  # every member's log holds the collective
    for member in c.group:
        if member == rank:
            continue
        ea, eb = pairs[member].comm_event(c.group, c.seq) if member in pairs else (None, None)
        if ea is None or eb is None:
            complete = False
        elif _inputs_differ(ea, eb):
            senders.append(member)
    via = Via(collective=c.collective, group=c.group, seq=c.seq, senders=tuple(senders))
    return via, True if senders else (False if complete else None)


def _through_unseen_output(rank: int, first: _First, pairs: Mapping[int, _Pair]) -> Via | None:
    """For a first difference in inputs: the earliest earlier collective or receive whose output was not
    fingerprinted (in flight) and into which another rank fed a difference: the likely way it arrived."""
    pair = pairs[rank]
    for e in pair.a:
        if e.index >= first.event.index:
            break
        other = pair.kb.get(e.key)
        if e.comm is None or other is None or all(x.outputs and None not in x.outputs for x in (e, other)):
            continue  # not a collective, or its output fingerprinted on both sides
        via, fed = _fed(rank, e, pairs)
        if fed:
            return via
    return None


def _check_logs(logs: Any, side: str) -> dict[int, list[list[OpEvent]]]:
    if not isinstance(logs, Mapping):
        raise UsageError(f"side {side}: expected a mapping of rank to repeats of op logs, got {type(logs).__name__}")
    out: dict[int, list[list[OpEvent]]] = {}
    for rank, repeats in logs.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise UsageError(f"side {side}: a rank must be a non-negative integer, got {rank!r}")
        if isinstance(repeats, (str, bytes)) or not isinstance(repeats, Sequence) or \
                any(isinstance(r, (str, bytes)) or not isinstance(r, Sequence) for r in repeats):
            raise UsageError(f"side {side}, rank {rank}: expected a list of repeats, each a list of OpEvent")
        out[rank] = [list(r) for r in repeats]
    return out


def locate(a: RankLogs, b: RankLogs, *, step: int | None = None, state_equal: bool | None = None,
           names: tuple[str, str] = ("A", "B"), deterministic: Sequence[str] = ()) -> Located:
    """Locate the divergence of one step between sides ``a`` and ``b`` (per rank, the step's repeats).

    Pairs repeat ``i`` of A with repeat ``i`` of B and each side's repeats with its first; ``step`` defaults to the
    smallest step in the logs. ``state_equal`` (was the starting state proved equal) decides ``untraced`` vs
    ``state``. Per rank the most direct verdict wins (an op or collective seen directly, then a receiver, then
    untraced; a within-side origin counts even if the A/B pairs agreed), the A/B pairs first, then the majority.
    :class:`~ckptverify.errors.UsageError` on malformed or empty logs."""
    la, lb = _check_logs(a, "A"), _check_logs(b, "B")
    ranks = tuple(sorted(set(la) & set(lb)))
    per_side = {side: min((len(logs[r]) for r in ranks), default=0) for side, logs in (("a", la), ("b", lb))}
    repeats = min(per_side.values())
    if not ranks or repeats == 0:
        raise UsageError("nothing to compare: no rank has op logs on both sides" if not ranks else
                         f"nothing to compare: a rank has no repeat on one side (ranks {list(ranks)})")
    if step is None:
        step = min((e.step for side in (la, lb) for r in ranks for rep in side[r] for e in rep
                    if isinstance(e, OpEvent)), default=0)
    else:
        # Non-OpEvent entries stay, to be refused.
        la, lb = ({r: [[e for e in rep if not isinstance(e, OpEvent) or e.step == step] for rep in reps]
                   for r, reps in side.items()} for side in (la, lb))
    if not any(rep for side in (la, lb) for r in ranks for rep in side[r]):
        raise UsageError(f"nothing to compare: the logs hold no op of step {step}")

    # Per pair compared, its source ("ab": A's repeat i vs B's; "a"/"b": that side's repeat i vs its repeat 0),
    # each rank's verdict, and the pair's logs per rank.
    compared: list[tuple[str, dict[int, _Verdict], Callable[[int], tuple[Sequence[OpEvent], ...]]]] = []

    def compare(source: str, i: int, logs_of: Callable[[int], tuple[Sequence[OpEvent], ...]], what: str) -> None:
        pairs = {r: _Pair(*logs_of(r), what=f"{what}rank {r}, repeat {i}") for r in ranks}
        compared.append((source, {r: v for r in ranks if (v := _classify(r, pairs, state_equal)) is not None},
                         logs_of))

    for i in range(repeats):
        compare("ab", i, lambda r, i=i: (la[r][i], lb[r][i]), "")
    for side, logs in (("a", la), ("b", lb)):
        for i in range(1, per_side[side]):
            compare(side, i, lambda r, i=i, logs=logs: (logs[r][0], logs[r][i]), f"side {side.upper()}, ")

    origins: list[Origin] = []
    receivers: list[Receiver] = []
    details: dict[int, tuple[_Verdict, str]] = {}
    for r in ranks:
        chosen_at = _choose(r, compared)
        if chosen_at is None:
            continue
        source, chosen = chosen_at
        e = chosen.first.event
        if chosen.kind == "receiver":
            assert chosen.via is not None
            receivers.append(Receiver(rank=r, step=e.step, op=e.op, via=chosen.via, occurrence=e.occurrence,
                                      seen=chosen.seen))
            continue
        # Also count pairs where the op differed without being the rank's first difference.
        count = sum(1 for src, verdicts, logs_of in compared if src == source
                    and ((r in verdicts and verdicts[r].identity == chosen.identity)
                         or (chosen.kind == "op" and _op_differs(*logs_of(r), e.key))))
        details[r] = (chosen, source)
        origins.append(Origin(kind=chosen.kind, rank=r, step=e.step, phase=e.phase, module=e.module, op=e.op,
                              occurrence=e.occurrence, repeats_differing=count))

    first = details[origins[0].rank][0].first if len(origins) == 1 else None  # type: ignore[index]
    sources = {src for _, src in details.values()}
    seen_in = sources.pop() if len(sources) == 1 else "ab"
    return Located(
        step=step, ranks=ranks, repeats=repeats, origin=_combine(origins),
        origins=tuple(origins) if len(origins) > 1 else (),
        receivers=tuple(receivers),
        one_side=first.side if first is not None and first.what == "one-sided" and seen_in == "ab" else None,
        rewired=first is not None and first.what == "inputs" and first.rewired,
        output=first.output if first is not None else None,
        arguments=first.arguments if first is not None else (),
        last_equal=_site(origins[0].rank, first.last_equal)  # type: ignore[arg-type]
        if first is not None and first.what == "inputs" and first.last_equal is not None else None,
        produced_in_step=first.produced_in_step if first is not None and first.what == "inputs" else None,
        state_equal=state_equal,
        within_side=tuple(v for side in "ab" for v in _within_side(compared, side, per_side[side])),
        missing=tuple(sorted(set(la) ^ set(lb))),
        seen_in=seen_in,
        names=(str(names[0]), str(names[1])),
        deterministic=tuple(x for x in ("a", "b") if x in deterministic),
        side_pairs=(per_side["a"] - 1, per_side["b"] - 1),
    )


_DIRECTNESS = {"op": 0, "collective": 0, "receiver": 1, "untraced": 2, "state": 2}


def _choose(rank: int, compared: Sequence[tuple[str, dict[int, _Verdict], Any]]) -> tuple[str, _Verdict] | None:
    """The verdict of ``rank`` over every comparison and where it was seen: the most direct kind anywhere (an
    untraced verdict may be the effect of an earlier step's difference another pair shows at its op), the A/B pairs'
    first, then the majority, earliest among equals."""
    found = [(src, v[rank]) for src, v, _ in compared if rank in v]
    if not found:
        return None
    best = min(_DIRECTNESS[v.kind] for _, v in found)
    pool = [(src, v) for src, v in found if _DIRECTNESS[v.kind] == best]
    if any(src == "ab" for src, _ in pool):
        pool = [(src, v) for src, v in pool if src == "ab"]
    tally = Counter((src, v.identity) for src, v in pool)
    most = max(tally.values())
    return next((src, v) for src, v in pool if tally[(src, v.identity)] == most)


def _op_differs(a: Sequence[OpEvent], b: Sequence[OpEvent], key: OpKey) -> bool:
    """Whether, in one pair, the op ``key`` ran on one side only, or had equal inputs and different outputs."""
    ea = next((e for e in a if e.key == key), None)
    eb = next((e for e in b if e.key == key), None)
    if ea is None or eb is None:
        return (ea is None) != (eb is None)
    return not _inputs_differ(ea, eb) and _own_difference(ea, eb) is not None


def _combine(origins: list[Origin]) -> Origin | None:
    if len(origins) <= 1:
        return origins[0] if origins else None

    def same(name: str) -> Any:
        values = {getattr(o, name) for o in origins}
        return values.pop() if len(values) == 1 else None

    return Origin(kind=same("kind") or "op", rank=None, step=min(o.step for o in origins),
                  phase=same("phase"), module=same("module"), op=same("op"), occurrence=same("occurrence"),
                  repeats_differing=min(o.repeats_differing for o in origins))


def _within_side(compared: Sequence[tuple[str, dict[int, _Verdict], Any]], side: str, count: int
                 ) -> tuple[SideVariation, ...]:
    """Ranks where a side's repeats first differ from its first repeat by birth (receivers only when no rank shows
    the birth)."""
    firsts: dict[int, list[_Verdict]] = {}
    for src, verdicts, _ in compared:
        for r, v in verdicts.items() if src == side else ():
            firsts.setdefault(r, []).append(v)
    born = [r for r, vs in firsts.items() if any(v.kind != "receiver" for v in vs)] or list(firsts)
    return tuple(SideVariation(side=side, rank=r, site=_site(r, firsts[r][0].first.event),
                               repeats_differing=len(firsts[r]), repeats=count) for r in sorted(born))
