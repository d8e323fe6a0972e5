"""``ckptverify compare BASE CHANGED``: a change judged against the baseline's own variation.

The training functions are in ``tests/user_scripts/ladder_train.py`` (a user-style job: its own Dataset with
augmentation in DataLoader workers, AdamW, OneCycleLR, clipping, dropout, an EMA). Each verdict is planted next to
what it must not be confused with: a function compared with itself is no effect (deterministic) or within
variation (nondeterministic); a one-op change is an effect; a changed learning rate on a noisy baseline is
beyond variation, while the baseline's own noise is not.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers.inproc_cli import Done, invoke

from ckptverify.errors import UsageError
from ckptverify.resume.change import ChangePlan

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "ladder_train.py"

#: Locating the op where a change enters needs the op level and its analysis.
needs_op_level = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("ckptverify.trace.ops", "ckptverify.resume.locate.ops")),
    reason="the op level and its analysis (ckptverify.trace.ops, .locate) are not in this tree")


def _cli(*args: str, cwd: Path) -> Done:
    # In this process (its runs from this process's fork server): the verdict, exit code and words are the point,
    # and with --json the runs' output goes to log files, not to this process's descriptors.
    return invoke(*args, cwd=cwd)


def _compare(base: str, changed: str, *extra: str, cwd: Path) -> tuple[int, dict]:
    done = _cli("compare", f"{SCRIPT}:{base}", f"{SCRIPT}:{changed}", "--steps", "2", "--json", *extra, cwd=cwd)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-4000:]
    return done.returncode, json.loads(done.stdout)


def test_same_function_is_no_effect(tmp_path: Path) -> None:
    code, report = _compare("train", "train", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert (code, verdict["kind"]) == (0, "no-effect"), verdict
    assert verdict["origin"] is None and verdict["locate"] is None  # nothing invented, nothing walked
    assert report["stats"]["sites_compared"] > 0 and report["stats"]["sites_varying"] == 0


def test_one_op_change_is_an_effect_without_walk(tmp_path: Path) -> None:
    code, report = _compare("train", "train_silu", "--no-locate", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert (code, verdict["kind"], verdict["step"]) == (1, "effect", 1), verdict
    assert verdict["locate"] is None and verdict["origin"] is None
    # The batch and the step's starting state are equal: what differs first is computed from them.
    assert not verdict["site"].startswith(("batch", "start.", "data.")), verdict
    assert any(f["check"] == "compare-site" for f in report["findings"])


def test_noisy_baseline_against_itself_is_within_variation(tmp_path: Path) -> None:
    code, report = _compare("train_noisy_op", "train_noisy_op", "--no-locate", "--repeats", "3", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert (code, verdict["kind"]) == (0, "within-variation"), verdict
    assert report["stats"]["sites_varying"] > 0 and report["stats"]["sites_beyond"] == 0
    assert any(f["check"] == "compare-variation" for f in report["findings"])


def test_changed_lr_on_noisy_baseline_is_beyond_variation(tmp_path: Path) -> None:
    code, report = _compare("train_noisy_op", "train_noisy_lr", "--no-locate", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert (code, verdict["kind"]) == (1, "beyond-variation"), verdict
    # The learning rate is equal in every baseline run and differs in the changed one: the first site beyond.
    assert "lr" in verdict["site"], verdict


def test_bad_targets_exit_2_without_traceback(tmp_path: Path) -> None:
    done = _cli("compare", str(tmp_path / "missing.py:train"), f"{SCRIPT}:train", "--steps", "2", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "missing.py" in done.stderr
    done = _cli("compare", "no-colon", f"{SCRIPT}:train", "--steps", "2", "--json", cwd=tmp_path)
    assert done.returncode == 2 and json.loads(done.stdout)["exit_code"] == 2


@pytest.mark.parametrize("field,value", [("steps", 0), ("repeats", 0), ("nproc", 0), ("locate_repeats", 0),
                                         ("level", "metrics"), ("level", "op")])
def test_plan_refuses_bad_numbers(field: str, value: object) -> None:
    kw = {"base": f"{SCRIPT}:train", "changed": f"{SCRIPT}:train", "steps": 2, field: value}
    with pytest.raises(UsageError):
        ChangePlan(**kw)  # type: ignore[arg-type]


@needs_op_level
def test_one_op_change_is_located_at_the_op_where_it_enters(tmp_path: Path) -> None:
    code, report = _compare("train", "train_silu", "--locate-repeats", "1", cwd=tmp_path)
    verdict = report["stats"]["verdict"]
    assert (code, verdict["kind"]) == (1, "effect"), verdict
    origin = verdict["origin"]
    assert origin is not None and origin["kind"] == "op", verdict["locate"]
    # GELU ran on one side, SiLU on the other, in the second block's forward: the change enters there.
    assert ("gelu" in origin["op"] or "silu" in origin["op"]) and origin["module"].endswith("blocks.1"), origin
    assert (origin["step"], origin["phase"]) == (1, "forward"), origin
    assert verdict["locate"]["one_side"] in ("a", "b"), verdict["locate"]
    assert verdict["receivers"] == []


def test_agreement_after_the_baseline_varies_is_undecided_not_beyond() -> None:
    from ckptverify.resume.change import _Cell

    since = (1, 0, 5)  # the baseline first varies at step 1, rank 0, the sixth site of the row
    before = _Cell(1, 0, "hparam.0.lr", 3, ("a", "a", "a"), "b")
    later_step = _Cell(2, 0, "param.fc.bias", 2, ("a", "a", "a"), "b")
    other_rank = _Cell(1, 1, "param.fc.bias", 2, ("a", "a", "a"), "b")
    later_site = _Cell(1, 0, "param.fc.bias", 9, ("a", "a", "a"), "b")
    assert before.beyond(since) and not before.undecided(since)
    for cell in (later_step, other_rank, later_site):
        assert not cell.beyond(since) and cell.undecided(since), cell
    # A deterministic baseline (nothing varies): any difference is beyond, none undecided.
    assert later_step.beyond(None) and not later_step.undecided(None)
    equal = _Cell(2, 0, "param.fc.bias", 2, ("a", "a", "a"), "a")
    assert not equal.beyond(since) and not equal.undecided(since)
    # A number: within the controls' range widened by three units, the unit at least the site's widest range.
    loss = _Cell(1, 0, "metric.loss", 0, (1.0, 1.0 + 1e-7, 1.0 + 2e-7), 1.0 + 1e-6)
    assert loss.beyond(since) and not loss.beyond(since, spread=1e-6)
    assert loss.beyond(since, spread=1e-7) and _Cell(1, 0, "metric.loss", 0, (1.0, 1.1), 5.0).beyond(since, 0.2)
