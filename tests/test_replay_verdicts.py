"""`replay` names the cause of the first difference between production and two agreeing replays.

A replay whose inputs differ from production's (the batch, a random stream, a hyperparameter, the restored
state) says nothing about the hardware; hardware is suspected only when the inputs of a step are equal and a
computed value differs, and a rank is named only when the evidence singles it out. The jobs are the user
scripts in `tests/user_scripts/replay_*.py` (own Dataset, DataLoader with two workers and noise augmentation,
AdamW, OneCycleLR, gradient clipping, dropout, an EMA; DDP on two ranks), started as users start them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptverify.hardware.inject import BitFlip
from ckptverify.replay.causes import _origin
from ckptverify.replay.replay import VERDICTS, replay

SCRIPTS = Path(__file__).with_name("user_scripts")
TRAIN = SCRIPTS / "replay_train.py"
FAULT = BitFlip(kind="activation", name="fc1", step=5, rank=0, element=5, bit=20)


def _job(run_dir: Path, script: Path = TRAIN, *, nproc: int = 1, fault: BitFlip | None = None,
         trace: str | None = None) -> None:
    args = [str(script), "--run-dir", str(run_dir), "--steps", "6", "--save-every", "3"]
    if fault is not None:
        args += ["--fault", fault.to_json()]
    if trace is not None:
        args += ["--trace", trace]
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    done = subprocess.run(launcher + args, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, env: dict[str, str], **job: object) -> dict:
    """Run the production job and replay steps 4..6 from its checkpoint 3, both under ``env`` (the replays
    run the same code with the same settings)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    _job(run, **job)  # type: ignore[arg-type]
    # The function the run records, named as a user names it (a run directory is data).
    script = Path(job.get("script", TRAIN))  # type: ignore[arg-type]
    report = replay(run, target=f"{script.resolve()}:train", start=3, end=6)
    verdict = report.stats["verdict"]
    assert verdict["kind"] in VERDICTS
    assert report.exit_code == (0 if verdict["kind"] == "reproduced" else 1), verdict
    return verdict


def _not_hardware(verdict: dict) -> None:
    assert verdict["kind"] != "hardware-fault-suspected", verdict
    assert "suspect the hardware" not in verdict["sentence"]


# ------------------------------------------------------------------------------------ inputs, not hardware


@pytest.mark.slow
def test_worker_noise_of_a_dataset_defined_in_the_script_is_never_blamed_on_the_hardware(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _verdict(tmp_path, monkeypatch, env={}, script=SCRIPTS / "replay_noisy.py")
    _not_hardware(verdict)
    # Reproduced once the workers' augmentation resumes exactly; until then the batch is named as the cause.
    assert verdict["kind"] in ("data", "reproduced"), verdict
    if verdict["kind"] == "data":
        assert (verdict["step"], verdict["rank"]) == (4, 0) and verdict["site"].startswith("batch")
        assert "nothing about the hardware" in verdict["sentence"]


@pytest.mark.slow
def test_worker_noise_is_a_data_cause_at_the_first_replayed_step(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "worker"})
    _not_hardware(verdict)
    assert verdict["kind"] in ("data", "reproduced"), verdict
    if verdict["kind"] == "data":
        assert (verdict["step"], verdict["rank"], verdict["site"]) == (4, 0, "batch.0"), verdict
        # The loader's position is equal: the samples themselves differ, which points at the augmentation.
        assert "samples at the same position differ" in verdict["sentence"], verdict
        assert verdict["candidate_ranks"] is None


@pytest.mark.slow
def test_noise_no_seed_fixes_is_nondeterminism_of_the_data_pipeline(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "urandom"})
    _not_hardware(verdict)
    assert verdict["kind"] == "nondeterministic" and verdict["step"] == 4, verdict
    assert verdict["site"].startswith("batch") and "data pipeline" in verdict["sentence"], verdict


@pytest.mark.slow
def test_a_trace_without_inputs_cannot_tell_data_from_a_fault(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "worker"}, trace="metrics")
    _not_hardware(verdict)
    assert verdict["kind"] in ("undetermined", "reproduced"), verdict
    if verdict["kind"] == "undetermined":
        assert verdict["step"] == 4 and verdict["rank"] is None and verdict["candidate_ranks"] == [0]
        assert 'trace="state"' in verdict["sentence"]


# ------------------------------------------------------------------------------------ a real fault


@pytest.mark.slow
def test_a_flipped_activation_with_equal_inputs_is_a_suspected_fault_of_its_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index"}, fault=FAULT)
    assert verdict["kind"] == "hardware-fault-suspected", verdict
    assert (verdict["step"], verdict["rank"], verdict["candidate_ranks"]) == (5, 0, [0]), verdict
    assert verdict["site"].startswith("metric.") and verdict["host"], verdict
    assert "agreed" not in verdict["sentence"] and "other ranks" not in verdict["sentence"]  # a job of one rank


@pytest.mark.slow
@pytest.mark.parametrize(("plant", "kind", "step", "site"), [
    ("data", "data", 4, "batch.0"),                        # the loader is not in the TrainState
    ("rng", "rng", 4, "rng.torch_cpu"),                    # re-seeded after run.restore
    ("scheduler", "scheduler", 4, "metric.lr"),            # OneCycleLR not in the TrainState
    ("buffer", "hidden-state", 4, "buffer.calls"),         # a persistent=False buffer drives the forward
    ("restore", "restore-mismatch", 4, None),              # a load_state_dict that drops what it is given
])
def test_an_input_cause_before_a_real_fault_is_named_as_that_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str, kind: str, step: int, site: str) -> None:
    """The same fault as above is planted at step 5; the planted cause shows first and is what is named."""
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_PLANT": plant}, fault=FAULT)
    _not_hardware(verdict)
    assert (verdict["kind"], verdict["step"]) == (kind, step), verdict
    assert site is None or verdict["site"] == site, verdict
    assert "nothing about the hardware" in verdict["sentence"]


