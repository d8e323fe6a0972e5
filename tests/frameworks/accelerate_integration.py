"""Two gloo ranks of a CPU ``Accelerator`` saving and loading through ckptverify's accelerate helpers.

``python accelerate_integration.py OUT inline``: rank 1 damages its own ``random_states_1.pkl`` right after
writing it at step 4 (storage that corrupts what it is given). Checked: rank 0 verifies only once every rank has
written (step 2 passes, step 4 fails naming rank 1's file), both ranks raise on the damaged save
(``on_failure="raise"``), both refuse to load it (nothing loaded), and both load step 2.

``python accelerate_integration.py OUT background``: the same damage, saved with ``background=True`` and
``on_failure="raise"``: both saves return pending verdicts; rank 0 waits for the background verifier before the
step 6 save, at which both ranks raise the step 4 failure; then both wait (``wait_for_verifications``).

Each rank writes ``OUT/rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import spawn
from harness import flip_in_zip_member


def setup(rank: int):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=4))
    save_state = accelerator.save_state

    def damaging(output_dir=None, **kwargs):
        location = save_state(output_dir, **kwargs)
        if rank == 1 and os.path.basename(location) == "state-step4":
            flip_in_zip_member(Path(location) / "random_states_1.pkl")
        return location

    accelerator.save_state = damaging
    return accelerator, model, opt, loader


def job(rank: int, world: int, out: Path, mode: str) -> None:
    if mode == "background":
        background_job(rank, out)
        return
    from ckptverify.errors import CheckpointRefusedError
    from ckptverify.integrations import accelerate as ckv
    from ckptverify.options import VerifyOptions

    accelerator, model, opt, loader = setup(rank)
    result: dict = {}
    weights = {}
    for step, (x, y) in enumerate(loader, start=1):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step in (2, 4):
            weights[step] = [p.detach().clone() for p in model.parameters()]
            try:
                verdict = ckv.save_state(accelerator, out / f"state-step{step}",
                                         verify=VerifyOptions(on_failure="raise"))
                result[f"step{step}"] = verdict.to_dict()
            except CheckpointRefusedError as exc:
                result[f"step{step}_error"] = {"type": type(exc).__name__, "message": str(exc)}
        if step == 4:
            break
    now = [p.detach().clone() for p in model.parameters()]
    try:
        ckv.load_state(accelerator, out / "state-step4")
    except CheckpointRefusedError as exc:
        result["load_step4_error"] = {"type": type(exc).__name__, "message": str(exc)}
    result["load_step4_untouched"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), now, strict=True))
    ckv.load_state(accelerator, out / "state-step2")
    result["load_step2_restored"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), weights[2],
                                                                          strict=True))
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


def background_job(rank: int, out: Path) -> None:
    import warnings

    from ckptverify.errors import CheckpointRefusedError, VerifyFailedWarning
    from ckptverify.integrations import accelerate as ckv
    from ckptverify.options import VerifyOptions
    from ckptverify.verifier.background import wait_for_verifications

    accelerator, model, opt, loader = setup(rank)
    result: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(loader, start=1):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if step in (2, 4, 6):
                if step == 6:  # step 4's verdict is in before this save (rank 0 verifies; rank 1 waits in the save)
                    assert wait_for_verifications(timeout=120)
                try:
                    verdict = ckv.save_state(accelerator, out / f"state-step{step}",
                                             verify=VerifyOptions(when="background", on_failure="raise"))
                    result[f"step{step}"] = verdict.to_dict()
                except CheckpointRefusedError as exc:
                    result[f"step{step}_error"] = {"type": type(exc).__name__, "message": str(exc)}
                    break
        result["waited"] = [v.to_dict() for v in ckv.wait_for_verifications(accelerator)]
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, VerifyFailedWarning)]
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    spawn(2, job, Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "inline")
