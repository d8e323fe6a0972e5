"""TrainState: save at step K, load in a fresh process, and everything that comes next is bitwise equal."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import train_state_worker as worker
from helpers.multiproc import spawn_ranks

import ckptverify
from ckptverify.errors import CheckpointRefusedError, CkptVerifyWarning
from ckptverify.resume.launch import start_method


def _launch(world: int, mode: str, ckpt: Path, out: Path, *, steps: int = 3, loader: str = "sampler",
            workers: int = 0, allow_reseed: bool = False) -> list[dict[str, Any]]:
    out.mkdir(exist_ok=True)
    args = (mode, str(ckpt), str(out), steps, loader, workers, allow_reseed)
    if world == 1:
        # A fresh process, like a restarted job: forked from the fork server resume-check starts its ranks from
        # (it imported torch once and holds no training state), not from this process or the one that saved.
        ctx = mp.get_context(start_method())
        p = ctx.Process(target=worker.run, args=(0, 1, *args))
        p.start()
        p.join()
        assert p.exitcode == 0
    else:
        spawn_ranks(worker.run, world, *args)
    return [torch.load(out / f"{mode}-rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two_rank_save(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """A checkpoint saved by two FSDP2 ranks (read, never changed, by the tests that load it) and what they saw
    next."""
    root = tmp_path_factory.mktemp("two-rank-save")
    return root / "ckpt", _launch(2, "save", root / "ckpt", root / "out")


@pytest.fixture(scope="module")
def one_process_saves(tmp_path_factory):
    """``saves(loader, workers)``: a checkpoint saved by one process with that loader (each saved once) and what
    the process saw next. Tests that change the checkpoint change a copy."""
    cache: dict[tuple[str, int], tuple[Path, dict[str, Any]]] = {}

    def saves(loader: str, workers: int) -> tuple[Path, dict[str, Any]]:
        if (loader, workers) not in cache:
            root = tmp_path_factory.mktemp(f"save-{loader}-{workers}")
            cache[loader, workers] = (root / "ckpt", _launch(1, "save", root / "ckpt", root / "out", loader=loader,
                                                              workers=workers)[0])
        return cache[loader, workers]

    return saves


def _assert_same(saved: dict[str, Any], loaded: dict[str, Any]) -> None:
    assert "error" not in loaded, loaded
    report = loaded["report"]
    assert report["passed"], report["findings"]
    assert loaded["digests"] == saved["digests"]  # scheduler, scaler, counters, RNG kinds, data position
    assert loaded["tensors"] == saved["tensors"]  # parameters and optimizer state, bitwise
    for kind, value in saved["draws"].items():
        got = loaded["draws"][kind]
        assert (torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value), kind
    for a, b in zip(saved["batches"], loaded["batches"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("loader", "workers"), [("sampler", 0), ("sampler", 2), ("stateful", 0), ("stateful", 2)])
def test_one_process_resume_is_bitwise_exact(tmp_path, one_process_saves, loader, workers):
    ckpt, saved = one_process_saves(loader, workers)
    loaded = _launch(1, "load", ckpt, tmp_path / "out", loader=loader, workers=workers)
    _assert_same(saved, loaded[0])
    # Every kind of RNG is covered by the digests that matched.
    assert {"rng.python", "rng.numpy", "rng.torch_cpu", "rng.gen.aux", "scheduler.0", "scaler", "counters",
            "data"} <= set(saved["digests"])


def test_two_rank_fsdp2_resume_is_bitwise_exact_and_keeps_each_ranks_state(tmp_path, two_rank_save):
    ckpt, saved = two_rank_save
    loaded = _launch(2, "load", ckpt, tmp_path / "out")
    for r in range(2):
        _assert_same(saved[r], loaded[r])
    # The ranks' RNG streams and data positions differ, and each rank got its own back (no DCP dedup).
    assert saved[0]["digests"]["rng.torch_cpu"] != saved[1]["digests"]["rng.torch_cpu"]
    assert not torch.equal(saved[0]["batches"][0][0], saved[1]["batches"][0][0])


def test_wrong_world_size_is_refused_unless_reseeding_is_allowed(tmp_path, two_rank_save):
    ckpt, _ = two_rank_save
    refused = _launch(1, "load", ckpt, tmp_path / "out1")[0]
    assert refused["error"] == "UsageError"
    assert "2" in refused["message"] and "1" in refused["message"]
    reseeded = _launch(1, "load", ckpt, tmp_path / "out2", allow_reseed=True)[0]
    assert "error" not in reseeded, reseeded
    assert reseeded["report"]["passed"]
    warnings = [f for f in reseeded["report"]["findings"] if f["check"] == "restore-inexact"]
    assert warnings and "world size changed" in warnings[0]["message"]


def test_corrupt_checkpoint_is_refused_with_the_reason(tmp_path, one_process_saves):
    from helpers import faults as inj

    shutil.copytree(one_process_saves("sampler", 0)[0], tmp_path / "ckpt")  # the shared one stays intact
    fault = inj.flip_in_tensor_payload(tmp_path / "ckpt")
    loaded = _launch(1, "load", tmp_path / "ckpt", tmp_path / "out")[0]
    assert loaded["error"] == "CheckpointRefusedError"
    assert fault.fqn in loaded["message"]


def test_restore_check_reports_state_a_loader_ignores(tmp_path):
    class ForgetfulScheduler(torch.optim.lr_scheduler.StepLR):
        def load_state_dict(self, state_dict: dict) -> None:  # silently keeps its fresh state
            pass

    def build() -> ckptverify.TrainState:
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return ckptverify.TrainState(model=model, optimizer=opt, scheduler=ForgetfulScheduler(opt, step_size=1))

    state = build()
    for _ in range(3):
        state.optimizers[0].step()
        state.schedulers[0].step()
    ckptverify.save(state, tmp_path / "ckpt")
    # By default a failed restore check refuses the load; the report it carries names the field.
    with pytest.raises(CheckpointRefusedError, match=r"scheduler\.0") as refused:
        ckptverify.load(build(), tmp_path / "ckpt")
    hits = [f for f in refused.value.report.errors if f.check == "restore-mismatch"]
    assert [f.location.fqn for f in hits] == ["scheduler.0"]
    # For diagnosis (the resume harness), the state stays as loaded and the difference is reported and warned of.
    with pytest.warns(CkptVerifyWarning, match=r"restore check .* failed .*scheduler\.0"):
        report = ckptverify.load(build(), tmp_path / "ckpt", on_restore_mismatch="warn")
    hits = [f for f in report.errors if f.check == "restore-mismatch"]
    assert [f.location.fqn for f in hits] == ["scheduler.0"]


def test_load_refuses_a_missing_path_and_a_non_trainstate(tmp_path):
    from ckptverify.errors import CheckpointNotFoundError, UsageError

    with pytest.raises(CheckpointNotFoundError):
        ckptverify.load(ckptverify.TrainState(), tmp_path / "missing")
    with pytest.raises(UsageError):
        ckptverify.load({"a": 1}, tmp_path)  # type: ignore[arg-type]
    assert issubclass(CheckpointRefusedError, ckptverify.errors.CkptVerifyError)
    assert os.path.isdir(tmp_path)
