"""The ladder's per-rank analysis (ckptverify.resume.locate.ops) on op logs built the way the recorder writes them.

Each scenario builds, per side and rank, the op log of one training step of a small DDP-like loop (forward,
backward, the gradient all-reduce, the optimizer) and plants one cause; next to it stand the causes it must not
be confused with.
"""

from __future__ import annotations

import json
import random

import pytest

from ckptverify.errors import UsageError
from ckptverify.resume.locate.ops import ORIGIN_KINDS, locate
from ckptverify.trace.oplog import CommInfo, OpEvent

STEP = 12
WORLD = (0, 1)


def fp(*parts: object) -> int:
    """A deterministic 128-bit stand-in for a fingerprint of the named value."""
    return random.Random(repr(parts)).getrandbits(128)


class Log:
    """Builds one rank's op log of one step, keying each op by (phase, module, op) occurrence as the recorder
    does, and numbering execution order."""

    def __init__(self, step: int = STEP) -> None:
        self.step = step
        self.events: list[OpEvent] = []
        self._seen: dict[tuple[str, str, str], int] = {}
        self._seq: dict[tuple[int, ...], int] = {}

    def op(self, phase: str, module: str, op: str, inputs: tuple, outputs: tuple, **kw: object) -> Log:
        k = (phase, module, op)
        occ = self._seen.get(k, 0)
        self._seen[k] = occ + 1
        self.events.append(OpEvent(step=self.step, phase=phase, module=module, op=op, occurrence=occ,
                                   index=len(self.events), inputs=inputs, outputs=outputs, **kw))
        return self

    def comm(self, phase: str, module: str, collective: str, inputs: tuple, outputs: tuple, *,
             group: tuple[int, ...] = WORLD, peer: int | None = None, reduce_op: str | None = None) -> Log:
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        return self.op(phase, module, f"c10d.{collective}.default", inputs, outputs,
                       comm=CommInfo(collective=collective, group=group, seq=seq, peer=peer, reduce_op=reduce_op))


def ddp_step(rank: int, *, noise: object = None, numpy: bool = False, numpy_noise: object = None,
             reduced: object = "sum", extra_op: bool = False, batch: object = "batch",
             in_flight: bool = False) -> list[OpEvent]:
    """One DDP step on ``rank``: linear -> gelu (custom op) -> dropout, loss, backward, the gradient all-reduce
    (group WORLD), AdamW. ``noise`` perturbs the custom op's output on this rank (a nondeterministic kernel);
    ``numpy``: the activation goes through a numpy round trip between two ops (outside the dispatcher), whose
    result ``numpy_noise`` changes;
    ``reduced`` names the all-reduce's result; ``extra_op`` inserts one more op (a one-op change); ``in_flight``:
    the all-reduce's output was not fingerprinted (a buffer still in flight when recorded)."""
    x = fp("batch", rank, batch)
    w = fp("w")
    log = Log()
    h = fp("h", rank, batch)
    log.op("forward", "blocks.0.fc", "aten.mm.default", (x, w), (h,), shapes=((4, 8),), dtypes=("float32",),
           numels=(32,))
    g = fp("gelu", rank, batch, noise)
    log.op("forward", "blocks.0.act", "mylib.noisy_gelu.default", (h,), (g,))
    if extra_op:
        g2 = fp("scaled", g)
        log.op("forward", "blocks.0.act", "aten.mul.Tensor", (g,), (g2,))
        g = g2
    # A numpy round trip between two ops: no op sees the change, the next op reads it.
    act = fp("numpy", g, numpy_noise) if numpy else g
    d = fp("drop", act)
    log.op("forward", "blocks.0.drop", "aten.native_dropout.default", (act,), (d, fp("mask", rank)))
    loss = fp("loss", d)
    log.op("forward", "", "aten.mse_loss.default", (d, fp("target", rank)), (loss,))
    log.op("backward", "", "aten.ones_like.default", (loss,), (None,))  # an empty*-like artifact
    gw = fp("grad_w", loss)
    log.op("backward", "blocks.0.fc", "aten.mm.default", (x, fp("grad_h", loss)), (gw,))
    log.comm("backward", "", "allreduce_", (gw,), (None if in_flight else fp("reduced", reduced),), reduce_op="sum")
    log.op("optimizer", "", "aten._foreach_add_.Scalar", (w, fp("reduced", reduced)), (fp("w1", reduced),))
    return log.events


