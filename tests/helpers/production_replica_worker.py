"""Worker for the replica-episode test: two DDP replicas checked every step; rank 1's copy of one weight has a
bit flipped at step 2, flipped back at step 4 (the replicas agree again) and flipped again at step 5. Run under
``helpers.multiproc.spawn_ranks``, gloo; writes what each rank warned, printed and found to ``rank{R}.json``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from typing import Any

import torch

from ckptverify.errors import CkptVerifyWarning
from ckptverify.hardware.inject import flip_bit_
from ckptverify.hardware.replica import ReplicaCheck
from ckptverify.ownfiles.events import EventLog

#: Steps at whose end rank 1 flips element 3, bit 20 of ``0.weight`` (twice in a row: the copy is restored).
FLIPS = (2, 4, 5)


def run(rank: int, world: int, out_dir: str, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    check = ReplicaCheck(model, events=EventLog(out_dir, rank=rank))
    err = io.StringIO()
    result: dict[str, Any] = {"found": []}
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            if rank == 1 and step in FLIPS:
                with torch.no_grad():
                    flip_bit_(model.module[0].weight, 3, 20)
            result["found"].append([m.step for m in check.check(step)])
        result["suspect"] = check.suspect()  # what a save now would record: the second episode is open
        check.finish()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, CkptVerifyWarning)]
    result["stderr"] = err.getvalue()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
