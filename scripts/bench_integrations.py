#!/usr/bin/env python
"""What checking a checkpoint right after a framework saved it costs, against the save itself.

Every framework integration (``ckptverify.integrations``) calls the same :meth:`Verifier.after_save` after the
framework's save returns. This times it for the three ways a framework's checkpoint reaches it, on a model of
``--size-mib`` MiB of float32 weights plus AdamW's two moments (three times that on disk), each against its
baseline save, measured in the same run:

- ``torch.save`` file (Lightning ``.ckpt``; accelerate and transformers write the same archives): baseline
  ``torch.save``; check = verify (every record's CRC-32) + stamp;
- DCP folder written by DCP's own writer (Lightning ``ModelParallelStrategy``): baseline ``dcp.save``; check =
  fingerprint (manifest) + verify against it + stamp, two reads of the checkpoint;
- DCP folder written through ckptverify's hashing writer (torchtitan ``VerifiedCheckpointManager``): baseline
  ``dcp.save``; figure = (hashing save + verify + stamp) / plain save.

The checkpoint has just been written, so it is read from the page cache, as it is right after a real save.
Each figure is the best of ``--repeats`` runs.

    python scripts/bench_integrations.py
    python scripts/bench_integrations.py --size-mib 64 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable

import torch


def state(size_mib: int) -> dict[str, torch.Tensor]:
    """Weights of ``size_mib`` MiB in 8 square float32 matrices, and two AdamW moments for each."""
    torch.manual_seed(0)
    side = int((size_mib * (1 << 20) / 4 / 8) ** 0.5)
    out: dict[str, torch.Tensor] = {}
    for i in range(8):
        w = torch.randn(side, side)
        out[f"model.layers.{i}.weight"] = w
        out[f"optim.state.{i}.exp_avg"] = torch.randn_like(w) * 1e-3
        out[f"optim.state.{i}.exp_avg_sq"] = torch.rand_like(w) * 1e-6
    return out


def best(fn: Callable[[], object], prepare: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    import torch.distributed.checkpoint as dcp

    from ckptverify.integrations import Verifier
    from ckptverify.saving import save

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sd = state(args.size_mib)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = tempfile.mkdtemp(prefix="bench-integrations-")
    verifier = Verifier(events_dir=root)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    file = os.path.join(root, "step=1.ckpt")
    folder = os.path.join(root, "step-1")

    def clear() -> None:
        shutil.rmtree(folder, ignore_errors=True)
        for name in os.listdir(root):
            if name.startswith("step=1.ckpt"):
                os.unlink(os.path.join(root, name))

    def written_file() -> None:
        clear()
        torch.save(sd, file)

    def written_dcp() -> None:
        clear()
        dcp.save(sd, checkpoint_id=folder)

    try:
        print(f"state: {nbytes / 2**20:.0f} MiB ({len(sd)} tensors); load average {os.getloadavg()[0]:.1f}; "
              f"{os.cpu_count()} CPUs; best of {args.repeats}")
        t_save = best(lambda: torch.save(sd, file), clear, args.repeats)
        t_check = best(lambda: verifier.after_save(file, step=1), written_file, args.repeats)
        print(f"torch.save file      save {t_save:7.3f} s   check {t_check:7.3f} s   "
              f"check/save {t_check / t_save:5.2f}")
        d_save = best(lambda: dcp.save(sd, checkpoint_id=folder), clear, args.repeats)
        d_check = best(lambda: verifier.after_save(folder, step=1), written_dcp, args.repeats)
        print(f"DCP (DCP's writer)   save {d_save:7.3f} s   check {d_check:7.3f} s   check/save {d_check / d_save:5.2f}"
              "   (fingerprint + verify)")
        h_all = best(lambda: (save(sd, folder), verifier.after_save(folder, step=1, fingerprint=False)), clear,
                     args.repeats)
        print(f"DCP (hashing writer) save+check {h_all:7.3f} s   against plain dcp.save {d_save:7.3f} s   "
              f"ratio {h_all / d_save:5.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
