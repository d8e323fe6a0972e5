"""A planted fault that cannot land where it is aimed is refused, naming what is missing, and changes nothing."""

from __future__ import annotations

import pytest
import torch

from ckptverify.errors import UsageError
from ckptverify.hardware.inject import BitFlip, FaultInjector, flip_bit_


def _injector(flip: BitFlip, *, optimizer: bool = True) -> tuple[FaultInjector, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    injector = FaultInjector(flip, model=model, optimizer=opt if optimizer else None, step_in_progress=lambda: 1)
    return injector, model, opt


def test_a_non_contiguous_tensor_is_refused_unchanged() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    with pytest.raises(UsageError, match="non-contiguous"):
        flip_bit_(t, 0, 0)
    assert torch.equal(t, torch.arange(6.0).reshape(2, 3).t())


def test_faults_without_their_target_are_refused() -> None:
    with pytest.raises(UsageError, match="no module named 'nope'"):
        _injector(BitFlip(kind="activation", name="nope", step=1))
    with pytest.raises(UsageError, match="a param fault needs the optimizer"):
        _injector(BitFlip(kind="param", name="0.weight", step=1), optimizer=False)
    _, model, opt = _injector(BitFlip(kind="grad", name="0.weight", step=1))
    with pytest.raises(UsageError, match="no gradient at step 1"):
        opt.step()  # the step before any backward: the gradient to flip does not exist
    _, model, opt = _injector(BitFlip(kind="optim", name="0.weight", step=1, state_key="nope"))
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(UsageError, match="no tensor 'nope'"):
        opt.step()


def test_a_param_fault_flips_its_bit_after_the_step() -> None:
    injector, model, opt = _injector(BitFlip(kind="param", name="0.weight", step=1, element=1, bit=31))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    stepped = model[0].weight.detach().clone()
    assert injector.fired
    injector.detach()
    flip_bit_(model[0].weight, 1, 31)  # undo: the sign bit of element 1 was the only change
    model[0].weight.grad = None
    assert stepped.view(-1)[1] == -model[0].weight.detach().view(-1)[1]