def rep(n: int, make) -> list[list[OpEvent]]:
    return [make(i) for i in range(n)]


def test_nondeterministic_op_on_one_rank_is_the_origin_and_the_allreduce_names_the_receiver():
    n = 3
    # Side A and side B: rank 0's custom op gives a different result on every run; the all-reduce spreads it.
    a = {0: rep(n, lambda i: ddp_step(0, noise=("a", i), reduced=("a", i))),
         1: rep(n, lambda i: ddp_step(1, reduced=("a", i)))}
    b = {0: rep(n, lambda i: ddp_step(0, noise=("b", i), reduced=("b", i))),
         1: rep(n, lambda i: ddp_step(1, reduced=("b", i)))}
    got = locate(a, b)
    assert got.origin is not None
    o = got.origin.to_dict()
    assert o == {"kind": "op", "rank": 0, "step": STEP, "phase": "forward", "module": "blocks.0.act",
                 "op": "mylib.noisy_gelu.default", "occurrence": 0, "repeats_differing": 3}
    # Rank 1 computed everything the same and is not an origin: it is the receiver, through the all-reduce.
    assert [r.to_dict() for r in got.receivers] == [
        {"rank": 1, "step": STEP, "op": "c10d.allreduce_.default",
         "via": {"collective": "allreduce_", "group": [0, 1], "seq": 0, "senders": [0]}}]
    assert got.origins == ()
    # The repeats of each side differ among themselves, on rank 0 only: nondeterminism within a side.
    assert {(v.side, v.rank) for v in got.within_side} == {("a", 0), ("b", 0)}
    assert all(v.site.op == "mylib.noisy_gelu.default" and v.repeats_differing == 2 for v in got.within_side)
    s = got.sentence()
    assert "rank 0" in s and "mylib.noisy_gelu.default" in s and "3 of 3" in s
    assert "rank 1 received it through allreduce_" in s and "not deterministic" in s
    assert "untraced" not in s and "outside" not in s


def test_deterministic_sides_that_differ_by_one_op_have_no_within_side_variation():
    a = {0: rep(2, lambda i: ddp_step(0)), 1: rep(2, lambda i: ddp_step(1))}
    b = {0: rep(2, lambda i: ddp_step(0, noise="changed", reduced="changed")),
         1: rep(2, lambda i: ddp_step(1, reduced="changed"))}
    got = locate(a, b)
    assert got.origin is not None and got.origin.rank == 0 and got.origin.repeats_differing == 2
    assert got.within_side == ()
    assert "not deterministic" not in got.sentence()


def test_two_of_three_repeats_differ():
    a = {0: rep(3, lambda i: ddp_step(0)), 1: rep(3, lambda i: ddp_step(1))}
    # Repeat 1 of B agrees with A; repeats 0 and 2 differ at rank 0's custom op.
    b = {0: rep(3, lambda i: ddp_step(0, noise=None if i == 1 else i, reduced=None if i == 1 else i)),
         1: rep(3, lambda i: ddp_step(1, reduced=None if i == 1 else i))}
    b[0][1] = ddp_step(0)
    b[1][1] = ddp_step(1)
    got = locate(a, b)
    assert got.origin is not None
    assert (got.origin.rank, got.origin.op, got.origin.repeats_differing) == (0, "mylib.noisy_gelu.default", 2)
    assert "2 of 3 repeat pairs" in got.sentence()
    # Side B's repeats differ among themselves: said.
    assert [(v.side, v.rank, v.repeats_differing) for v in got.within_side] == [("b", 0, 2)]


