#!/usr/bin/env python
"""What checking a checkpoint right after a framework saved it costs, against the save itself.

Every framework integration (``ckptverify.integrations``) calls the same :meth:`Verifier.after_save` after the
framework's save returns. This times it for the ways a framework's checkpoint reaches it, on a model of
``--size-mib`` MiB of float32 weights plus AdamW's two moments (three times that on disk), each against its
baseline save, measured in the same run, with ``fingerprint="auto"`` (the default) and ``fingerprint=True``:

- ``torch.save`` file (Lightning ``.ckpt``): baseline ``torch.save``; every byte is under a CRC-32, so "auto"
  verifies and stamps, and True writes a manifest beside the file first;
- a Hugging Face style folder (transformers ``checkpoint-N``, accelerate ``save_state``): weights in
  ``model.safetensors`` (no checksum), moments in ``optimizer.pt``; baseline: writing both; "auto" fingerprints
  it (the weights could never be checked otherwise);
- DCP folder written by DCP's own writer (Lightning ``ModelParallelStrategy``): baseline ``dcp.save``;
- DCP folder written through ckptverify's hashing writer (torchtitan ``VerifiedCheckpointManager``): baseline
  ``dcp.save``; figure = (hashing save + verify + stamp) / plain save.

Then what a training loop waits for at each save, "save-return" (the save and ``after_save`` together), with
``fingerprint="auto"``: no verification (the baseline), inline, and ``verify="background"`` (the checkpoint is
queued for the background verifier and the call returns; the verification itself, timed apart as "background
done", runs in the verifier process, and each run waits for it before the next save, untimed).

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
    from safetensors.torch import save_file

    from ckptverify.checkpoint.save import save
    from ckptverify.integrations import Verifier

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sd = state(args.size_mib)
    weights = {k: v for k, v in sd.items() if k.startswith("model.")}
    moments = {k: v for k, v in sd.items() if not k.startswith("model.")}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = tempfile.mkdtemp(prefix="bench-integrations-")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    target = os.path.join(root, "step-1")

    def clear() -> None:
        shutil.rmtree(target, ignore_errors=True)
        for name in os.listdir(root):
            if name.startswith("step-1"):
                os.unlink(os.path.join(root, name))

    def save_file_ckpt() -> None:
        torch.save(sd, target)

    def save_folder() -> None:
        os.makedirs(target, exist_ok=True)
        save_file(weights, os.path.join(target, "model.safetensors"))
        torch.save(moments, os.path.join(target, "optimizer.pt"))

    def save_dcp() -> None:
        dcp.save(sd, checkpoint_id=target)

    def written(fn: Callable[[], None]) -> Callable[[], None]:
        return lambda: (clear(), fn())

    try:
        print(f"state: {nbytes / 2**20:.0f} MiB ({len(sd)} tensors); load average {os.getloadavg()[0]:.1f}; "
              f"{os.cpu_count()} CPUs; best of {args.repeats}")
        for label, fn in (("torch.save file", save_file_ckpt), ("safetensors folder", save_folder),
                          ("DCP (DCP's writer)", save_dcp)):
            t_save = best(fn, clear, args.repeats)
            for mode in ("auto", True):
                verifier = Verifier(events_dir=root, fingerprint=mode)
                t_check = best(lambda v=verifier: v.after_save(target, step=1), written(fn), args.repeats)
                print(f"{label:20s} save {t_save:7.3f} s   fingerprint={mode!s:5s} check {t_check:7.3f} s   "
                      f"check/save {t_check / t_save:6.2f}")
        from ckptverify.verifier.background import default_verifier

        inline = Verifier(events_dir=root)
        queued = Verifier(events_dir=root, verify="background")
        for label, fn in (("torch.save file", save_file_ckpt), ("safetensors folder", save_folder),
                          ("DCP (DCP's writer)", save_dcp)):
            t_none = best(fn, clear, args.repeats)
            t_inline = best(lambda f=fn: (f(), inline.after_save(target, step=1)), clear, args.repeats)
            seconds: list[float] = []  # how long each background verification took, in the verifier process

            def background(f: Callable[[], None] = fn) -> None:
                f()
                queued.after_save(target, step=1)

            def settle(seconds: list[float] = seconds) -> None:
                # The previous run's verification finishes, untimed, before the next save.
                seconds.extend(v.seconds for v in queued.wait() if v.passed)
                clear()

            settle()
            t_bg = best(background, settle, args.repeats)
            settle()
            print(f"{label:20s} save-return: no verification {t_none:7.3f} s   inline {t_inline:7.3f} s "
                  f"({t_inline / t_none:5.2f} x)   background {t_bg:7.3f} s ({t_bg / t_none:5.2f} x)   "
                  f"verified in the background in {min(seconds):7.3f} s ({len(seconds)} passed)")
        default_verifier().close(timeout=600)
        d_save = best(save_dcp, clear, args.repeats)
        verifier = Verifier(events_dir=root)
        h_all = best(lambda: (save(sd, target), verifier.after_save(target, step=1, fingerprint=False)), clear,
                     args.repeats)
        print(f"DCP (hashing writer) save + check {h_all:7.3f} s   against plain dcp.save {d_save:7.3f} s   "
              f"ratio {h_all / d_save:6.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
