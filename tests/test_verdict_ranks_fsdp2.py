"""Verdicts on the language-model trainer of ``test_verdict_ranks_ddp`` sharded with FSDP2 (``fully_shard``) on
two ranks, where the reduce-scatter carries a rank's cause into every rank's gradient shard; and on one rank,
where the same script passes with two continuous runs compared."""

from __future__ import annotations

import pytest
from helpers.llm_job import checks, receiver_ranks, resume_check, verdict

pytestmark = pytest.mark.slow


def test_fsdp2_a_reseed_on_rank_1_is_rng_on_rank_1_and_rank_0_receives_it(tmp_path):
    report = resume_check(tmp_path, plant="rng", ranks="1", parallel="fsdp2")
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("rng", 1, "rng.torch_cpu"), v
    assert receiver_ranks(report) == [0]


def test_fsdp2_a_counter_held_on_rank_1_is_hidden_state_on_rank_1(tmp_path):
    report = resume_check(tmp_path, plant="held", ranks="1", parallel="fsdp2")
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("hidden-state", 1, "metric.loss"), v
    assert receiver_ranks(report) == [0]


def test_fsdp2_an_iterator_made_before_the_restore_on_every_rank_names_no_single_rank(tmp_path):
    report = resume_check(tmp_path, plant="data", ranks="all", parallel="fsdp2")
    v = verdict(report)
    assert (v["kind"], v["rank"]) == ("data", None), v
    assert receiver_ranks(report) == []


def test_one_rank_the_clean_job_passes_with_a_second_continuous_run(tmp_path):
    report = resume_check(tmp_path, nproc=1, runs="A,A2,B")
    v = verdict(report)
    assert v["kind"] == "pass", v
    assert "two continuous runs agree" in v["message"]
    assert "unregistered-state" not in checks(report)
