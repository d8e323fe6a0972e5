"""``load`` proves what it loads, in the read that loads it, and refuses (state untouched) what fails.

A stamped checkpoint changed in place with its times put back (``cp -p``, ``touch -r``, bits rotting on the
medium) keeps a *current* stamp: ``latest`` may pick it. Loading it must still catch it: the manifest's digest
of every item (or, without a manifest, every zip record's CRC-32) is checked on the bytes read for loading.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj
from helpers.multiproc import spawn_ranks
from test_load_atomic import assert_unchanged, build, snapshot

import ckptverify as cv
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.errors import CheckpointRefusedError, ProofFailedError
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.runs.latest import latest_verified
from ckptverify.runs.stamp import read_stamp, write_stamp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _keeping_times(ckpt: Path, flip: Any) -> Any:
    """Run ``flip`` (which changes bytes in place), then put every file's times back: the stamp stays current."""
    times = {p: os.stat(p) for p in ckpt.rglob("*") if p.is_file()}
    fault = flip()
    for p, st in times.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    return fault


def _stamped_run(run: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    for step in steps:
        state = build(step)
        state.counters.step = step
        cv.save(state, run / f"step_{step}", verify="inline")
        stamp = read_stamp(run / f"step_{step}")
        assert stamp is not None and stamp.current and stamp.passed


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
            and p.name != "ckptverify.verified.json"}


def test_a_byte_flipped_under_a_current_stamp_is_caught_while_loading_and_the_pick_moves_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _stamped_run(run)
    fault = _keeping_times(run / "step_2", lambda: inj.flip_in_tensor_payload(run / "step_2", "model.0.weight"))
    assert read_stamp(run / "step_2").current  # the stamp still vouches for it ...
    # ... so the stamp-trusting fast path (load's own pick, which proves bytes as it reads) picks it
    assert latest_verified(run, formats={"dcp"}, trust_stamps=True).path == str(run / "step_2")
    damaged = _tree(run / "step_2")

    target = build(5)
    report = cv.load(target, run, pick="latest-verified")
    # Caught while loading: the next older one is loaded instead, and the report says why.
    assert report.stats["picked"] == str(run / "step_1") and report.stats["step"] == 1
    assert target.counters.step == 1
    refused = report.stats["refused_at_load"]
    assert [(r["path"], r["step"], r["check"]) for r in refused] == [("step_2", 2, "manifest-digest")]
    assert fault.fqn in refused[0]["reason"]
    notes = [f for f in report.findings if f.check == "load-proof-failed"]
    assert len(notes) == 1 and "step_2" in notes[0].message
    assert not report.errors, report.errors
    # Its stamp is failed now (current, so trusted): no later pick takes it; its bytes are kept as they were.
    stamp = read_stamp(run / "step_2")
    assert stamp is not None and stamp.current and not stamp.passed
    again = latest_verified(run, formats={"dcp"})
    assert again.path == str(run / "step_1")
    assert [(s["path"], s["state"], s["how"]) for s in again.skipped] == [("step_2", "corrupt", "stamp")]
    assert _tree(run / "step_2") == damaged


def test_an_explicit_path_that_fails_its_proof_raises_and_changes_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _stamped_run(run, (1,))
    ckpt = run / "step_1"
    fault = _keeping_times(ckpt, lambda: inj.flip_in_tensor_payload(ckpt, "model.0.weight"))
    target = build(5)
    before = snapshot(target)
    rng_draw = torch.get_rng_state()
    # verify="off" skips the verification pass before loading, not the proof in the read that loads.
    with pytest.raises(ProofFailedError, match="manifest-digest") as exc:
        cv.load(target, ckpt, verify="off")
    assert exc.value.info["fqn"] == fault.fqn and exc.value.info["file"] == fault.file
    assert fault.byte_offset is not None
    lo, hi = exc.value.info["byte_range"]
    assert lo <= fault.byte_offset < hi
    assert_unchanged(before, snapshot(target))
    assert torch.equal(rng_draw, torch.get_rng_state())
    # The stamp that vouched for it is replaced by a failed one.
    assert not read_stamp(ckpt).passed and read_stamp(ckpt).current


def test_without_a_manifest_the_zip_crc_catches_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2):
        state = build(step)
        state.counters.step = step
        cv.save(state, run / f"step_{step}")
        os.remove(run / f"step_{step}" / MANIFEST_FILE)
        write_stamp(run / f"step_{step}", verify_checkpoint(str(run / f"step_{step}")), step=step)
        assert read_stamp(run / f"step_{step}").data["state"] == "intact"
    good = build(5)
    report = cv.load(good, run / "step_1", verify="off")  # the control: a clean one loads, proven by CRCs
    assert report.passed and report.stats["proof"] == "zip-crc" and report.stats["proven_items"] > 0
    _keeping_times(run / "step_2", lambda: inj.flip_in_tensor_payload(run / "step_2", "model.0.weight"))
    assert latest_verified(run, formats={"dcp"}, trust_stamps=True).path == str(run / "step_2")
    target = build(6)
    before = snapshot(target)
    with pytest.raises(ProofFailedError, match="zip-crc"):
        cv.load(target, run / "step_2", verify="off")
    assert_unchanged(before, snapshot(target))
    report = cv.load(target, run, pick="latest-verified")
    # The refused load stamped it failed (it had a stamp that vouched for it): the pick passes over it.
    assert report.stats["step"] == 1
    assert [(s["path"], s["how"]) for s in report.stats["skipped"]] == [("step_2", "stamp")]
    assert "zip-crc" in read_stamp(run / "step_2").data["errors"][0]["check"]


class Forgetful:
    """A user Stateful whose loader drops one of its two fields."""

    def __init__(self) -> None:
        self.value = 0
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "seen": self.seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]  # "seen" is dropped