def test_clean_pair_has_no_origin():
    a = {0: rep(2, lambda i: ddp_step(0)), 1: rep(2, lambda i: ddp_step(1))}
    b = {0: rep(2, lambda i: ddp_step(0)), 1: rep(2, lambda i: ddp_step(1))}
    got = locate(a, b)
    assert got.origin is None and got.receivers == () and not got.diverged
    d = got.to_dict()
    assert d["origin"] is None and d["receivers"] == []
    assert got.sentence().startswith(f"No divergence at step {STEP}")


def test_artifacts_none_fingerprints_are_never_differences():
    a = {0: [ddp_step(0)]}
    b_events = []
    for e in ddp_step(0):
        # Side B did not fingerprint the mask, the loss's input, nor the gelu output (in flight, empty, ...).
        if e.op in ("mylib.noisy_gelu.default", "aten.mse_loss.default"):
            e = OpEvent(**{**e.__dict__, "outputs": (None,) * len(e.outputs), "inputs": (None,) * len(e.inputs)})
        b_events.append(e)
    got = locate(a, {0: [b_events]})
    assert got.origin is None and got.receivers == ()
    # A None next to a real difference hides nothing: the real difference is still found.
    c = [OpEvent(**{**e.__dict__, "outputs": (fp("other"), None)}) if e.op == "aten.native_dropout.default" else e
         for e in b_events]
    got = locate(a, {0: [c]})
    assert got.origin is not None and got.origin.op == "aten.native_dropout.default"
    assert got.output == {"index": 0}


def test_numpy_outside_the_dispatcher_is_untraced_with_module_and_last_equal_op():
    a = {0: [ddp_step(0, numpy=True)], 1: [ddp_step(1)]}
    b = {0: [ddp_step(0, numpy=True, numpy_noise="np", reduced="b")], 1: [ddp_step(1, reduced="b")]}
    got = locate(a, b, state_equal=True)
    assert got.origin is not None
    assert got.origin.to_dict() == {"kind": "untraced", "rank": 0, "step": STEP, "phase": "forward",
                                    "module": "blocks.0.drop", "op": "aten.native_dropout.default",
                                    "occurrence": 0, "repeats_differing": 1}
    assert got.last_equal is not None
    assert (got.last_equal.op, got.last_equal.module) == ("mylib.noisy_gelu.default", "blocks.0.act")
    assert got.produced_in_step is False
    # Not an op origin: the op that shows it had different inputs.
    assert got.output is None
    assert [r.rank for r in got.receivers] == [1]
    s = got.sentence()
    assert "outside what the op trace sees" in s
    assert "probe the code that runs between them in blocks.0.act and blocks.0.drop" in s
    assert "last equal op mylib.noisy_gelu.default" in s


def test_untraced_versus_state():
    """A differing input that no op of the step made is the starting state when the caller says it differed;
    a value an op of the step made and something changed afterwards is untraced whatever the state says."""
    a = {0: [ddp_step(0)]}
    # The batch (a leaf of the step) differs: state, when the state before the step differed.
    b = {0: [ddp_step(0, batch="other")]}
    got = locate(a, b, state_equal=False)
    assert got.origin is not None and got.origin.kind == "state"
    assert got.origin.op == "aten.mm.default" and got.last_equal is None
    assert "already in the state" in got.sentence()
    # Unknown state: untraced, and the sentence says what would tell.
    got = locate(a, b)
    assert got.origin is not None and got.origin.kind == "untraced"
    assert "compare the state before the step" in got.sentence()
    # The gelu output, made by an op of this step on both sides, then changed in place between two ops (side B
    # writes it through a numpy view): untraced even when the state differed, as the value read was made within
    # the step.
    got = locate(a, {0: [ddp_step(0, numpy=True, numpy_noise="np")]}, state_equal=False)
    assert got.origin is not None and got.origin.kind == "untraced" and got.produced_in_step is True
    assert got.origin.op == "aten.native_dropout.default"
    assert "unless the state" not in got.sentence()


