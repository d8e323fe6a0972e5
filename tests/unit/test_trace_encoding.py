"""The header says how a trace's tensor digests read (``digest_encoding``): bytes on the host, the logical
fingerprint on an accelerator. Traces of two encodings are refused (exit 2, saying what differs and what to do),
never reported as a divergence at step 1; a trace written before the field existed reads as ``unknown``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ckptverify import TrainState
from ckptverify.cli import main
from ckptverify.errors import UsageError
from ckptverify.replay.replay import comparable
from ckptverify.trace import TraceHeader, TraceRecorder, compare_runs, open_trace


def _train(root: Path, encoding: str = "unknown") -> Path:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    header = TraceHeader(run=root.name, level="state", workload="w", digest_encoding=encoding)
    with TraceRecorder(root, header=header) as rec:
        rec.attach(model, optimizer=opt)
        for step in (1, 2):
            rec.record_step_start(state)
            opt.zero_grad()
            loss = model(torch.ones(3, 4)).sum()
            loss.backward()
            opt.step()
            rec.record_step(step, metrics={"loss": loss}, batch=torch.ones(3, 4), state=state)
    return root


def test_a_host_trace_says_so_in_its_header(tmp_path: Path) -> None:
    assert open_trace(_train(tmp_path / "a") / "rank0").header.digest_encoding == "host"


def test_a_device_trace_compared_with_a_host_one_is_refused_not_called_a_divergence(tmp_path: Path) -> None:
    host = _train(tmp_path / "host")
    device = _train(tmp_path / "device", "device")  # what a GPU run writes
    for force in (False, True):
        with pytest.raises(UsageError) as exc:
            compare_runs(device, host, force=force)
        message = str(exc.value)
        assert "'device'" in message and "'host'" in message and "record both on the same kind of device" in message
        assert exc.value.exit_code == 2 and message.index("'device'") < message.index("'host'")
    result = CliRunner().invoke(main, ["trace", "diff", str(device), str(host)])
    assert result.exit_code == 2, result.output
    assert "digest tensors differently" in result.output and "divergence" not in result.output.lower()
    # asked to leave the field out, the traces are compared (the forged header aside, the runs are the same)
    assert compare_runs(device, host, ignore=["digest_encoding"]) == []


def test_a_replay_on_the_cpu_of_a_gpu_production_trace_is_refused_before_it_starts(tmp_path: Path) -> None:
    production = _train(tmp_path / "segment", "device")
    with pytest.raises(UsageError, match=r"--device cuda") as exc:
        comparable(str(production), level="state", workload="w", world=1, device="cpu")
    assert "'device'" in str(exc.value) and "'host'" in str(exc.value)
    comparable(str(production), level="state", workload="w", world=1, device="cuda")
    comparable(str(_train(tmp_path / "cpu")), level="state", workload="w", world=1, device="cpu")
