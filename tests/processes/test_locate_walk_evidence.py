"""The walk down the ladder, end to end, on a user's training job (``user_scripts/walk_evidence_train.py``: its
own Dataset augmented in DataLoader workers, dropout, AdamW, OneCycleLR, clipping, DDP on two ranks, a custom
activation kernel):

* ``compare`` of dropout 0.1 against 0.2: the change enters at ``bernoulli_``, whose tensors are equal and whose
  probability is not; the deterministic baseline is said to be so, and nothing varies within a side (the mask's
  uninitialised memory is never compared);
* a kernel that is flaky on rank 1 only, in a known pattern: the A/B re-runs already part in an earlier step
  (every rank then reads a differing weight first), while the repeats of one side show the kernel itself: it is
  the origin on rank 1, rank 0 receives it through the gradient all-reduce, and the kernel is re-run alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptverify.resume.locate.walk import Side, Walk, walk

SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "walk_evidence_train.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_compare_of_two_dropout_rates_names_the_probability_at_its_op(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("FLAKY_COUNTER", None)
    done = subprocess.run([sys.executable, "-m", "ckptverify", "compare", f"{SCRIPT}:train", f"{SCRIPT}:train_drop2",
                           "--steps", "2", "--locate-repeats", "2", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=1500)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-4000:]
    verdict = json.loads(done.stdout)["stats"]["verdict"]
    assert (done.returncode, verdict["kind"], verdict["step"]) == (1, "effect", 1), verdict
    origin, located = verdict["origin"], verdict["locate"]
    assert origin is not None, located
    assert (origin["kind"], origin["op"], origin["rank"], origin["phase"]) == \
        ("op", "aten.bernoulli_.float", 0, "forward"), located
    assert located["arguments"] == [{"name": "p", "a": "0.9", "b": "0.8"}], located
    sentence = f"{verdict['message']} {located['sentence']}"
    assert "aten.bernoulli_.float p: 0.9 vs 0.8" in sentence, sentence
    assert "the baseline is deterministic" in sentence, sentence
    # Nothing varies within a side (uninitialised memory is not compared), and no advice contradicts that.
    assert located["within_side"] == [], located
    for wrong in ("natural variation", "not deterministic", "outside what the op trace sees", "empty"):
        assert wrong not in sentence, sentence


def test_a_flaky_kernel_on_rank_1_under_ddp_is_the_origin_with_rank_0_receiving_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = tmp_path / "counter"
    monkeypatch.setenv("FLAKY_COUNTER", str(counter))
    sides = (Side(name="A", target=f"{SCRIPT}:train_flaky", total_steps=2),
             Side(name="A2", target=f"{SCRIPT}:train_flaky", total_steps=2))
    # Launched in turn: A-0, A2-0, A-1, A2-1 (flaky processes 0..3), then the capture on side A2 (4). Side A's
    # runs are noisy at step 1, side A2's at step 2 only.
    walked = walk(Walk(step=2, sides=sides, nproc=2, repeats=2, state_equal=True), str(tmp_path / "walk"))
    assert walked.status == "located", walked
    origin = walked.origin
    assert origin is not None, walked.sentence
    assert (origin["kind"], origin["rank"], origin["op"], origin["step"], origin["phase"]) == \
        ("op", 1, "walk_evidence.soft_gate.default", 2, "forward"), walked.sentence
    assert walked.extra["seen_in"] == "b", walked.extra
    receivers = [dict(r) for r in walked.receivers]
    assert [r["rank"] for r in receivers] == [0], walked.sentence
    assert "allreduce" in receivers[0]["via"]["collective"] and receivers[0]["via"]["senders"] == [1]
    assert "nondeterministic within side A2" in walked.sentence, walked.sentence
    assert "outside what the op trace sees" not in walked.sentence and "does not reproduce" not in walked.sentence
    # The last rung ran: the op's inputs captured on side A2 and the op re-run alone here (flaky process 5, noisy
    # on its second call: the two runs differ).
    kernel = walked.kernel
    assert kernel is not None and kernel.get("op") == "walk_evidence.soft_gate.default", kernel
    assert kernel["nondeterministic"] is True and kernel["mechanism"] == "none", kernel
    assert counter.stat().st_size == 6, "the flaky pattern did not run as planned"
    assert any(f.check == "kernel-nondeterministic" for f in walked.findings())
