"""The ladder's analysis on op logs (ckptverify.resume.locate.ops): every argument of an op is an input, evidence from
any pair of repeats counts, and the sentences never contradict what the runs showed.

Logs are built the way the recorder writes them (``test_locate.ddp_step``: one DDP step of two ranks); each rule
is planted next to what it must not be confused with.
"""

from __future__ import annotations

from dataclasses import replace

from test_locate import Log, ddp_step, fp, rep

from ckptverify.resume.locate.ops import locate
from ckptverify.trace.oplog import OpArgument, OpEvent


def dropout_step(p: float, *, noise: object = None, mask_seen: bool = True) -> list[OpEvent]:
    """One forward of a dropout layer as CPU torch runs it: an uninitialised mask, ``bernoulli_`` with the keep
    probability (a scalar argument), the rescale and the product. The mask's prior content is not an input
    (``bernoulli_`` overwrites it)."""
    keep = 1 - p
    x = fp("x")
    log = Log()
    log.op("forward", "fc", "aten.addmm.default", (fp("b"), fp("in"), fp("w")), (x,))
    log.op("forward", "drop", "aten.empty_like.default", (x,), (None,),
           arguments=(OpArgument("memory_format", fp("fmt"), "None"),))
    mask = fp("mask", keep, noise) if mask_seen else None
    log.op("forward", "drop", "aten.bernoulli_.float", (None,), (mask,),
           arguments=(OpArgument("p", fp("p", keep), repr(keep)), OpArgument("generator", fp("none"), "None")))
    scaled = fp("scaled", keep, noise)
    log.op("forward", "drop", "aten.div_.Scalar", (mask,), (scaled,),
           arguments=(OpArgument("other", fp("other", keep), repr(keep)),))
    log.op("forward", "drop", "aten.mul.Tensor", (x, scaled), (fp("out", keep, noise),))
    return log.events


# ------------------------------------------------------------------------------------------- arguments


def test_equal_tensors_and_a_differing_scalar_make_that_op_the_origin():
    got = locate({0: [dropout_step(0.1), dropout_step(0.1)]}, {0: [dropout_step(0.2), dropout_step(0.2)]},
                 state_equal=True)
    assert got.origin is not None
    assert (got.origin.kind, got.origin.op, got.origin.module, got.origin.repeats_differing) == \
        ("op", "aten.bernoulli_.float", "drop", 2)
    assert got.arguments == ({"name": "p", "a": "0.9", "b": "0.8"},)
    s = got.sentence()
    assert "aten.bernoulli_.float p: 0.9 vs 0.8" in s and "tensor inputs are equal" in s, s
    assert "outside" not in s and "untraced" not in s
    assert got.to_dict()["arguments"] == [{"name": "p", "a": "0.9", "b": "0.8"}]
    assert got.within_side == ()


def test_a_differing_argument_is_found_even_where_the_output_was_not_fingerprinted():
    # The mask was not compared (an artifact on both sides): the argument still says where the sides part.
    got = locate({0: [dropout_step(0.1, mask_seen=False)]}, {0: [dropout_step(0.2, mask_seen=False)]})
    assert got.origin is not None and got.origin.op == "aten.bernoulli_.float" and got.origin.kind == "op"


def test_an_argument_that_changes_nothing_is_not_a_difference():
    a = dropout_step(0.1)
    # Side B passes another (irrelevant) flag to the product, whose output is equal: no divergence.
    b = [replace(e, arguments=(OpArgument("flag", fp("other"), "True"),)) if e.op == "aten.mul.Tensor" else e
         for e in a]
    got = locate({0: [a]}, {0: [b]})
    assert got.origin is None and not got.diverged, got.sentence()


def test_a_big_argument_is_named_without_its_values():
    a, b = ddp_step(0), ddp_step(0, reduced="b")
    first = a[0]
    a[0] = replace(first, arguments=(OpArgument("size", fp("s1"), None),))
    b[0] = replace(first, arguments=(OpArgument("size", fp("s2"), None),), outputs=(fp("other h"),))
    got = locate({0: [a]}, {0: [b]})
    assert got.origin is not None and got.origin.op == "aten.mm.default"
    assert got.arguments == ({"name": "size", "a": None, "b": None},)
    assert "aten.mm.default size differs" in got.sentence()


def test_tensor_inputs_that_differ_still_decide_before_arguments():
    """A differing tensor input keeps its meaning (untraced, receiver, ...) even when an argument differs too."""
    a = {0: [ddp_step(0, numpy=True)], 1: [ddp_step(1)]}
    b_events = ddp_step(0, numpy=True, numpy_noise="np", reduced="b")
    b_events = [replace(e, arguments=(OpArgument("p", fp("p2"), "0.2"),))
                if e.op == "aten.native_dropout.default" else e for e in b_events]
    got = locate(a, {0: [b_events], 1: [ddp_step(1, reduced="b")]}, state_equal=True)
    assert got.origin is not None and got.origin.kind == "untraced", got.sentence()


# ------------------------------------------------------------------------------------------- any pair


def noisy_sides() -> tuple[dict, dict]:
    """Two sides of two repeats whose custom op on rank 0 differs in every run (rank 1 receives it)."""
    def side(name: str) -> dict:
        return {0: rep(2, lambda i: ddp_step(0, noise=(name, i), reduced=(name, i))),
                1: rep(2, lambda i: ddp_step(1, reduced=(name, i)))}

    return side("a"), side("b")