def test_op_on_one_side_only_is_an_origin():
    a = {0: [ddp_step(0)], 1: [ddp_step(1)]}
    b = {0: [ddp_step(0, extra_op=True, reduced="b")], 1: [ddp_step(1, reduced="b")]}
    got = locate(a, b)
    assert got.origin is not None
    assert (got.origin.kind, got.origin.rank, got.origin.op, got.origin.module) == \
        ("op", 0, "aten.mul.Tensor", "blocks.0.act")
    assert got.one_side == "b" and "ran on side B only" in got.sentence()
    assert [r.rank for r in got.receivers] == [1]
    # And the other way round.
    got = locate(b, a)
    assert got.one_side == "a" and got.origin is not None and got.origin.op == "aten.mul.Tensor"


def test_aligned_by_key_not_by_index():
    """The same ops with other execution numbers, listed in another order, are equal; an op that moved is
    compared with itself, not with whatever ran at its position."""
    a = {0: [ddp_step(0)]}
    shifted = [OpEvent(**{**e.__dict__, "index": 100 + 3 * e.index}) for e in ddp_step(0)]
    random.Random(1).shuffle(shifted)
    got = locate(a, {0: [shifted]})
    assert got.origin is None
    # B runs one extra op first: every op of B sits one index later, and nothing else differs but that op.
    extra = OpEvent(step=STEP, phase="forward", module="", op="aten.zeros.default", occurrence=0, index=0,
                    outputs=(fp("zeros"),))
    moved = [extra] + [OpEvent(**{**e.__dict__, "index": e.index + 1}) for e in ddp_step(0)]
    got = locate(a, {0: [moved]})
    assert got.origin is not None and got.origin.op == "aten.zeros.default" and got.one_side == "b"


def test_allreduce_output_in_flight_still_names_the_receiver_and_its_sender():
    """Unfingerprinted all-reduce output: rank 1 first sees the difference when the optimizer reads the reduced
    gradient. It came through the all-reduce (rank 0 fed it a different input), not from untraced code."""
    a = {0: [ddp_step(0, in_flight=True)], 1: [ddp_step(1, in_flight=True)]}
    b = {0: [ddp_step(0, noise="n", reduced="n", in_flight=True)], 1: [ddp_step(1, reduced="n", in_flight=True)]}
    got = locate(a, b)
    assert got.origin is not None and (got.origin.kind, got.origin.rank) == ("op", 0) and got.origins == ()
    assert [r.to_dict() for r in got.receivers] == [
        {"rank": 1, "step": STEP, "op": "aten._foreach_add_.Scalar",
         "via": {"collective": "allreduce_", "group": [0, 1], "seq": 0, "senders": [0]}}]
    assert got.receivers[0].seen is False
    assert "whose output was not fingerprinted" in got.sentence()
    # The same unfingerprinted all-reduce, but no member fed it a difference: rank 1's difference is untraced.
    b = {0: [ddp_step(0, reduced="n", in_flight=True)], 1: [ddp_step(1, reduced="n", in_flight=True)]}
    got = locate(a, b, state_equal=True)
    assert got.receivers == ()
    assert [(o.kind, o.rank) for o in got.origins] == [("untraced", 0), ("untraced", 1)]
    assert got.origin is not None and got.origin.rank is None
    assert "each after its last equal op" in got.sentence() and "before the first op" not in got.sentence()


