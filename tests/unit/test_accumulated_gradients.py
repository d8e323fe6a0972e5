"""Gradient accumulation: a save between micro-batches is warned about (the checkpoint does not hold the
accumulated gradients), a save after an optimizer step is not, whether or not the loop zeroed the gradients
yet; and ``run.steps(loader, micro_batches=K)`` hands each step its K micro-batches."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptverify as cv
from ckptverify.checkpoint.save import save
from ckptverify.errors import UsageError
from ckptverify.integrations._core import warn_if_accumulating
from ckptverify.resume.run import Run, RunConfig
from ckptverify.state.train_state import TrainState, pending_gradients


def _job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model=model, optimizer=opt)
    return model, opt, state


def _backward(model):
    model(torch.randn(3, 4)).pow(2).mean().backward()


def _saved_warnings(state, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(state, path)
    return [str(w.message) for w in caught if "accumulated gradients" in str(w.message)]


def test_a_save_between_micro_batches_warns_and_names_the_parameters(tmp_path):
    model, opt, state = _job()
    _backward(model)
    opt.step()
    opt.zero_grad()
    _backward(model)  # the first micro-batch of the next step
    said = _saved_warnings(state, tmp_path / "mid")
    assert len(said) == 1, said
    assert "4 parameter(s) hold accumulated gradients (0.weight, 0.bias, 2.weight, 2.bias)" in said[0]
    assert "micro_batches=K" in said[0]


def test_a_save_after_the_optimizer_step_does_not_warn_even_before_zero_grad(tmp_path):
    # Lightning and torchtitan zero the gradients at the start of the next step: at the save, .grad still
    # holds what the step consumed, and nothing is lost.
    model, opt, state = _job()
    _backward(model)
    opt.step()
    assert _saved_warnings(state, tmp_path / "stale") == []
    opt.zero_grad(set_to_none=False)
    assert _saved_warnings(state, tmp_path / "zeroed") == []
    _backward(model)
    assert pending_gradients(model)[1] == 4  # accumulated into the zeroed tensors in place


def test_a_plain_state_dict_holding_the_module_is_checked_too(tmp_path):
    model, opt, _ = _job()
    _backward(model)
    opt.step()
    _backward(model)
    with pytest.warns(UserWarning, match="accumulated gradients"):
        save({"model": model}, tmp_path / "dict")


def test_the_integrations_warning_names_the_checkpoint(tmp_path):
    model, opt, _ = _job()
    _backward(model)
    opt.step()
    _backward(model)
    with pytest.warns(UserWarning, match=r"checkpoint-7 is saved while 4 parameter\(s\)"):
        warn_if_accumulating(model, tmp_path / "checkpoint-7")
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_accumulating(model, tmp_path / "checkpoint-8")


def test_run_steps_with_micro_batches_yields_each_steps_batches_and_stops_before_a_partial_step():
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2)  # 5 batches
    run = Run(RunConfig(stop_step=10))
    run.restore(cv.TrainState())
    seen = []
    for batches in run.steps(loader, micro_batches=2):
        seen.append([b[0].tolist() for b in batches])
        run.record()
    # Two whole steps; the fifth batch alone is not a step.
    assert seen == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]]
    assert run.step == 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_run_steps_refuses_a_micro_batch_count_that_is_not_a_positive_whole_number(bad):
    run = Run(RunConfig(stop_step=3))
    with pytest.raises(UsageError, match="micro_batches"):
        next(run.steps([1, 2, 3], micro_batches=bad))


def test_run_steps_with_micro_batches_needs_a_loader():
    run = Run(RunConfig(stop_step=3))
    with pytest.raises(UsageError, match="needs the loader"):
        next(run.steps(micro_batches=2))
