"""Benchmark ``resume-check`` of a small user job against checking that job by hand, in one run.

    python scripts/bench_resume.py [--steps 40] [--resume-at 20] [--nproc 1 2] [--repeats 3]
                                   [--compare-with CHECKOUT] [--walk]

The job is written the way users write one: their own ``Dataset`` class with per-sample augmentation, a
``DataLoader`` with 2 workers over the sampler the docs name (``ResumableSampler``), an MLP (DDP on 2
ranks), AdamW, a StepLR schedule, gradient clipping. By hand
(the baseline) it runs as a plain PyTorch script twice, each in its own interpreter (``torchrun`` on 2 ranks):
``T`` steps saving at ``K`` with ``torch.save``, then resumed from that file to ``T``. Checked, it runs as
``python -m ckptverify resume-check job.py:train -T T -K K --no-locate`` (runs A, A2 and B, compared), also in its
own interpreter. Both sides alternate within each repeat (the machine's load moves between runs); the medians
and their ratio are printed per rank count, with the target (checked <= 1.5x by hand).

``--walk`` times the op walk instead: the same job with a counter planted in it (the loss depends on it, it is
never saved), checked with ``--no-locate`` and with the walk (``hidden-state``, located), alternating; the target
is the check with its walk within 2x of the failing check without it.

``--compare-with CHECKOUT`` times ``resume-check`` of another checkout of ckptverify in the same run too (its
package first on ``PYTHONPATH``), so a change's before and after are measured side by side. Exit 0 when every
check passed (whatever the times), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_RATIO = 1.5
WALK_TARGET_RATIO = 2.0
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = '''
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from ckptverify.state.sampler import ResumableSampler


class Points(Dataset):
    """Noisy points of four classes; each sample jittered where it is loaded."""

    def __init__(self, n=2048):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = (self.x[:, :2].sum(1) > 0).long() + 2 * (self.x[:, 2] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.05 * torch.randn(32), self.y[i]


def build(rank, world):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Points()
    sampler = ResumableSampler(len(data), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2, drop_last=True)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.ReLU(),
                        nn.Linear(128, 4))
    model = DDP(net) if world > 1 else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
    return model, optimizer, scheduler, loader


def step(model, optimizer, scheduler, batch, scale=1.0):
    x, y = batch
    loss = F.cross_entropy(model(x), y) * scale
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def train(run):
    import ckptverify as cv

    model, optimizer, scheduler, loader = build(run.rank, run.world_size)
    run.restore(cv.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader))
    seen = 0  # with BENCH_HIDDEN_STATE=1: a counter the loss depends on, never saved (the planted bug)
    for batch in run.steps(loader):
        if os.environ.get("BENCH_HIDDEN_STATE") == "1":
            seen += 1
        loss = step(model, optimizer, scheduler, batch, scale=1 + 1e-3 * seen)
        run.record(loss=loss.detach(), batch=batch)


if __name__ == "__main__":  # by hand: train to --steps, saving at --save-at, or resume from --resume
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int)
    p.add_argument("--resume")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    model, optimizer, scheduler, loader = build(rank, world)
    done = 0
    if a.resume:
        saved = torch.load(a.resume)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        done = saved["step"]
    batches = iter(loader)
    for _ in range(done):  # the batches the first run consumed
        next(batches)
    for n in range(done + 1, a.steps + 1):
        step(model, optimizer, scheduler, next(batches))
        if n == a.save_at and rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": n}, a.out)
    if world > 1:
        dist.destroy_process_group()
'''


def _env(checkout: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = checkout + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _timed(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - t0, proc.returncode, proc.stderr[-2000:]


def by_hand(work: str, steps: int, resume_at: int, nproc: int) -> float:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  "--standalone", "--nproc-per-node", str(nproc)]
    ckpt = os.path.join(work, "by_hand.pt")
    total = 0.0
    for args in (["--steps", str(steps), "--save-at", str(resume_at), "--out", ckpt],
                 ["--steps", str(steps), "--resume", ckpt, "--out", ckpt + ".unused"]):
        took, rc, err = _timed([*launch, "job.py", *args], _env(HERE), work)
        if rc != 0:
            raise SystemExit(f"the job by hand failed:\n{err}")
        total += took
    return total


def checked(work: str, checkout: str, steps: int, resume_at: int, nproc: int, *, locate: bool = False,
            planted: bool = False) -> tuple[float, bool]:
    """The wall time of ``resume-check`` and whether it said what it should: passed, or (``planted``) failed
    with the hidden-state verdict, and (``locate``) with the walk located."""
    cmd = [sys.executable, "-m", "ckptverify", "resume-check", "job.py:train", "-T", str(steps), "-K",
           str(resume_at), "--nproc", str(nproc), "--no-progress", "--json"]
    if not locate:
        cmd.append("--no-locate")
    env = _env(checkout)
    if planted:
        env["BENCH_HIDDEN_STATE"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    took = time.perf_counter() - t0
    try:
        verdict = json.loads(proc.stdout)["stats"]["verdict"]
    except (ValueError, KeyError, TypeError):
        print(f"resume-check exited {proc.returncode}:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return took, False
    if not planted:
        right = proc.returncode == 0
    else:
        right = proc.returncode == 1 and verdict.get("kind") == "hidden-state" and (
            not locate or (verdict.get("locate") or {}).get("status") == "located")
    if not right:
        print(f"resume-check exited {proc.returncode} with verdict {verdict.get('kind')} (walk "
              f"{(verdict.get('locate') or {}).get('status')}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return took, right


def bench_walk(work: str, args: argparse.Namespace) -> bool:
    """The failing check with the walk against the same check without it, on the job with its planted counter."""
    ok = True
    for nproc in args.nproc:
        without, walked = [], []
        for _ in range(args.repeats):
            took, right = checked(work, HERE, args.steps, args.resume_at, nproc, planted=True)
            without.append(took)
            ok &= right
            took, right = checked(work, HERE, args.steps, args.resume_at, nproc, locate=True, planted=True)
            walked.append(took)
            ok &= right
        a, b = statistics.median(without), statistics.median(walked)
        print(f"{nproc} rank(s), planted hidden state: failing check --no-locate {a:.1f} s; with the walk {b:.1f} s: "
              f"{b / a:.2f}x (target <= {WALK_TARGET_RATIO}x: {'met' if b / a <= WALK_TARGET_RATIO else 'not met'})")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--resume-at", type=int, default=20)
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compare-with", metavar="CHECKOUT", help="another checkout of ckptverify, timed beside this one")
    p.add_argument("--walk", action="store_true",
                   help="time the failing check with its walk against it without (a counter planted in the job)")
    args = p.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as work:
        with open(os.path.join(work, "job.py"), "w") as f:
            f.write(JOB)
        print(f"{args.steps} steps, resumed at {args.resume_at}; median of {args.repeats}; load "
              f"{os.getloadavg()[0]:.1f} at the start")
        if args.walk:
            return 0 if bench_walk(work, args) else 1
        for nproc in args.nproc:
            hand, mine, other = [], [], []
            for _ in range(args.repeats):
                hand.append(by_hand(work, args.steps, args.resume_at, nproc))
                took, passed = checked(work, HERE, args.steps, args.resume_at, nproc)
                mine.append(took)
                ok &= passed
                if args.compare_with:
                    took, passed = checked(work, os.path.abspath(args.compare_with), args.steps, args.resume_at,
                                           nproc)
                    other.append(took)
            h, m = statistics.median(hand), statistics.median(mine)
            print(f"{nproc} rank(s): by hand {h:.1f} s; resume-check --no-locate {m:.1f} s: {m / h:.2f}x "
                  f"(target <= {TARGET_RATIO}x: {'met' if m / h <= TARGET_RATIO else 'not met'})")
            if other:
                o = statistics.median(other)
                print(f"{nproc} rank(s): resume-check of {args.compare_with}: {o:.1f} s: {o / h:.2f}x by hand")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