def test_send_recv_names_the_peer():
    def pipeline(rank: int, tag: object, noise: object = None, transport: object = None) -> list[OpEvent]:
        log = Log()
        if rank == 0:
            h = fp("stage0", noise)
            log.op("forward", "stage0.fc", "mylib.noisy_gelu.default", (fp("x"),), (h,))
            log.comm("forward", "", "send", (h,), (), peer=1)
        else:
            got = fp("recv", fp("stage0", noise), transport)
            log.comm("forward", "", "recv_", (None,), (got,), peer=0)
            log.op("forward", "stage1.fc", "aten.mm.default", (got, fp("w1")), (fp("y", got),))
        return log.events

    a = {0: [pipeline(0, "a")], 1: [pipeline(1, "a")]}
    b = {0: [pipeline(0, "b", noise="n")], 1: [pipeline(1, "b", noise="n")]}
    got = locate(a, b)
    assert got.origin is not None and (got.origin.kind, got.origin.rank) == ("op", 0)
    assert [r.to_dict() for r in got.receivers] == [
        {"rank": 1, "step": STEP, "op": "c10d.recv_.default",
         "via": {"collective": "recv_", "group": [0, 1], "seq": 0, "senders": [0]}}]
    # The peer sent equal data and rank 1 received different data: the transfer is the origin, no receiver.
    b = {0: [pipeline(0, "b")], 1: [pipeline(1, "b", transport="flip")]}
    got = locate(a, b)
    assert got.origin is not None and (got.origin.kind, got.origin.rank) == ("collective", 1)
    assert got.receivers == ()
    # Without the peer's log the peer is still where the data came from, but nothing is named origin.
    got = locate({1: a[1]}, {1: [pipeline(1, "b", noise="n")]})
    assert got.origin is None
    assert [r.via.senders for r in got.receivers] == [(0,)]


def test_collective_with_equal_inputs_and_different_outputs_names_no_single_rank():
    a = {0: [ddp_step(0)], 1: [ddp_step(1)]}
    b = {0: [ddp_step(0, reduced="order")], 1: [ddp_step(1, reduced="order")]}
    got = locate(a, b)
    assert got.origin is not None
    assert (got.origin.kind, got.origin.rank, got.origin.op) == ("collective", None, "c10d.allreduce_.default")
    assert [o.rank for o in got.origins] == [0, 1]
    assert got.receivers == ()
    assert "ranks 0, 1 (each on its own)" in got.sentence()
    # A member's log missing: the senders cannot be told, and no origin is invented.
    got = locate({0: a[0]}, {0: b[0]})
    assert got.origin is None
    assert [(r.rank, r.via.senders) for r in got.receivers] == [(0, ())]
    assert "from a member whose log is not here" in got.sentence()


def test_chunked_output_names_its_chunk():
    def topk(order: object) -> list[OpEvent]:
        log = Log()
        chunks = tuple(fp("idx", c, order if c == 2 else None) for c in range(4))
        log.op("forward", "moe.router", "aten.topk.default", (fp("logits"),), (fp("values"), fp("idx", order)),
               shapes=((100,), (100,)), dtypes=("float32", "int64"), numels=(100, 100),
               chunks=(None, chunks), chunk_elements=32)
        return log.events

    got = locate({0: [topk("a")]}, {0: [topk("b")]})
    assert got.origin is not None and got.origin.op == "aten.topk.default"
    assert got.output == {"index": 1, "chunk": 2, "elements": [64, 96]}
    assert "(output 1, chunk 2: elements 64..95)" in got.sentence()


def test_json_shape_is_the_issue_shape():
    a = {0: rep(2, lambda i: ddp_step(0)), 1: rep(2, lambda i: ddp_step(1))}
    b = {0: rep(2, lambda i: ddp_step(0, noise=i, reduced=i)), 1: rep(2, lambda i: ddp_step(1, reduced=i))}
    d = json.loads(json.dumps(locate(a, b).to_dict()))
    assert set(d["origin"]) == {"kind", "rank", "step", "phase", "module", "op", "occurrence", "repeats_differing"}
    assert d["origin"]["kind"] in ORIGIN_KINDS
    assert all(set(r) == {"rank", "step", "op", "via"} for r in d["receivers"])
    assert all(set(r["via"]) == {"collective", "group", "seq", "senders"} for r in d["receivers"])
    assert isinstance(d["sentence"], str) and d["sentence"].count(". ") == 0


@pytest.mark.parametrize("bad", [
    [1, 2],
    {0: "ops"},
    {-1: [[]]},
    {0: [["not an event"]]},
    {0: [[*ddp_step(0), object()]]},
    {0: [[{"op": "aten.mm.default"}, *ddp_step(0)]]},
])
def test_malformed_logs_are_a_usage_error(bad):
    with pytest.raises(UsageError):
        locate(bad, {0: [ddp_step(0)]})


