"""The CUDA random stream of a rank, without a GPU: a simulated CUDA runtime stands in for ``torch.cuda``.

A rank's stream is saved as ``cuda`` (its own device, whatever that device's index) and restored into the device
the rank uses now, so one GPU per task (Slurm: every rank on ``cuda:0``) and one per local rank (torchrun:
``cuda:{local_rank}``) resume each other exactly; a CPU-only rank on a GPU host never touches CUDA at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fake_cuda import FakeCuda

import ckptverify
from ckptverify.errors import CheckpointRefusedError, UsageError
from ckptverify.state.digest import state_digest
from ckptverify.state.rng import RngState, capture_rng, reseed_rng, restore_rng


def test_a_rank_saves_only_its_own_device_stream_and_which_device_that_was(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch, n=8, current=3)
    state = capture_rng()
    assert not any(k.startswith("cuda.") for k in state), sorted(state)
    assert torch.equal(state["cuda"], cuda.states[3])
    assert state["cuda_device"] == {"index": 3, "uuid": "GPU-a-3"}
    assert "get_rng_state_all" not in cuda.calls  # the other seven devices are other ranks'


@pytest.mark.parametrize(("n", "current"), [(1, 0), (8, 5), (8, 3)], ids=["slurm-one-gpu", "other-index", "same"])
def test_the_saved_stream_goes_into_the_device_the_rank_uses_now_whatever_its_index(
        monkeypatch: pytest.MonkeyPatch, n: int, current: int) -> None:
    with monkeypatch.context() as m:
        saver = FakeCuda(m, n=8, current=3, node="a")  # torchrun: local rank 3 on cuda:3
        state = capture_rng()
        saved = saver.states[3].clone()
    resumer = FakeCuda(monkeypatch, n=n, current=current, node="b")
    before = {i: s.clone() for i, s in resumer.states.items()}
    restore_rng(state)
    assert torch.equal(resumer.states[current], saved)
    assert all(torch.equal(resumer.states[i], before[i]) for i in resumer.states if i != current), \
        "another device's stream was changed"
    # The stream digests alike wherever it went; only the device's identity differs.
    now = capture_rng()
    assert state_digest(now["cuda"]) == state_digest(state["cuda"])
    assert state_digest(now["cuda_device"]) != state_digest(state["cuda_device"])


def test_a_cuda_stream_is_refused_where_cuda_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        FakeCuda(m, n=2, current=1)
        state = capture_rng()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(UsageError, match="CUDA is not available"):
        restore_rng(state)
    assert torch.equal(torch.get_rng_state(), before), "a refused restore changed a stream"


def test_a_malformed_device_identity_or_stream_is_refused_before_any_stream_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch, n=2, current=1)
    state = capture_rng()
    before = cuda.states[1].clone()
    with pytest.raises(UsageError, match="cuda_device"):
        restore_rng({**state, "cuda_device": {"index": "1", "uuid": ""}})
    with pytest.raises(UsageError, match="bytes"):
        restore_rng({**state, "cuda": torch.zeros(8, dtype=torch.uint8)})
    assert torch.equal(cuda.states[1], before)


def test_a_cpu_only_rank_on_a_gpu_host_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch, n=8, current=0, initialized=False)
    gen = torch.Generator().manual_seed(1)
    state = capture_rng({"g": gen})
    assert "cuda" not in state and not any(k.startswith("cuda") for k in state)
    restore_rng(state, {"g": gen})
    rng = RngState({"g": gen}, rank=0, world_size=2, allow_reseed=True)
    template = rng.state_dict()
    rng.load_state_dict(template)
    rng.load_state_dict({**template, "world_size": 1})  # a world size change: every stream re-seeded
    reseed_rng(3, 1, {"g": gen})
    assert cuda.touched() == [], cuda.calls
    assert not cuda.initialized


def test_a_cpu_only_rank_whose_cuda_a_library_started_keeps_the_same_streams_and_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host ``dcp.save``'s writer initialises CUDA in a CPU-only rank: its state dict must not gain a
    ``cuda`` key after its first save (a template built then would ask for a key the checkpoint lacks)."""
    FakeCuda(monkeypatch, n=8, current=0, holds_tensors=False)
    gen = torch.Generator().manual_seed(1)
    rng = RngState({"g": gen}, rank=0, world_size=1)
    assert not any(k.startswith("cuda") for k in rng.state_dict()["rank0"])
    assert not any(k.startswith("cuda") for k in capture_rng({"g": gen}))


# ----------------------------------------------------------------------------------- through save and load


def _job() -> ckptverify.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return ckptverify.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_resume_on_another_gpu_restores_the_ranks_stream_and_says_the_device_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        saver = FakeCuda(m, n=8, current=3, node="a")  # torchrun, local rank 3
        m.setattr(torch.cuda, "is_available", lambda: False)  # DCP's writer would use CUDA streams
        ckptverify.save(_job().state_dict(), tmp_path / "ckpt")
        saved = saver.states[3].clone()
    resumer = FakeCuda(monkeypatch, n=1, current=0, node="b")  # Slurm, one GPU per task, another node
    report = ckptverify.load(_job(), tmp_path / "ckpt")
    assert not report.errors, report.errors
    assert torch.equal(resumer.states[0], saved)
    assert [f.check for f in report.warnings] == ["restore-device"], report.warnings
    # The stream itself is still checked: one restored wrongly is refused.
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda new_state, device=None: None)
    resumer.states[0] = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(CheckpointRefusedError, match=r"rng\.cuda"):
        ckptverify.load(_job(), tmp_path / "ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_saved_stream_is_restored_even_where_cuda_starts_only_at_the_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resumed process builds its template before touching CUDA (a pinning loader starts CUDA later): the
    saved stream is still loaded and restored, initialising CUDA then."""
    with monkeypatch.context() as m:
        saver = FakeCuda(m, n=2, current=1)
        m.setattr(torch.cuda, "is_available", lambda: False)  # DCP's writer would use CUDA streams
        ckptverify.save(_job().state_dict(), tmp_path / "ckpt")
        saved = saver.states[1].clone()
    resumer = FakeCuda(monkeypatch, n=2, current=1, initialized=False)
    report = ckptverify.load(_job(), tmp_path / "ckpt")
    assert not report.errors, report.errors
    assert resumer.initialized and torch.equal(resumer.states[1], saved)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_checkpoint_without_a_cuda_stream_loads_where_cuda_is_in_use_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckptverify.save(_job().state_dict(), tmp_path / "ckpt")  # a CPU-only process: no CUDA stream saved
    resumer = FakeCuda(monkeypatch, n=2, current=0)
    before = resumer.states[0].clone()
    report = ckptverify.load(_job(), tmp_path / "ckpt")
    assert not report.errors, report.errors
    assert any(f.location.fqn == "rng.cuda" and "not saved" in f.message for f in report.warnings), report.warnings
    assert torch.equal(resumer.states[0], before)
