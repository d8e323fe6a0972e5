"""Which rank a difference is born on, from each rank's first divergence (``job_divergence``), and how the
resume verdict names it: one origin by rank, several each on their own with no rank, none when every rank
differs only in values a collective wrote."""

from __future__ import annotations

from types import SimpleNamespace

from ckptverify.resume.compare import Evidence, SiteDiff, StepEvidence
from ckptverify.resume.verdict import decide
from ckptverify.trace.compare import FirstDivergence, job_divergence


def _div(rank: int, step: int, site: str, category: str, own: str | None) -> FirstDivergence:
    return FirstDivergence(step=step, rank=rank, site=site, category=category, kind=site.split(".")[0],
                           own_site=own)


def test_one_rank_alone_is_the_origin_whatever_it_differs_in():
    d = job_divergence([_div(1, 3, "grad.w", "gradients", None)])
    assert (d.rank, d.origin_ranks, d.receiver_ranks) == (1, (1,), ())


def test_a_rank_differing_only_after_the_reduction_receives_what_another_rank_started_from():
    d = job_divergence([_div(0, 3, "metric.grad_norm", "metric", None),
                        _div(1, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu")])
    assert (d.rank, d.site, d.origin_ranks, d.receiver_ranks) == (1, "start.rng.torch_cpu", (1,), (0,))


def test_the_same_cause_on_every_rank_makes_each_an_origin_and_no_receiver():
    d = job_divergence([_div(0, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu"),
                        _div(1, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu")])
    assert (d.origin_ranks, d.receiver_ranks) == ((0, 1), ())


def test_ranks_that_differ_only_downstream_of_a_collective_single_out_no_origin():
    d = job_divergence([_div(0, 3, "grad.w", "gradients", None), _div(1, 3, "grad.w", "gradients", None)])
    assert (d.origin_ranks, d.receiver_ranks) == ((), ())


def test_a_rank_that_differs_only_at_a_later_step_is_a_receiver():
    d = job_divergence([_div(2, 4, "param.w", "parameters", None), _div(1, 3, "batch.0", "data", "batch.0")])
    assert (d.rank, d.step, d.origin_ranks, d.receiver_ranks) == (1, 3, (1,), (2,))


PLAN = SimpleNamespace(resume_at=2, steps=4, runs=("A", "B"), nproc=2, level="state")


def _rng_evidence(div: FirstDivergence) -> Evidence:
    stream = SiteDiff("rng.torch_cpu", "a", "b", a_moved=False, b_moved=True)
    return Evidence(resume=div, resume_sites=frozenset({div.site}),
                    step=StepEvidence(rng=(stream,)))


def test_the_verdict_names_the_origin_rank_and_lists_the_receivers():
    d = job_divergence([_div(0, 3, "metric.grad_norm", "metric", None),
                        _div(1, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu")])
    v = decide(PLAN, _rng_evidence(d))
    assert (v.kind, v.rank) == ("rng", 1)
    assert [r["rank"] for r in v.to_dict()["receivers"]] == [0]
    assert v.to_dict()["receivers"][0]["via"]["senders"] == [1]
    assert "Rank 0 differs only in values a collective carried from rank 1" in v.message


def test_the_verdict_names_no_rank_when_every_rank_is_an_origin():
    d = job_divergence([_div(0, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu"),
                        _div(1, 3, "start.rng.torch_cpu", "rng", "start.rng.torch_cpu")])
    v = decide(PLAN, _rng_evidence(d))
    assert (v.kind, v.rank) == ("rng", None)
    assert "ranks 0, 1 (each on its own)" in v.message and v.to_dict()["receivers"] == []


def test_the_verdict_says_what_would_tell_when_no_rank_is_singled_out():
    d = job_divergence([_div(0, 3, "grad.w", "gradients", None), _div(1, 3, "grad.w", "gradients", None)])
    v = decide(PLAN, Evidence(resume=d, resume_sites=frozenset({"grad.w"}), step=StepEvidence()))
    assert (v.kind, v.rank) == ("hidden-state", None)
    assert "cannot be told from this trace; --level module" in v.message


def test_a_rank_own_loss_is_named_rather_than_the_gradient_norm_recorded_before_it():
    d = job_divergence([_div(0, 3, "metric.grad_norm", "metric", None),
                        _div(1, 3, "metric.grad_norm", "metric", "metric.loss")])
    v = decide(PLAN, Evidence(resume=d, resume_sites=frozenset({"metric.grad_norm"}),
                              step=StepEvidence()))
    assert (v.kind, v.rank, v.site) == ("hidden-state", 1, "metric.loss")


def test_a_restore_mismatch_on_every_rank_names_no_single_rank():
    from ckptverify.findings import Location, error

    restore = tuple(error("restore-mismatch", "x", location=Location(rank=r, fqn="data")) for r in (0, 1))
    v = decide(PLAN, Evidence(restore=restore))
    assert (v.kind, v.rank) == ("restore-mismatch", None)
    assert "ranks 0, 1, each on its own" in v.message