def test_an_op_recorded_twice_is_a_usage_error():
    events = ddp_step(0)
    with pytest.raises(UsageError, match="recorded twice"):
        locate({0: [[*events, events[0]]]}, {0: [events]})


def test_findings_explain_without_failing():
    a = {0: rep(2, lambda i: ddp_step(0, noise=("a", i), reduced=("a", i))),
         1: rep(2, lambda i: ddp_step(1, reduced=("a", i)))}
    b = {0: rep(2, lambda i: ddp_step(0, noise=("b", i), reduced=("b", i))),
         1: rep(2, lambda i: ddp_step(1, reduced=("b", i)))}
    found = locate(a, b).findings()
    checks = [(f.check, f.severity.value, f.location.rank) for f in found]
    assert checks == [("locate-origin", "info", 0), ("locate-receiver", "info", 1),
                      ("locate-nondeterministic", "warning", 0), ("locate-nondeterministic", "warning", 0)]
    assert found[0].location.record == "step 12 forward blocks.0.act mylib.noisy_gelu.default#0"
    assert found[0].actual["op"] == "mylib.noisy_gelu.default"
    clean = locate({0: [ddp_step(0)]}, {0: [ddp_step(0)]}).findings()
    assert [f.check for f in clean] == ["locate-clean"]


def test_nothing_to_compare_is_not_a_clean_verdict():
    with pytest.raises(UsageError, match="nothing to compare"):
        locate({0: [ddp_step(0)]}, {1: [ddp_step(1)]})
    with pytest.raises(UsageError, match="nothing to compare"):
        locate({0: []}, {0: [ddp_step(0)]})
    with pytest.raises(UsageError, match="no op of step 99"):
        locate({0: [ddp_step(0)]}, {0: [ddp_step(0)]}, step=99)
    # Ranks on one side only are named, not compared.
    got = locate({0: [ddp_step(0)], 1: [ddp_step(1)]}, {0: [ddp_step(0)]})
    assert got.ranks == (0,) and got.missing == (1,)


def test_an_op_called_on_another_tensor_is_an_origin_not_untraced():
    """Side B inserts one add of the same kind in the same module: from there on the occurrences of that op are
    shifted, and its first differing occurrence reads, on each side, values both sides had. The op call changed;
    nothing outside the trace did."""
    p, q = fp("p"), fp("q")

    def block(extra: bool) -> list[OpEvent]:
        log = Log()
        r = fp("r")
        log.op("forward", "blocks.1", "aten.mul.Tensor", (p, q), (r,))
        if extra:
            log.op("forward", "blocks.1", "aten.add.Tensor", (p, r), (fp("t"),))
        log.op("forward", "blocks.1", "aten.add.Tensor", (r, q), (fp("s"),))
        return log.events

    got = locate({0: [block(False)]}, {0: [block(True)]}, state_equal=True)
    assert got.origin is not None
    assert (got.origin.kind, got.origin.op, got.origin.occurrence, got.origin.repeats_differing) == \
        ("op", "aten.add.Tensor", 0, 1)
    assert got.rewired and "called on another tensor" in got.sentence()
    # Not confused with a value changed outside the trace: there, one side's value is new (numpy's).
    got = locate({0: [ddp_step(0, numpy=True)]}, {0: [ddp_step(0, numpy=True, numpy_noise="np")]}, state_equal=True)
    assert got.origin is not None and got.origin.kind == "untraced" and not got.rewired


def test_logs_of_a_window_are_compared_step_by_step():
    def window(diff_at: int) -> list[OpEvent]:
        events: list[OpEvent] = []
        for step in (12, 13):
            log = Log(step)
            log.op("forward", "fc", "aten.mm.default", (fp("x", step), fp("w")), (fp("y", step, step == diff_at),))
            events += [OpEvent(**{**e.__dict__, "index": len(events) + e.index}) for e in log.events]
        return events

    a, b = {0: [window(0)]}, {0: [window(13)]}
    assert locate(a, b, step=12).origin is None
    got = locate(a, b, step=13)
    assert got.origin is not None and (got.origin.step, got.origin.op) == (13, "aten.mm.default")
    assert got.step == 13


