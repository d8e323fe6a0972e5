"""The built-in workload: synthetic corpus, tiny GPT, its schedule, and bitwise run-to-run determinism."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.multiproc import spawn_ranks

from ckptverify.examples import (
    TinyGPT,
    TinyGPTConfig,
    TokenDataset,
    WarmupCosine,
    build_training,
    make_loader,
    train_step,
)

# --------------------------------------------------------------------------------------------- corpus


def test_corpus_is_pinned_and_well_formed() -> None:
    a = TokenDataset(64, 32, seed=0)
    b = TokenDataset(64, 32, seed=0)
    assert torch.equal(a.tokens, b.tokens)
    # Pinned: the corpus must not change with the torch/numpy version, the platform or the thread count.
    digest = hashlib.sha256(a.tokens.numpy().astype("<i8").tobytes()).hexdigest()
    assert digest == PINNED_CORPUS_SHA256
    assert len(a) == 64
    x, y = a[3]
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(a[-1][0], a[63][0])
    with pytest.raises(IndexError):
        a[64]
    assert int(a.tokens.min()) >= 0 and int(a.tokens.max()) < 256
    assert not torch.equal(TokenDataset(64, 32, seed=1).tokens, a.tokens)
    # A prefix of the corpus does not depend on how many sequences are generated.
    assert torch.equal(TokenDataset(8, 32, seed=0).tokens, a.tokens[:8])


PINNED_CORPUS_SHA256 = "aed0e4198d01734a1796663e30aeaf0666f0ad9c5b830c3d15ea94df64089217"


# ---------------------------------------------------------------------------------------------- model


def test_model_is_causal_and_init_is_seeded() -> None:
    state = torch.get_rng_state()
    m1, m2 = TinyGPT(TinyGPTConfig(), seed=3), TinyGPT(TinyGPTConfig(), seed=3)
    assert torch.equal(torch.get_rng_state(), state), "building a model must not consume the global RNG"
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert not torch.equal(TinyGPT(TinyGPTConfig(), seed=4).head.weight, m1.head.weight)

    m1.eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        out, out2 = m1(ids), m1(changed)
    assert out.shape == (2, 32, 256)
    assert torch.equal(out[:, :20], out2[:, :20]), "a later token changed an earlier position's logits"
    assert not torch.equal(out[:, 20:], out2[:, 20:])


def test_dropout_is_active_in_train_mode_only() -> None:
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    model = TinyGPT(TinyGPTConfig(dropout=0.1))
    with torch.no_grad():
        model.train()
        state = torch.get_rng_state()
        assert not torch.equal(model(ids), model(ids))
        assert not torch.equal(torch.get_rng_state(), state), "dropout draws from the global RNG"
        model.eval()
        assert torch.equal(model(ids), model(ids))
        plain = TinyGPT(TinyGPTConfig(dropout=0.0)).train()
        assert torch.equal(plain(ids), plain(ids))


# ------------------------------------------------------------------------------------------- schedule


def test_lr_schedule_is_warmup_then_cosine() -> None:
    lr, warmup, total = 3e-3, 5, 100
    training = build_training(TinyGPTConfig(), lr=lr, warmup_steps=warmup, total_steps=total, num_sequences=8)
    lrs = []
    for _ in range(total + 10):
        groups = {g["lr"] for g in training.optimizer.param_groups}
        assert len(groups) == 1
        lrs.append(groups.pop())
        training.optimizer.step()  # no gradients: a no-op, but keeps the scheduler's call-order check quiet
        training.scheduler.step()
    for k in range(warmup):
        assert lrs[k] == pytest.approx(lr * (k + 1) / warmup)
    assert lrs[warmup - 1] == pytest.approx(lr) and lrs[warmup] == pytest.approx(lr)
    tail = lrs[warmup : total + 1]
    assert all(a >= b for a, b in itertools.pairwise(tail))
    mid = warmup + (total - warmup) // 2
    expected_mid = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (mid - warmup) / (total - warmup))))
    assert lrs[mid] == pytest.approx(expected_mid)
    assert lrs[total] == pytest.approx(0.1 * lr)
    assert lrs[-1] == pytest.approx(0.1 * lr)

    # The schedule object's parameters travel in the scheduler's state dict.
    sd = training.scheduler.state_dict()
    assert sd["lr_lambdas"][0] == {"warmup_steps": warmup, "total_steps": total, "min_ratio": 0.1}
    assert WarmupCosine(warmup, total)(0) == pytest.approx(1 / warmup)


# --------------------------------------------------------------------------------------------- training


def test_loss_decreases_and_step_reports(capsys: pytest.CaptureFixture[str]) -> None:
    training = build_training(TinyGPTConfig(), seed=0, num_sequences=512)
    loader = make_loader(training.dataset, 8)
    batches = iter(loader)
    results = [train_step(training, next(batches)) for _ in range(30)]
    losses = [float(r["loss"]) for r in results]
    assert abs(losses[0] - training.dataset.uniform_loss) < 0.2
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    first = results[0]
    assert isinstance(first["loss"], torch.Tensor) and first["loss"].ndim == 0 and not first["loss"].requires_grad
    assert isinstance(first["grad_norm"], torch.Tensor) and float(first["grad_norm"]) > 0
    assert first["lr"] == pytest.approx(3e-3 / 5)
    assert all(p.grad is None for p in training.model.parameters())
    assert training.scheduler.last_epoch == 30
    assert capsys.readouterr() == ("", "")


# A fresh interpreter trains 12 steps and prints the losses' float32 bits; one intra-op thread, because the
# CPU LayerNorm backward splits its weight/bias reduction by thread count (runs are reproducible per thread count).
_FRESH_RUN = """
import struct, torch
torch.set_num_threads(1)
from ckptverify.examples import TinyGPTConfig, build_training, make_loader, train_step
training = build_training(TinyGPTConfig(), seed=0, num_sequences=512)
batches = iter(make_loader(training.dataset, 8))
losses = [float(train_step(training, next(batches))["loss"]) for _ in range(12)]
print(struct.pack("<12f", *losses).hex())
"""


@pytest.mark.slow
def test_fresh_processes_give_bitwise_identical_losses() -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", _FRESH_RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert len(outs[0]) == 12 * 8
    assert outs[0] == outs[1]
    losses = struct.unpack("<12f", bytes.fromhex(outs[0]))
    assert all(math.isfinite(x) for x in losses)


# ------------------------------------------------------------------------------------------ FSDP2, 2 ranks

WORLD = 2
FSDP_STEPS = 6


def _fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    warnings.simplefilter("ignore", UserWarning)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    training = build_training(TinyGPTConfig(), seed=0, num_sequences=512, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in training.model.parameters())
    batches = iter(make_loader(training.dataset, 8, rank=rank, world_size=world))
    results = [train_step(training, next(batches)) for _ in range(FSDP_STEPS)]
    record = {
        key: struct.pack(f"<{FSDP_STEPS}f", *[float(r[key]) for r in results]).hex()
        for key in ("loss", "grad_norm")
    }
    record["grad_norm_type"] = type(results[0]["grad_norm"]).__name__
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


def _launch_fsdp(out_dir: Path) -> list[dict[str, str]]:
    out_dir.mkdir()
    spawn_ranks(_fsdp_worker, WORLD, str(out_dir))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_fsdp2_two_ranks_bitwise_identical_across_launches(tmp_path: Path) -> None:
    first = _launch_fsdp(tmp_path / "a")
    second = _launch_fsdp(tmp_path / "b")
    assert first == second
    r0, r1 = first
    assert r0["grad_norm_type"] == "Tensor"  # the DTensor norm is materialised as a plain tensor
    assert r0["grad_norm"] == r1["grad_norm"], "the clipped norm is global, so every rank sees the same value"
    assert r0["loss"] != r1["loss"], "the ranks train on different batches"
    losses = struct.unpack(f"<{FSDP_STEPS}f", bytes.fromhex(r0["loss"]))
    assert all(math.isfinite(x) for x in losses)
