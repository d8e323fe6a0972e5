"""Two gloo ranks of a CPU ``Accelerator`` saving and loading through ckptverify's accelerate helpers.

``python accelerate_integration.py OUT``: rank 1 damages its own ``random_states_1.pkl`` right after writing
it at step 4 (storage that corrupts what it is given). Checked: rank 0 verifies only once every rank has
written (step 2 passes, step 4 fails naming rank 1's file), both ranks raise on the damaged save
(``on_failure="raise"``), both refuse to load it (nothing loaded), and both load step 2. Each rank writes
``OUT/rank{R}.json``.
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


def job(rank: int, world: int, out: Path) -> None:
    from accelerate import Accelerator

    from ckptverify.errors import CheckpointRefusedError
    from ckptverify.integrations import accelerate as ckv

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
    result: dict = {}
    weights = {}
    for step, (x, y) in enumerate(loader, start=1):
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step in (2, 4):
            weights[step] = [p.detach().clone() for p in model.parameters()]
            try:
                verdict = ckv.save_state(accelerator, out / f"state-step{step}", on_failure="raise")
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


if __name__ == "__main__":
    spawn(2, job, Path(sys.argv[1]))
