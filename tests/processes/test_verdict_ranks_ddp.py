"""Verdicts on a language-model trainer's job on two DDP ranks name the rank where the difference is born.

The trainer (``tests/user_scripts/llm_stream_train.py``) is written as such jobs are: a small GPT on an endless
token stream (an ``IterableDataset`` whose position is its state) read through torchdata's ``StatefulDataLoader``
with two workers, four micro-batches per optimizer step under DDP ``no_sync``, bf16 autocast, AdamW with a
warmup-cosine LambdaLR, clipping and dropout. Each cause is planted on rank 1 only, next to the same cause on
every rank: under DDP rank 0's gradients, parameters and gradient norm differ too (the all-reduce carried rank
1's values), so rank 0 is a receiver, never the verdict's rank; with the cause on every rank, no one rank is
named.

Every job below is a resume check of its own (its own runs, checkpoints and verdict); they are checked together,
sharing one launch per run (see ``helpers.llm_job``).
"""

from __future__ import annotations

import pytest
from helpers.llm_job import Job, checks, receiver_ranks, resume_checks, verdict

pytestmark = pytest.mark.slow

JOBS = {
    "clean": Job(),
    "rng-1": Job("rng", "1"),
    "rng-all": Job("rng", "all"),
    "data-1": Job("data", "1"),
    "scheduler-1": Job("scheduler", "1"),
    "replaced-loader-1": Job("replaced-loader", "1"),
    "held-1": Job("held", "1"),
    "held-all": Job("held", "all"),
    "restore-1": Job("restore", "1"),
    "restore-all": Job("restore", "all"),
    # The optimizer steps every 4 micro-batches (steps 4 and 8); step 6's checkpoint falls between them.
    "accum": Job("accum", steps=8, resume_at=6),
    "noisy-1": Job("noisy", "1", runs="A,A2"),
}


@pytest.fixture(scope="module")
def reports():
    return resume_checks(JOBS)


def test_a_clean_job_passes_and_the_loaders_own_dataset_is_not_called_unregistered(reports):
    report = reports["clean"]
    v = verdict(report)
    assert v["kind"] == "pass", v
    assert "unregistered-state" not in checks(report), report["findings"]
    assert "Not in the TrainState" not in v["message"]


@pytest.mark.parametrize(("ranks", "rank", "receivers"), [("1", 1, [0]), ("all", None, [])])
def test_a_reseed_after_restore_is_rng_on_the_rank_that_reseeded(reports, ranks, rank, receivers):
    report = reports[f"rng-{ranks}"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"], v["step"]) == ("rng", rank, "rng.torch_cpu", 3), v
    assert receiver_ranks(report) == receivers
    if rank == 1:
        assert "Rank 0 differs only in values a collective carried from rank 1" in v["message"]
    else:
        assert "ranks 0, 1 (each on its own)" in v["message"]
    assert "unregistered" not in v["message"].lower()


def test_an_iterator_made_before_the_restore_is_data_on_that_rank_with_advice_for_an_iterable_dataset(reports):
    report = reports["data-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["step"]) == ("data", 1, 3), v
    assert v["site"].startswith("batch")
    assert receiver_ranks(report) == [0]
    # A sampler cannot drive an IterableDataset: the advice is about the loader the user has.
    assert "ResumableSampler" not in v["advice"]
    assert "make no iterator of it before run.restore(state)" in v["advice"]
    assert "IterableDataset" in v["message"]


def test_a_scheduler_rebuilt_after_restore_is_named_with_its_variable(reports):
    report = reports["scheduler-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("changed-after-restore", 1, "sched"), v
    assert "the LambdaLR the loop uses is not the one in the TrainState: sched was rebuilt after run.restore()" \
        in v["message"]
    assert receiver_ranks(report) == [0]
    assert "replaced-after-restore" in checks(report, "warning")


def test_a_loader_rebuilt_after_restore_is_named_not_called_an_unrestored_position(reports):
    report = reports["replaced-loader-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"], v["category"]) == ("changed-after-restore", 1, "loader",
                                                                 "dataloader"), v
    assert "StatefulDataLoader the loop uses is not the one in the TrainState" in v["message"]


@pytest.mark.parametrize(("ranks", "rank", "receivers"), [("1", 1, [0]), ("all", None, [])])
def test_a_counter_held_outside_the_train_state_is_hidden_state_on_its_rank(reports, ranks, rank, receivers):
    report = reports[f"held-{ranks}"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["step"]) == ("hidden-state", rank, 3), v
    # The rank's own value (its loss), not the gradient norm computed after the all-reduce.
    assert v["site"] == "metric.loss"
    assert receiver_ranks(report) == receivers


@pytest.mark.parametrize(("ranks", "rank"), [("1", 1), ("all", None)])
def test_a_dataset_that_drops_its_position_on_load_is_a_restore_mismatch_of_its_rank(reports, ranks, rank):
    report = reports[f"restore-{ranks}"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["site"]) == ("restore-mismatch", rank, "data"), v


def test_a_save_between_micro_batches_is_named_accumulated_gradients(reports):
    report = reports["accum"]
    v = verdict(report)
    assert (v["kind"], v["category"], v["step"]) == ("accumulated-gradients", "gradients", 7), v
    assert "held accumulated gradients (tok.weight" in v["message"]
    assert "run.steps(loader, micro_batches=K)" in v["advice"]


def test_a_computation_nondeterministic_on_rank_1_is_named_on_rank_1_with_rank_0_receiving(reports):
    report = reports["noisy-1"]
    v = verdict(report)
    assert (v["kind"], v["rank"], v["step"]) == ("nondeterministic", 1, 1), v
    assert v["site"] == "metric.loss"
    assert receiver_ranks(report) == [0]
