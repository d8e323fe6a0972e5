"""Verdicts on the language-model trainer of ``test_verdict_ranks_ddp`` sharded with FSDP2 (``fully_shard``) on
two ranks, where the reduce-scatter carries a rank's cause into every rank's gradient shard; and on one rank,
where the same script passes with two continuous runs compared.

Every job below is a resume check of its own; those of one rank count share one launch per run (see
``helpers.llm_job``)."""

from __future__ import annotations

import pytest
from helpers.llm_job import Job, checks, receiver_ranks, resume_checks, verdict

pytestmark = pytest.mark.slow

JOBS = {
    "rng-1": Job("rng", "1", parallel="fsdp2"),
    "held-1": Job("held", "1", parallel="fsdp2"),
    "data-all": Job("data", "all", parallel="fsdp2"),
    "one-rank-clean": Job(nproc=1, runs="A,A2,B"),
}


@pytest.fixture(scope="module")
def reports():
    return resume_checks(JOBS)


def test_fsdp2_a_reseed_on_rank_1_is_rng_on_rank_1_and_rank_0_receives_it(reports):
    report = reports["rng-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("rng", 1, "rng.torch_cpu"), v
    assert receiver_ranks(report) == [0]


def test_fsdp2_a_counter_held_on_rank_1_is_hidden_state_on_rank_1(reports):
    report = reports["held-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("hidden-state", 1, "metric.loss"), v
    assert receiver_ranks(report) == [0]


def test_fsdp2_an_iterator_made_before_the_restore_on_every_rank_names_no_single_rank(reports):
    report = reports["data-all"]
    v = verdict(report)
    assert (v["kind"], v["rank"]) == ("data", None), v
    assert receiver_ranks(report) == []


def test_one_rank_the_clean_job_passes_with_a_second_continuous_run(reports):
    report = reports["one-rank-clean"]
    v = verdict(report)
    assert v["kind"] == "pass", v
    assert "two continuous runs agree" in v["message"]
    assert "unregistered-state" not in checks(report)