# ------------------------------------------------------------------------------------ DDP: which rank


@pytest.mark.slow
def test_ddp_a_fault_seen_in_a_rank_own_loss_names_that_rank(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fault = BitFlip(kind="activation", name="fc1", step=5, rank=1, element=5, bit=20)
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_LOSS": "local"}, nproc=2,
                       fault=fault)
    assert verdict["kind"] == "hardware-fault-suspected", verdict
    # Rank 0 differs too (the averaged gradients), first at metric.grad_norm; only rank 1's own loss differs.
    assert (verdict["step"], verdict["rank"], verdict["site"]) == (5, 1, "metric.loss"), verdict
    assert verdict["candidate_ranks"] == [1]


@pytest.mark.slow
def test_ddp_a_fault_seen_only_in_reduced_values_names_no_rank(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fault = BitFlip(kind="activation", name="fc1", step=5, rank=1, element=5, bit=20)
    verdict = _verdict(tmp_path, monkeypatch, env={"REPLAY_NOISE": "index", "REPLAY_LOSS": "reduced"}, nproc=2,
                       fault=fault)
    assert verdict["kind"] == "hardware-fault-suspected" and verdict["step"] == 5, verdict
    assert verdict["rank"] is None and verdict["host"] is None, verdict
    assert verdict["candidate_ranks"] == [0, 1], verdict
    assert "cannot tell which rank" in verdict["sentence"] and "level module" in verdict["sentence"]


# ------------------------------------------------------------------------------------ the rank rule


def test_the_origin_rank_is_named_only_when_the_evidence_singles_it_out() -> None:
    every = lambda rank, site: True  # noqa: E731
    # Only rank 1 differs: the others computed the step as the replay did.
    assert _origin({0: [], 1: ["grad.*"]}, 2, every) == ((1,), 1, None)
    # Every rank differs, but only rank 1's own loss does: the rest arrived through the all-reduce.
    assert _origin({0: ["metric.grad_norm", "grad.*"], 1: ["metric.grad_norm", "metric.loss", "grad.*"]}, 2,
                   every) == ((1,), 1, "metric.loss")
    # Every rank differs alike: no rank named, all are candidates.
    assert _origin({0: ["metric.loss", "grad.*"], 1: ["metric.loss", "grad.*"]}, 2, every) == ((0, 1), None, None)
    # A site the other rank does not record singles out nobody.
    only0 = lambda rank, site: not (rank == 1 and site == "metric.aux")  # noqa: E731
    assert _origin({0: ["metric.aux", "grad.*"], 1: ["grad.*"]}, 2, only0) == ((0, 1), None, None)
    # Two of four ranks differ: they are the candidates, neither is named.
    assert _origin({0: [], 1: ["grad.*"], 2: ["grad.*"], 3: []}, 4, every) == ((1, 2), None, None)
    # One rank: it is the one.
    assert _origin({0: ["metric.loss"]}, 1, every) == ((0,), 0, None)
    # A rank whose trace is missing cannot be cleared.
    assert _origin({0: ["grad.*"]}, 2, every) == ((0, 1), None, None)


def _metrics_run(run_dir: Path, losses: dict[int, dict[int, float]], world: int,
                 monkeypatch: pytest.MonkeyPatch) -> str:
    """A trace directory of ``world`` ranks at level metrics: ``losses[rank][step]`` (each rank's store written
    from this process, as that rank would)."""
    from ckptverify.trace import TraceHeader, TraceRecorder

    for rank in range(world):
        monkeypatch.setattr("ckptverify.trace.recorder.rank_world", lambda rank=rank: (rank, world))
        header = TraceHeader(run=run_dir.name, level="metrics", rank=rank, world_size=world)
        with TraceRecorder(run_dir, header=header) as rec:
            for step, loss in sorted(losses[rank].items()):
                rec.record_step(step, metrics={"loss": loss})
    return str(run_dir)


def test_without_recorded_inputs_a_difference_names_no_cause_and_no_rank(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.replay.causes import judge

    prod = _metrics_run(tmp_path / "prod", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.5}}, 2, monkeypatch)
    rep = _metrics_run(tmp_path / "rep", {0: {4: 1.0, 5: 2.0}, 1: {4: 1.5, 5: 2.25}}, 2, monkeypatch)
    j = judge(prod, rep, start=3, end=5, world=2, production_start=0)
    # Only rank 1's loss differs, but the inputs of step 5 are not recorded: no hardware verdict.
    assert (j.kind, j.step, j.rank, j.candidate_ranks) == ("undetermined", 5, None, (1,)), j
    assert 'trace="state"' in j.sentence
    # Steps recorded in one run only, all common steps equal: undetermined, not an error.
    short = _metrics_run(tmp_path / "short", {0: {4: 1.0}, 1: {4: 1.5}}, 2, monkeypatch)
    j = judge(prod, short, start=3, end=5, world=2, production_start=0)
    assert j.kind == "undetermined" and j.rank is None and "cannot be judged" in j.sentence, j
