"""The ranks the harness starts do not repeat torchdata's ``set_vital`` deprecation warning (one line per rank of
every run, about nobody's code), and show every other warning as they would."""

from __future__ import annotations

import os
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from ckptverify.resume.launch import _quiet_known_noise, launch_jobs
from ckptverify.resume.run import RunConfig

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def test_only_torchdatas_set_vital_warning_is_ignored() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        StatefulDataLoader(list(range(4)))
        assert any("set_vital" in str(w.message) for w in seen)  # what the filter is for, still raised unfiltered
        seen.clear()
        _quiet_known_noise()
        StatefulDataLoader(list(range(4)))
        torch.set_vital("Dataloader", "enabled", "True")  # the user's own call: not torchdata's
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        warnings.warn("'set_vital' is deprecated, says the user", UserWarning, stacklevel=1)
    messages = [(str(w.message), os.path.basename(w.filename)) for w in seen]
    assert ("'set_vital' is deprecated, please do not call", "test_launch_warnings.py") in messages, messages
    assert ("the user's own warning", "test_launch_warnings.py") in messages
    assert ("'set_vital' is deprecated, says the user", "test_launch_warnings.py") in messages
    assert not any("stateful_dataloader" in name for _, name in messages), messages


@pytest.mark.slow
def test_a_rank_that_builds_a_stateful_loader_logs_no_set_vital_warning(tmp_path: Path) -> None:
    script = tmp_path / "loader_train.py"
    script.write_text(textwrap.dedent('''
        import warnings

        import torch
        from torchdata.stateful_dataloader import StatefulDataLoader

        import ckptverify as cv


        def train(run):
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = StatefulDataLoader(torch.ones(8, 2), batch_size=2)
            run.restore(cv.TrainState(model=model, optimizer=opt, dataloader=loader))
            warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
            for x in run.steps(loader):
                loss = model(x).sum()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.record(loss=loss)
    '''))
    logs = tmp_path / "logs"
    config = RunConfig(name="A", stop_step=2, trace_dir=str(tmp_path / "trace"), level="metrics",
                       workload=f"{script}:train", log_dir=str(logs))
    launch_jobs(1, "cpu", [(f"{script}:train", config)])
    log = (logs / "A-rank0.log").read_text()
    assert "a warning of the user's own" in log and "set_vital" not in log, log
