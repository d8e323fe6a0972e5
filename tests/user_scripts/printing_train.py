"""A small training script that prints, as training scripts do: at import (module level, as nanoGPT's train.py
does) and while it trains. ``train_changed`` trains with another learning rate (a change ``compare`` sees).

    python printing_train.py --run-dir DIR --steps 4 --save-every 2
"""

import sys

import torch

import ckptverify as cv

print("printing_train: module level, on stdout")
print("printing_train: module level, on stderr", file=sys.stderr)


def _train(run, lr):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    run.restore(cv.TrainState(model=model, optimizer=opt))
    print(f"printing_train: train() starts at step {run.step}")
    for _ in run.steps():
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"printing_train: step {run.step + 1} loss {loss.item():.4f}")
        run.record(loss=loss)


def train(run):
    _train(run, lr=0.05)


def train_changed(run):
    _train(run, lr=0.1)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2)
    args = ap.parse_args()
    cv.Run.main(train, steps=args.steps, run_dir=args.run_dir, save_every=args.save_every, trace="state")
