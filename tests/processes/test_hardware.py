"""Hardware faults seen in the job: replicas compared every step, and bit flips planted on purpose.

Real processes (torch.multiprocessing, gloo, 2 ranks): DDP replicas, HSDP (FSDP2 on a 2x1 mesh: parameters
replicated along the first dimension) and plain FSDP2 (nothing replicated: nothing compared, and it says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hardware_worker as worker
from helpers.multiproc import spawn_ranks

from ckptverify.errors import UsageError
from ckptverify.hardware.inject import BitFlip, FaultInjector, flip_bit_
from ckptverify.ownfiles.events import read_events


def _launch(tmp: Path, wrap: str, fault: BitFlip | None = None, on_replica_mismatch: str = "warn",
            steps: int = 4) -> list[dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    spawn_ranks(worker.run, 2, str(tmp), wrap, fault.to_json() if fault else None, on_replica_mismatch, steps)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_clean_ddp_replicas_agree_and_say_how_much_they_compared(tmp_path: Path) -> None:
    results = _launch(tmp_path, "ddp")
    for r in results:
        # 4 parameters, each with AdamW's step, exp_avg and exp_avg_sq
        assert r["tensors"] == 4 and r["compared"] == [16, 16, 16, 16]
        assert r["mismatch_steps"] == [] and r["error"] is None
    assert list(read_events(tmp_path)) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grad", "param", "optim"])
def test_a_flipped_bit_on_one_replica_is_caught_at_its_step(tmp_path: Path, kind: str) -> None:
    flip = BitFlip(kind=kind, name="2.weight", step=3, rank=1, element=5, bit=20)
    results = _launch(tmp_path, "ddp", flip)
    assert results[1]["fired"] and not results[0]["fired"]
    for r in results:
        first = r["mismatch_steps"][0]
        assert first[0] == 3 and first[2] in ([[0], [1]], [[1], [0]])
        # the flipped tensor itself when it is compared, else what it fed at once (the update it drove)
        assert first[1][0] == {"optim": "optim:2.weight.exp_avg"}.get(kind, "2.weight")
    events = list(read_events(tmp_path, "replica-mismatch"))
    assert events and events[0]["step"] == 3 and events[0]["tensors"][0] in ("2.weight", "optim:2.weight.exp_avg")
    assert events[0]["rank"] == 0 and {tuple(s["ranks"]) for s in events[0]["sides"]} == {(0,), (1,)}
    assert all(s["hosts"] for s in events[0]["sides"])


@pytest.mark.slow
def test_a_traced_job_checks_its_replicas_with_the_digests_the_trace_made(tmp_path: Path) -> None:
    """With a state-level trace the check reads no parameter again (it reuses the row's digests) and still
    catches a flipped bit at its step; the optimizer state, which the check compares too, it digests itself."""
    clean = _launch(tmp_path / "clean", "ddp-traced")
    for r in clean:
        assert r["compared"] == [16] * 4 and r["reused"] == [4] * 4 and r["mismatch_steps"] == []
    flip = BitFlip(kind="param", name="2.weight", step=3, rank=0, element=5, bit=20)
    flipped = _launch(tmp_path / "flip", "ddp-traced", flip)
    for r in flipped:
        assert r["mismatch_steps"][0][:2] == [3, ["2.weight"]] and r["reused"] == [4] * 4


@pytest.mark.slow
def test_raise_stops_every_replica_at_the_mismatch(tmp_path: Path) -> None:
    flip = BitFlip(kind="param", name="0.bias", step=2, rank=0, element=0, bit=31)
    results = _launch(tmp_path, "ddp", flip, on_replica_mismatch="raise")
    assert [r["error"] for r in results] == [{"type": "ReplicaMismatchError", "step": 2}] * 2


@pytest.mark.slow
def test_hsdp_compares_along_the_replicate_dimension_and_fsdp_has_nothing_to_compare(tmp_path: Path) -> None:
    flip = BitFlip(kind="param", name="0.weight", step=2, rank=1, element=3, bit=7)
    hsdp = _launch(tmp_path / "hsdp", "hsdp", flip)
    for r in hsdp:
        assert r["tensors"] == 4 and r["compared"][0] == 16
        assert r["mismatch_steps"] and r["mismatch_steps"][0][:2] == [2, ["0.weight"]]
    fsdp = _launch(tmp_path / "fsdp", "fsdp")
    assert all(r["tensors"] == 0 and r["compared"] == [0, 0, 0, 0] for r in fsdp)


def test_flip_bit_changes_exactly_one_bit_of_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                  torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64):
        t = torch.zeros(6, dtype=dtype) if dtype is not torch.float8_e4m3fn else torch.zeros(6).to(dtype)
        before = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).view(torch.uint8).clone()
        width = (torch.view_as_real(t) if t.is_complex() else t).element_size() * 8
        for bit in (0, width - 1):
            flip_bit_(t, 4, bit)
            after = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).view(torch.uint8)
            diff = (after ^ before).tolist()
            assert sum(bin(b).count("1") for b in diff) == 1, (dtype, bit, diff)
            flip_bit_(t, 4, bit)
    with pytest.raises(UsageError):
        flip_bit_(torch.zeros(3), 3, 0)
    with pytest.raises(UsageError):
        flip_bit_(torch.zeros(3, dtype=torch.float16), 0, 16)


def test_fault_descriptions_are_validated_and_round_trip() -> None:
    flip = BitFlip(kind="optim", name="w", step=4, rank=1, element=2, bit=3, state_key="exp_avg_sq")
    assert BitFlip.from_json(flip.to_json()) == flip and flip.site == "optim:w.exp_avg_sq"
    for bad in ({"kind": "cosmic", "name": "w", "step": 1}, {"kind": "grad", "name": "w", "step": 0}):
        with pytest.raises(UsageError):
            BitFlip(**bad)
    with pytest.raises(UsageError):
        BitFlip.from_json("{not json")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError):
        FaultInjector(BitFlip(kind="grad", name="nope", step=1), model=model, optimizer=None,
                      step_in_progress=lambda: 1)


def test_activation_flip_changes_one_forward_output_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(2, 4)
    clean = model(x).detach()
    step = 1
    inj = FaultInjector(BitFlip(kind="activation", name="0", step=2, element=1, bit=30), model=model,
                        step_in_progress=lambda: step)
    assert torch.equal(model(x), clean)
    step = 2
    assert not torch.equal(model(x), clean) and inj.fired
    assert torch.equal(model(x), clean)  # once, not at every call
    inj.detach()