def _with_forgetful(seed: int) -> cv.TrainState:
    state = build(seed)
    state.extras["extra"] = Forgetful()
    state.extras["extra"].value, state.extras["extra"].seen = seed, 10 * seed
    return state


def test_a_failed_restore_check_refuses_and_puts_everything_back(tmp_path: Path) -> None:
    cv.save(_with_forgetful(1), tmp_path / "ckpt")
    target = _with_forgetful(5)
    before = snapshot(target)
    with pytest.raises(CheckpointRefusedError, match=r"extras\.extra") as exc:
        cv.load(target, tmp_path / "ckpt")
    assert not isinstance(exc.value, ProofFailedError)  # the bytes were fine: the loader is what failed
    assert [f.location.fqn for f in exc.value.report.errors] == ["extras.extra"]
    # Everything was applied, then put back: parameters, optimizer, RNG, counters, scheduler, scaler, data, extra.
    assert_unchanged(before, snapshot(target))
    assert read_stamp(tmp_path / "ckpt") is None  # not the checkpoint's fault: nothing is stamped


def _job(run_dir: Path, steps: int) -> subprocess.CompletedProcess[str]:
    script = Path(__file__).resolve().parents[1] / "user_scripts" / "production_workload.py"
    return subprocess.run([sys.executable, str(script), "--run-dir", str(run_dir), "--steps", str(steps),
                           "--save-every", "2"], capture_output=True, text=True, timeout=600, env=dict(os.environ))


@pytest.mark.slow
def test_a_production_job_does_not_train_on_a_checkpoint_damaged_under_its_stamp(tmp_path: Path) -> None:
    from ckptverify.ownfiles.events import read_events

    run = tmp_path / "run"
    done = _job(run, 6)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_stamp(run / "step_6").passed
    _keeping_times(run / "step_6", lambda: inj.flip_in_tensor_payload(run / "step_6",
                                                                      "model.blocks.0.mlp.fc.weight"))
    damaged = _tree(run / "step_6")
    # The same start moves on: step_6 is refused as it is loaded, stamped failed and moved aside (kept as it
    # is), and the job resumes from step 4.
    done = _job(run, 8)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed its proof while loading" in done.stderr and "manifest-digest" in done.stderr
    assert [e["path"] for e in read_events(run, "checkpoint-refused-at-load")] == ["step_6"]
    assert not list(read_events(run, "resume-refused"))
    restore = next(read_events(run, "restore"))
    assert restore["step"] == 4 and restore["resumed_from"].endswith("step_4")
    moved = [p for p in (run / "quarantine").iterdir() if p.name.startswith("step_6.")]
    assert len(moved) == 1 and _tree(moved[0]) == damaged and not read_stamp(moved[0]).passed
    assert read_stamp(run / "step_6").passed and read_stamp(run / "step_8").passed


# ------------------------------------------------------------------ two ranks


def _ddp_state(seed: int) -> cv.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8),
                                                                          torch.nn.Linear(8, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return cv.TrainState(model=model, optimizer=opt, scheduler=sched)


def _live(state: cv.TrainState) -> dict[str, Any]:
    import copy

    return {"params": {k: v.detach().clone() for k, v in state.model.state_dict().items()},
            "optim": copy.deepcopy(state.optimizers[0].state_dict()), "rng": torch.get_rng_state(),
            "sched": copy.deepcopy(state.schedulers[0].state_dict()), "counters": state.counters.state_dict()}


def _two_rank_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from test_load_atomic import same

    out: dict[str, Any] = {}
    try:
        run = Path(root) / "run"
        for step in (1, 2):
            state = _ddp_state(step)
            state.counters.step = step
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cv.save(state, run / f"step_{step}", verify="inline")
        dist.barrier()
        if rank == 0:
            # An item only rank 1 reads (its own digests), damaged with the times put back.
            item = max((it for it in inj.items(run / "step_2") if it.fqn.startswith("digests.rank1.")),
                       key=lambda it: it.length)
            _keeping_times(run / "step_2", lambda: inj.flip_bit(run / "step_2", item.file,
                                                               item.offset + item.length // 2, 3))
            out["flipped"] = item.fqn
        dist.barrier()
        picking = _ddp_state(20 + rank)
        report = cv.load(picking, run, pick="latest-verified")
        out["picked"] = report.stats["step"]
        out["refused_at_load"] = [(r["path"], r["check"]) for r in report.stats.get("refused_at_load", [])]
        out["counters"] = picking.counters.step
        target = _ddp_state(10 + rank)
        before = _live(target)
        try:
            cv.load(target, run / "step_2", verify="off")
            out["explicit"] = "loaded"
        except ProofFailedError as exc:
            out["explicit"] = ("ProofFailedError", exc.info.get("check"), exc.info.get("fqn"), str(exc))
        out["unchanged"] = same(before, _live(target))
        dist.barrier()
    except BaseException as exc:  # reported to the parent, which fails the test with it
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.save(out, Path(root) / f"rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_refuse_a_damaged_checkpoint_alike_and_move_on_alike(tmp_path: Path) -> None:
    spawn_ranks(_two_rank_worker, 2, str(tmp_path))
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for out in outs:
        assert "error" not in out, out
        kind, check, fqn, message = out["explicit"]
        assert (kind, check) == ("ProofFailedError", "manifest-digest")
        assert fqn == outs[0]["flipped"] and "rank 1" in message  # rank 1 read it; rank 0 refuses as well
        assert out["unchanged"]
        assert out["picked"] == 1 and out["counters"] == 1
        assert out["refused_at_load"] == [("step_2", "manifest-digest")]
    assert not read_stamp(tmp_path / "run" / "step_2").passed
    shutil.rmtree(tmp_path / "run")
