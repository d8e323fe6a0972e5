"""TrainState refuses a malformed saved state, or a wrong set-up, naming what is wrong; nothing changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.state.train_state import Counters, TrainState


class _Extra:
    def __init__(self) -> None:
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, int]:
        return {"a": 1}

    def load_state_dict(self, sd: Any) -> None:
        self.loaded.append(sd)


def test_malformed_saved_states_are_refused_and_change_nothing() -> None:
    model = torch.nn.Linear(2, 2)
    extra = _Extra()
    state = TrainState(model=model, extras={"x": extra})
    sd = state.state_dict()
    weights = model.weight.detach().clone()
    cases: list[tuple[Any, str]] = [
        ([sd], "a train state must be a mapping"),
        ({**sd, "version": 99}, "version 99 is not supported"),
        ({**sd, "model": [1]}, "the model state in the checkpoint is a list"),
        ({**sd, "counters": [0]}, "counters in the checkpoint are a list"),
        ({**sd, "counters": {**sd["counters"], "step": 1.5}}, "counter 'step'"),
        ({**sd, "extras": {}}, "no state for extra 'x'"),
        ({**sd, "digests": {"rank0": {"counters": 3}}}, "digests are not all strings"),
    ]
    for bad, message in cases:
        with pytest.raises(CkptVerifyError, match=message):
            state.load_state_dict(bad)
        assert torch.equal(model.weight, weights) and not extra.loaded and state.counters == Counters()


def test_an_integer_tensor_counter_is_read_as_its_int() -> None:
    assert Counters().validated({"step": torch.tensor(7), "epoch": 1, "tokens_seen": 2, "samples_seen": 3}) == \
        {"step": 7, "epoch": 1, "tokens_seen": 2, "samples_seen": 3}
    with pytest.raises(CkptVerifyError, match="counter 'step'"):
        Counters().validated({"step": torch.tensor(7.0), "epoch": 1, "tokens_seen": 2, "samples_seen": 3})


def test_wrong_set_ups_are_refused() -> None:
    with pytest.raises(UsageError, match="needs its model"):
        TrainState(optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(UsageError, match="no state_dict"):
        TrainState(extras={"x": object()})
    with pytest.raises(UsageError, match="reapply_rng"):
        TrainState().reapply_rng()
    assert TrainState().model_optim_state() == ({}, {})
