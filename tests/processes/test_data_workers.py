"""Randomness in DataLoader workers is state: a resumed run draws the same augmentation, and a `data` verdict
says whether other samples were drawn or the same samples came out different."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ckptverify.resume.harness import Plan, resume_check_many
from ckptverify.state.dataloader import WorkerSeeding, check_loader, loader_state, restore_loader
from ckptverify.state.sampler import ResumableSampler

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning",
                                        "ignore:This DataLoader will create:UserWarning")

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
SCRIPT = SCRIPTS / "data_augment_train.py"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

from data_noisy_images import NoisyImages  # noqa: E402

N, BATCH = 32, 4  # 8 batches an epoch


class _IntsOnly(NoisyImages):
    """Fails a fetch whose index is not a plain int (the dataset must never see the sampler's tags)."""

    def __getitem__(self, i: Any) -> Any:
        assert type(i) is int, type(i)
        return super().__getitem__(i)


def _loader(*, workers: int = 2, persistent: bool = False, reseed: bool = True, register: bool = True,
            init_fn: Any = None, cls: Any = DataLoader) -> tuple[Any, ResumableSampler]:
    sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=3, reseed_workers=reseed)
    kwargs: dict[str, Any] = {"persistent_workers": persistent} if workers else {}
    loader = cls(_IntsOnly(n=N), batch_size=BATCH, sampler=sampler, num_workers=workers, worker_init_fn=init_fn,
                 **kwargs)
    if register:
        check_loader(loader)  # what TrainState(dataloader=loader) does
    return loader, sampler


def _continuous(epochs: int = 2, save_after: int = 3, **kw: Any) -> tuple[list[Any], dict[str, Any], Any]:
    """Every batch of ``epochs`` epochs, and the loader state and main random stream after ``save_after``."""
    torch.manual_seed(0)
    loader, sampler = _loader(**kw)
    out: list[Any] = []
    saved: Any = None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in sampler.track(loader):
            out.append(batch)
            if len(out) == save_after:
                saved = (loader_state(loader), torch.get_rng_state())
    return out, saved[0], saved[1]


def _resumed(state: dict[str, Any], rng: Any, epochs: int = 2, **kw: Any) -> list[Any]:
    """A fresh process's view: another seed, the loader restored, then the main stream (as run.steps does:
    the iterator's base-seed draw must not move the restored stream)."""
    torch.manual_seed(1234)
    loader, sampler = _loader(**kw)
    restore_loader(loader, state)
    out: list[Any] = []
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        if epoch == state["state"]["epoch"]:
            torch.set_rng_state(rng)
        out.extend(sampler.track(it, batch_size=BATCH))
    return out


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_noise_resumes_exactly_mid_epoch_and_into_the_next_epoch(persistent: bool) -> None:
    full, state, rng = _continuous(persistent=persistent)
    assert isinstance(state["state"]["worker_seed"], int)
    rest = _resumed(state, rng, persistent=persistent)
    assert len(rest) == len(full) - 3 == 13
    assert _same(full[3:], rest)
    # Another worker count (and so another assignment of batches to workers) draws the same noise.
    assert _same(full[3:], _resumed(state, rng, persistent=persistent, workers=3))


def test_without_per_batch_seeding_the_same_indices_give_other_noise() -> None:
    full, state, rng = _continuous(reseed=False)
    assert state["state"]["worker_seed"] is None
    rest = _resumed(state, rng, reseed=False)
    assert all(torch.equal(x[1], y[1]) for x, y in zip(full[3:], rest, strict=True))  # the same samples (labels)...
    assert not torch.equal(full[3][0], rest[0][0])  # ...with other noise


def test_the_noise_is_random_from_batch_to_batch_and_follows_the_seed() -> None:
    full, _, _ = _continuous()
    clean = NoisyImages(n=N).images
    sampler = ResumableSampler(N, num_replicas=1, rank=0, seed=3)
    order = [*sampler.epoch_indices()]
    noise = [b[0][k] - clean[order[j * BATCH + k]] for j, b in enumerate(full[:8]) for k in range(BATCH)]
    assert len({round(float(n.abs().sum()), 4) for n in noise}) == len(noise)  # no two samples share noise
    # Another torch seed (the base seed is torch's draw) gives other noise for the same samples.
    torch.manual_seed(99)
    loader, sampler = _loader()
    other = list(sampler.track(loader))
    assert torch.equal(other[0][1], full[0][1]) and not torch.equal(other[0][0], full[0][0])


def test_the_users_worker_init_fn_still_runs_first() -> None:
    calls = torch.multiprocessing.get_context("fork").Queue()

    def init_fn(worker_id: int) -> None:
        calls.put(worker_id)
        np.random.seed(12345)  # replaced per batch by the re-seeding
        random.seed(12345)

    torch.manual_seed(0)
    loader, sampler = _loader(init_fn=init_fn)
    assert isinstance(loader.worker_init_fn, WorkerSeeding) and loader.worker_init_fn.user_fn is init_fn
    batches = list(sampler.track(loader))
    assert sorted(calls.get(timeout=30) for _ in range(2)) == [0, 1]
    # What init_fn seeded is replaced per batch: the batches are those of a loader without it.
    torch.manual_seed(0)
    plain, plain_sampler = _loader()
    assert _same(batches, list(plain_sampler.track(plain)))
    check_loader(loader)  # registering again does not wrap twice
    assert loader.worker_init_fn.user_fn is init_fn