def test_ranks_born_at_different_ops_are_each_named_with_their_op():
    """Rank 0's custom op is nondeterministic on side B while rank 1 runs one more op there: each rank is an origin
    on its own, at its own op, and the sentence names each."""
    a = {0: [ddp_step(0)], 1: [ddp_step(1)]}
    b = {0: [ddp_step(0, noise="n")], 1: [ddp_step(1, extra_op=True)]}
    got = locate(a, b)
    assert [(o.rank, o.op) for o in got.origins] == [(0, "mylib.noisy_gelu.default"), (1, "aten.mul.Tensor")]
    assert got.origin is not None and (got.origin.rank, got.origin.op) == (None, None)
    assert got.receivers == ()
    assert got.sentence() == (f"The divergence at step {STEP} is born on ranks 0, 1 (each on its own) at different "
                              "ops: rank 0: mylib.noisy_gelu.default (occurrence 0); rank 1: aten.mul.Tensor "
                              "(occurrence 0).")


def test_an_op_on_one_side_only_counts_in_pairs_where_an_earlier_op_differed_first():
    """Side B runs one more op in repeats 0 and 1; in repeat 1 an earlier op also differs, so that op is the
    rank's first difference there, yet the extra op still ran on one side only: 2 of 3 pairs. Repeat 2 runs the
    same ops on both sides and does not count."""
    a = {0: rep(3, lambda i: ddp_step(0))}
    b = {0: [ddp_step(0, extra_op=True), ddp_step(0, extra_op=True, noise="n"), ddp_step(0)]}
    got = locate(a, b)
    assert got.origin is not None
    assert (got.origin.op, got.origin.repeats_differing) == ("aten.mul.Tensor", 2)
    assert "ran on side B only (in 2 of 3 repeat pairs)" in got.sentence()


def _stages(rank: int, noise: object = None, send: bool = True) -> list[OpEvent]:
    """A two-stage pipeline step: rank 0 computes and sends (unless ``send`` is false), rank 1 receives."""
    log = Log()
    if rank == 0:
        h = fp("stage0", noise)
        log.op("forward", "stage0.fc", "mylib.noisy_gelu.default", (fp("x"),), (h,))
        if send:
            log.comm("forward", "", "send", (h,), (), peer=1)
    else:
        got = fp("recv", fp("stage0", noise))
        log.comm("forward", "", "recv_", (None,), (got,), peer=0)
        log.op("forward", "stage1.fc", "aten.mm.default", (got, fp("w1")), (fp("y", got),))
    return log.events


def test_a_receive_whose_send_the_peer_log_does_not_pair_names_the_peer_not_the_transfer():
    """The peer's log is here but holds no send to pair with the receive on both sides: whether the peer fed a
    difference is unknown, so the receive is not called the origin; the data came from the peer."""
    via = {"collective": "recv_", "group": [0, 1], "seq": 0, "senders": [0]}
    # Side B's peer recorded no send: the send ran on side A only, and rank 1 got the difference through it.
    got = locate({0: [_stages(0)], 1: [_stages(1)]}, {0: [_stages(0, send=False)], 1: [_stages(1, noise="n")]})
    assert got.origin is not None and (got.origin.kind, got.origin.rank, got.origin.op) == \
        ("op", 0, "c10d.send.default")
    assert [r.to_dict()["via"] for r in got.receivers] == [via]
    # Neither side's peer log holds the send: nothing is named origin.
    got = locate({0: [_stages(0, send=False)], 1: [_stages(1)]},
                 {0: [_stages(0, send=False)], 1: [_stages(1, noise="n")]})
    assert got.origin is None and [r.to_dict()["via"] for r in got.receivers] == [via]
    assert got.sentence() == (f"Step {STEP} differs on rank 1, but no log here shows where it is born; rank 1 "
                              "received it through recv_ (group [0, 1], seq 0) from rank 0.")
