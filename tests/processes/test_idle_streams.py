"""A random stream that differs between two runs but that no step draws from (python's ``random``, never seeded,
never used) is not where the runs part, however early its site comes; a stream the steps do draw from still is.

The training function is the user's kind: its own Dataset with augmentation in DataLoader workers, AdamW, a
scheduler, clipping. Planted next to each other: an unseeded stream nobody uses beside a nondeterministic op (the
verdict must name the op's effects, not the stream), and an unseeded stream the step draws from (the verdict
must name the stream).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ckptverify.resume.harness import Plan, resume_check

SCRIPT = textwrap.dedent('''
    import os
    import random

    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    import ckptverify as cv

    class Noisy(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(64, 8, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i] + 0.01 * torch.randn(8)

    def _train(run, *, noise_op, draw_python):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        data = Noisy()
        loader = DataLoader(data, batch_size=8, sampler=cv.ResumableSampler(len(data), seed=1), num_workers=2)
        run.restore(cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader))
        for x in run.steps(loader):
            h = model[0](x)
            if noise_op:  # the computation itself is not deterministic
                h = h + torch.from_numpy(np.frombuffer(os.urandom(4 * h.numel()), dtype=np.uint32)
                                         .astype(np.float32).reshape(h.shape)) * 1e-9
            if draw_python:  # python's random stream, never seeded, decides the scale
                h = h * (1.0 + random.random() * 1e-6)
            loss = F.mse_loss(model[2](model[1](h)), x.sum(1, keepdim=True))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            run.record(loss=loss.detach())

    def noise_beside_idle_stream(run):
        _train(run, noise_op=True, draw_python=False)

    def draws_unseeded_stream(run):
        _train(run, noise_op=False, draw_python=True)
''')


def test_an_unused_unseeded_stream_is_not_named_as_where_the_runs_part(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    outcome = resume_check(Plan(target=f"{script}:noise_beside_idle_stream", steps=2, resume_at=1, runs=("A", "A2")))
    verdict = outcome.verdict
    assert verdict.kind == "nondeterministic", verdict
    assert not verdict.site.startswith(("start.rng.", "rng.")), verdict
    unused = [f for f in outcome.report.findings if f.check == "trace-rng-unused"]
    assert unused and "rng.python" in unused[0].message
    assert not any("rng.python" in f.message for f in outcome.report.findings if f.severity.value == "error")


def test_an_unseeded_stream_the_steps_draw_from_is_still_named(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    outcome = resume_check(Plan(target=f"{script}:draws_unseeded_stream", steps=2, resume_at=1, runs=("A", "A2")))
    verdict = outcome.verdict
    assert verdict.kind in ("nondeterministic", "rng"), verdict
    assert verdict.site == "start.rng.python", verdict
    assert not any(f.check == "trace-rng-unused" for f in outcome.report.findings)