def test_no_workers_no_seeding_and_the_main_stream_drives_the_noise() -> None:
    loader, sampler = _loader(workers=0)
    assert loader.worker_init_fn is None and not sampler._tag
    assert all(type(i) is int for i in sampler)


def test_a_state_saved_before_worker_seeds_existed_still_loads() -> None:
    _, state, _ = _continuous()
    old = {"kind": state["kind"], "state": {k: v for k, v in state["state"].items() if k != "worker_seed"}}
    loader, sampler = _loader()
    restore_loader(loader, old)
    assert sampler.position == 12 and sampler.state_dict()["worker_seed"] is None


def test_stateful_dataloader_with_a_resumable_sampler_resumes_the_noise_too() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def run(first: int, state: Any = None) -> tuple[list[Any], Any]:
        loader, _ = _loader(cls=sdl.StatefulDataLoader)
        if state is not None:
            loader.load_state_dict(state)
        it, out, saved = iter(loader), [], None
        for batch in it:
            out.append(batch)
            if len(out) == first:
                saved = loader.state_dict()
        return out, saved

    torch.manual_seed(0)
    full, state = run(3)
    torch.manual_seed(5)
    rest, _ = run(-1, state)
    assert _same(full[3:], rest)


# ------------------------------------------------------------------------------------------- resume-check

#: Each check below is a resume check of its own (its own runs, checkpoints and verdict); those of one rank count
#: share one launch per run (resume_check_many), checked once for the module.
CHECKS: dict[str, tuple[str, dict[str, Any]]] = {
    # 24 samples, batches of 4: 6 an epoch. Resumed after step 4 (mid-epoch 0), B runs into epoch 1.
    "train-1": ("train", {"runs": ("A", "A2", "B")}),
    # 12 samples a rank: 3 batches an epoch; resumed after step 4 (epoch 1, batch 2 of 3), into epoch 2.
    "train-2": ("train", {"steps": 7, "nproc": 2}),
    "train_unregistered_loader-1": ("train_unregistered_loader", {"steps": 6}),
    "train_unregistered_loader-2": ("train_unregistered_loader", {"steps": 6, "nproc": 2}),
    "train_per_worker_rng-1": ("train_per_worker_rng", {"steps": 6, "runs": ("A", "A2", "B")}),
    "train_urandom_noise-1": ("train_urandom_noise", {"steps": 6}),
    "train_fetch_ahead-1": ("train_fetch_ahead", {"steps": 7}),
    "train_reseeded-1": ("train_reseeded", {"steps": 6}),
    "train_unsaved_scheduler-1": ("train_unsaved_scheduler", {"steps": 6}),
}


def _plan(func: str, *, steps: int = 9, resume_at: int = 4, nproc: int = 1,
          runs: tuple[str, ...] = ("A", "B")) -> Plan:
    return Plan(target=f"{SCRIPT}:{func}", steps=steps, resume_at=resume_at, nproc=nproc, runs=runs)


@pytest.fixture(scope="module")
def verdicts() -> dict[str, Any]:
    plans = {key: _plan(func, **kw) for key, (func, kw) in CHECKS.items()}
    out: dict[str, Any] = {}
    for nproc in sorted({plan.nproc for plan in plans.values()}):
        keys = [key for key, plan in plans.items() if plan.nproc == nproc]
        out.update(zip(keys, (o.verdict for o in resume_check_many([plans[k] for k in keys])), strict=True))
    return out


def test_worker_augmentation_job_resumes_bitwise_mid_epoch(verdicts) -> None:
    verdict = verdicts["train-1"]
    assert verdict.kind == "pass", verdict.headline()


def test_worker_augmentation_job_resumes_bitwise_on_two_ranks(verdicts) -> None:
    verdict = verdicts["train-2"]
    assert verdict.kind == "pass", verdict.headline()


@pytest.mark.parametrize("nproc", [1, 2])
def test_an_unregistered_loader_is_data_with_advice_to_register_it(verdicts, nproc: int) -> None:
    verdict = verdicts[f"train_unregistered_loader-{nproc}"]
    assert verdict.kind == "data" and verdict.step == 5, verdict.headline()
    assert verdict.site == "data.indices"
    assert "other samples" in verdict.message and "not registered" in verdict.message
    assert "register the loader: TrainState(dataloader=...)" in verdict.advice


@pytest.mark.parametrize("func", ["train_per_worker_rng", "train_urandom_noise"])
def test_dataset_randomness_that_cannot_be_reproduced_is_data_naming_the_dataset(verdicts, func: str) -> None:
    verdict = verdicts[f"{func}-1"]
    assert verdict.kind == "data" and verdict.step == 5, verdict.headline()
    assert "same sample indices" in verdict.message and "Dataset" in verdict.message
    assert "register the loader" not in verdict.advice
    assert "__getitem__" in verdict.advice


def test_a_batch_taken_before_the_save_is_data_naming_the_fetch_ahead(verdicts) -> None:
    verdict = verdicts["train_fetch_ahead-1"]
    assert verdict.kind == "data" and verdict.step == 5, verdict.headline()
    assert "before its save point" in verdict.message
    assert "register the loader" not in verdict.advice


def test_a_reseeded_generator_is_rng_not_data(verdicts) -> None:
    verdict = verdicts["train_reseeded-1"]
    assert verdict.kind == "rng", verdict.headline()


def test_an_unsaved_scheduler_is_scheduler_not_data(verdicts) -> None:
    verdict = verdicts["train_unsaved_scheduler-1"]
    assert verdict.kind == "scheduler", verdict.headline()