def flaky_step(rank: int, *, noise: object = None, start: object = "same") -> list[OpEvent]:
    """A DDP step whose custom op on ``rank`` adds ``noise``; ``start`` names the parameters the step starts
    from (another value: the re-run already parted in an earlier step)."""
    return ddp_step(rank, noise=noise, batch=start, reduced=(noise, start))


def test_an_op_that_differs_within_one_side_is_the_origin_when_the_pairs_agree():
    # Repeat i of A equals repeat i of B (the noise came out the same in each pair), but repeats differ.
    a = {0: [ddp_step(0, noise="n0", reduced="n0"), ddp_step(0, noise="n1", reduced="n1")],
         1: [ddp_step(1, reduced="n0"), ddp_step(1, reduced="n1")]}
    b = {0: [ddp_step(0, noise="n0", reduced="n0"), ddp_step(0, noise="n1", reduced="n1")],
         1: [ddp_step(1, reduced="n0"), ddp_step(1, reduced="n1")]}
    got = locate(a, b, names=("base", "changed"))
    assert got.origin is not None, got.sentence()
    assert (got.origin.kind, got.origin.rank, got.origin.op) == ("op", 0, "mylib.noisy_gelu.default")
    assert got.seen_in == "a" and got.origin.repeats_differing == 1
    assert [(r.rank, r.via.senders) for r in got.receivers] == [(1, (0,))]
    s = got.sentence()
    assert "nondeterministic within side base" in s and "does not reproduce" not in s, s
    assert "No divergence" not in s


def test_under_ddp_a_flaky_op_on_rank_1_is_the_origin_and_rank_0_its_receiver():
    """The A/B pairs started the step from parameters that already differed (the op was noisy in an earlier step
    of one re-run): every rank reads a differing weight first. The pairs of side B's repeats, which started the
    step equal, show the op itself: equal inputs, different outputs on rank 1, rank 0 receiving it."""
    a = {1: [flaky_step(1, start="a0"), flaky_step(1, start="a1")],
         0: [flaky_step(0, start="a0"), flaky_step(0, start="a1")]}
    b = {1: [flaky_step(1, noise="b0"), flaky_step(1, noise="b1")],
         0: [ddp_step(0, reduced=("b0", "same")), ddp_step(0, reduced=("b1", "same"))]}
    got = locate(a, b, state_equal=True)
    assert got.origin is not None, got.sentence()
    assert (got.origin.kind, got.origin.rank, got.origin.op) == ("op", 1, "mylib.noisy_gelu.default"), \
        got.sentence()
    assert got.seen_in == "b"
    assert [(r.rank, r.op, r.via.collective, r.via.senders) for r in got.receivers] == \
        [(0, "c10d.allreduce_.default", "allreduce_", (1,))]
    assert "untraced" not in got.sentence() and "outside what the op trace sees" not in got.sentence()


def test_the_pairs_of_the_two_sides_still_come_first():
    """When the A/B pairs show an origin op, it is theirs, even if a side also varies at another op."""
    a, b = noisy_sides()
    got = locate(a, b)
    assert got.seen_in == "ab" and got.origin is not None and got.origin.repeats_differing == 2
    assert "2 of 2 repeat pairs" in got.sentence()


def test_untraced_evidence_alone_stays_untraced():
    a = {0: rep(2, lambda i: ddp_step(0, numpy=True, numpy_noise=("a", i), reduced=("a", i))),
         1: rep(2, lambda i: ddp_step(1, reduced=("a", i)))}
    b = {0: rep(2, lambda i: ddp_step(0, numpy=True, numpy_noise=("b", i), reduced=("b", i))),
         1: rep(2, lambda i: ddp_step(1, reduced=("b", i)))}
    got = locate(a, b, state_equal=True)
    assert got.origin is not None and (got.origin.kind, got.origin.rank) == ("untraced", 0)
    assert [r.rank for r in got.receivers] == [1]


# ------------------------------------------------------------------------------------------- sentences


def test_a_side_found_deterministic_is_never_said_to_vary_naturally():
    a, b = noisy_sides()
    plain = locate(a, b, names=("base", "changed")).sentence()
    assert "may be its natural variation" in plain  # the sides vary at the very op where they part
    told = locate(a, b, names=("base", "changed"), deterministic=("a",)).sentence()
    assert "natural variation" not in told, told
    assert "side base agreed bitwise in every run of the check" in told and "only some of the time" in told


def test_variation_elsewhere_is_not_offered_as_the_explanation():
    # The sides part at rank 0's custom op (changed on B); side A's repeats also vary, but in the loss only.
    def a_step(i: int) -> list[OpEvent]:
        events = ddp_step(0)
        return [replace(e, outputs=(fp("loss", i),)) if e.op == "aten.mse_loss.default" else e for e in events]

    got = locate({0: rep(2, a_step)}, {0: rep(2, lambda i: ddp_step(0, noise="changed"))})
    assert got.origin is not None and got.origin.op == "mylib.noisy_gelu.default"
    s = got.sentence()
    assert "differ among themselves" in s and "natural variation" not in s and "part elsewhere" in s, s


def test_logs_of_the_former_format_still_compare():
    """Op logs without arguments (written before they were recorded) compare as before."""
    a = [replace(e, arguments=()) for e in dropout_step(0.1)]
    b = [replace(e, arguments=()) for e in dropout_step(0.1, noise="other")]
    assert locate({0: [a]}, {0: [a]}).origin is None
    got = locate({0: [a]}, {0: [b]})
    assert got.origin is not None and got.origin.op == "aten.bernoulli_.float" and got.arguments == ()
