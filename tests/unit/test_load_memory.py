"""``load`` keeps no second copy of the state on the state's device: the model's and optimizer's tensors are
loaded in place, and the copy that undoes a refused load lives in host memory (pinned on CUDA). Otherwise a
state larger than a third of the device's memory (a private template and an undo copy beside it) could not
resume.

On CPU, host and device are one memory, so the test counts what load allocates on the state's device apart
from the copies it stages to host memory (:func:`ckptverify.checkpoint.load._to_host`, which on CUDA allocate no
device memory): the same logic that on a GPU keeps the device's peak near the state's size.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ckptverify
from ckptverify.checkpoint import load as load_mod
from ckptverify.errors import CheckpointRefusedError
from ckptverify.fingerprint import kernels

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class LiveBytes(TorchDispatchMode):
    """The peak of bytes held by tensors that ops create on ``device_type`` (outputs with storage of their own),
    except while ``staging`` is set; each counted until its tensor is freed."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.staging = False

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.staging:
            return out
        shared = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs or {}))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in shared or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._free, key)
        return out


def _job(width: int) -> ckptverify.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ckptverify.TrainState(model=model, optimizer=opt)


def _state_bytes(state: ckptverify.TrainState) -> int:
    model_sd, optim_sd = state.model_optim_state()
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves((model_sd, optim_sd))
               if isinstance(t, torch.Tensor))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "ckpt"
    ckptverify.save(_job(1024).state_dict(), path)  # ~8 MB of parameters, 24 MB with Adam's two moments
    return path


def _staged(monkeypatch: pytest.MonkeyPatch, mode: LiveBytes) -> list[int]:
    # The fingerprints of the restore check through the host path (numpy, no torch ops): torch.compile does
    # not run under a dispatch mode, so a worker that had compiled the fused CPU kernel would run it op by op
    # here, and count its block-sized temporaries as the load's.
    monkeypatch.setattr(kernels, "_backend", "numpy")
    staged: list[int] = []
    real = load_mod._to_host

    def to_host(t: torch.Tensor) -> torch.Tensor:
        mode.staging = True
        try:
            out = real(t)
        finally:
            mode.staging = False
        staged.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(load_mod, "_to_host", to_host)
    return staged


def test_a_load_allocates_under_a_third_of_the_state_on_its_device_beyond_the_state(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _job(1024)
    for p in state.model.parameters():
        p.data.add_(1.0)  # differs from the checkpoint: the load really writes
    size = _state_bytes(state)
    assert size > 20e6
    mode = LiveBytes("cpu")
    staged = _staged(monkeypatch, mode)
    with mode:
        report = ckptverify.load(state, saved)
    assert not report.errors, report.errors
    assert mode.peak < 0.3 * size, f"load held {mode.peak / size:.2f}x the state in new tensors on its device"
    # The undo copy exists (in host memory), of the whole model and optimizer state.
    assert sum(staged) >= size
    expected = _job(1024)
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), expected.model.parameters(), strict=True))


def test_a_refused_restore_check_puts_the_in_place_load_back_from_the_host_copy(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _job(1024)
    for p in state.model.parameters():
        p.data.mul_(-1.0)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    optim_before = {k: v.clone() for s in state.optimizers[0].state.values() for k, v in s.items()}
    fail = [load_mod.error("restore-mismatch", "planted by the test")]
    monkeypatch.setattr(load_mod, "restore_check", lambda st, manifest: (fail, []))
    with pytest.raises(CheckpointRefusedError, match="planted by the test"):
        ckptverify.load(state, saved)
    after = state.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    optim_after = {k: v for s in state.optimizers[0].state.values() for k, v in s.items()}
    assert all(torch.equal(optim_before[k], optim_after[k]) for k in optim_before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_load_peak_stays_near_the_state_and_the_undo_copy_is_pinned_host_memory(
        saved: Path) -> None:
    state = _job(1024)
    model_cuda = state.model.to("cuda")
    opt = torch.optim.Adam(model_cuda.parameters(), lr=1e-3)
    model_cuda(torch.randn(2, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = ckptverify.TrainState(model=model_cuda, optimizer=opt)
    host = load_mod._to_host(next(model_cuda.parameters()))
    assert host.device.type == "cpu" and host.is_pinned()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ckptverify.load(state, saved, check=False)  # load's own copies; the restore check's kernels are not load's
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 0.3 * _state_bytes(state)
