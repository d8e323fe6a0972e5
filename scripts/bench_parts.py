"""Benchmark a save's verification and fingerprinting shared out among nodes against one process doing it whole.

    python scripts/bench_parts.py [--nodes 4] [--mib 256] [--layout dcp|folder] [--dir DIR] [--repeats 3] [--keep]

Builds a DCP checkpoint of ``--mib`` MiB in ``--nodes`` files, as ``--nodes`` nodes of one rank each would write
it (``FileSystemWriter(thread_count=nodes)``: one file per node in the plan), reads it once so it sits in the
page cache. ``--layout folder`` builds instead the ``checkpoint-N`` of an FSDP save by transformers or
accelerate: the model and the optimizer in two DCP folders of ``--nodes`` files each (half the bytes each; node
k gets file k of both), beside RNG states, a scheduler and a trainer state. Then it times, best of
``--repeats``:

- ``verify`` whole: :func:`~ckptverify.audit.verify.verify_checkpoint`, one process, every file;
- ``verify`` in parts: each other node's part (:func:`~ckptverify.verifier.parts.part_job`) and the coordinator
  (:func:`~ckptverify.verifier.parts.stamp_parts_locked`: the whole checkpoint's checks, its own file,
  gathering, the stamp);
- ``fingerprint`` whole: :func:`~ckptverify.audit.adopt.fingerprint_checkpoint` (verify, digest, scan, write the
  manifest), one process;
- ``fingerprint`` in parts: each other node's part with the plan's ``fingerprint=True`` (verify, digest and scan
  its file) and the coordinator's adoption from the parts (:func:`~ckptverify.verifier.saved.saved_job`);
- ``verify --deep`` whole, and in parts (the plan's ``deep``: each node also rebuilds and fingerprints the tensor
  pieces in its file and records their scans; the coordinator verifies deeply as one process does, those pieces
  answered from the records). It checks that the deep check in
  parts rebuilt as many tensors as the one made whole.

The parts run one after another in this process: on a cluster they run at once, one per node, so the time a
save's verification takes there is the slowest part plus the coordinator's (which starts with its own file while
the others run, then waits). The script prints each side's seconds, the bytes each node read (from the stamp's
``parts``), and the ratio of ``max(part) + coordinator`` to the whole-checkpoint time: below 1 is what sharing
out gains; it tends to ``1 / nodes`` plus the coordinator's fixed cost as files grow. It checks that the manifest
written from the parts is the one written whole (but its time), and that each node opened only its own file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

#: The DCP folders of an FSDP ``checkpoint-N`` (``--layout folder``).
SUBS = ("optimizer_0", "pytorch_model_fsdp_0")


def _save(path: str, nodes: int, mib: int, prefix: str = "layer") -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    per = max(1, (mib << 20) // 4 // (4 * nodes))  # float32 elements per tensor, four tensors per node
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"{prefix}{k}.w": torch.randn(per, generator=gen) for k in range(4 * nodes)}
    state["step"] = 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=nodes), no_dist=True)


def _build(root: str, nodes: int, mib: int, layout: str) -> str:
    if layout == "dcp":
        path = os.path.join(root, "ckpt")
        _save(path, nodes, mib)
    else:
        import torch

        path = os.path.join(root, "checkpoint-100")
        for sub in SUBS:
            _save(os.path.join(path, sub), nodes, mib // 2, prefix=f"{sub}.layer")
        for k in range(nodes):
            torch.save({"cpu": torch.get_rng_state()}, os.path.join(path, f"rng_state_{k}.pth"))
        torch.save({"last_epoch": 100}, os.path.join(path, "scheduler.pt"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"global_step": 100}, f)
    for name in _files(path):  # into the page cache
        with open(os.path.join(path, name), "rb") as f:
            while f.read(1 << 24):
                pass
    return path


def _files(path: str) -> list[str]:
    """Every file of the checkpoint (``SUB/FILE`` in a DCP folder of a folder), ckptverify's own left out."""
    from ckptverify.formats.describe import is_own_file

    out = []
    for name in sorted(os.listdir(path)):
        if os.path.isdir(os.path.join(path, name)):
            out += [f"{name}/{n}" for n in sorted(os.listdir(os.path.join(path, name))) if not is_own_file(n)]
        elif not is_own_file(name):
            out.append(name)
    return out


def _tidy(path: str) -> None:
    from ckptverify.formats.describe import is_own_file

    for where in [path, *(os.path.join(path, s) for s in SUBS if os.path.isdir(os.path.join(path, s)))]:
        for name in os.listdir(where):
            if is_own_file(name):
                os.unlink(os.path.join(where, name))


def _plan(path: str, nodes: int, fingerprint: Any, deep: bool = False) -> list[list[str]]:
    """Node k gets the k-th ``.distcp`` file (of each DCP folder, in a folder of checkpoint files)."""
    from ckptverify.ownfiles.partsplan import make_plan, write_plan

    shards = [n for n in _files(path) if n.endswith(".distcp")]
    groups = sorted({os.path.dirname(n) for n in shards})
    by_group = [[n for n in shards if os.path.dirname(n) == g] for g in groups]
    if any(len(g) != nodes for g in by_group):
        raise SystemExit(f"expected {nodes} files in each DCP folder, DCP wrote: {shards}")
    files = [[g[k] for g in by_group] for k in range(nodes)]
    write_plan(path, {**make_plan([f"node{k}" for k in range(nodes)], files),
                      "fingerprint": fingerprint, **({"deep": True} if deep else {})})
    return files


def _in_parts(path: str, nodes: int, fingerprint: Any, deep: bool = False) -> tuple[list[float], float, dict[str, Any]]:
    """Each other node's part, then the coordinator's side: their seconds, and the stamp."""
    from ckptverify.verifier.parts import part_job
    from ckptverify.verifier.saved import saved_job

    _tidy(path)
    _plan(path, nodes, fingerprint, deep)
    parts = []
    for k in range(1, nodes):
        t0 = time.perf_counter()
        out = part_job(path, k, jobs=1, wait_s=0)
        parts.append(time.perf_counter() - t0)
        if not out.get("written"):
            raise SystemExit(f"node {k}'s part wrote nothing: {out}")
    t0 = time.perf_counter()
    result = saved_job(path, 1, fingerprint, 1, deep, 0.0, parts=True)
    coordinator = time.perf_counter() - t0
    if result["event"] != "checkpoint-verified":
        raise SystemExit(f"the coordinator's side did not pass: {json.dumps(result)[:2000]}")
    from ckptverify.ownfiles.names import STAMP_FILE

    with open(os.path.join(path, STAMP_FILE)) as f:
        stamp = json.load(f)
    return parts, coordinator, stamp


def _top(path: str) -> set[str]:
    """The files at the top of a folder of checkpoint files (none in a DCP folder but its metadata)."""
    return {n for n in _files(path) if "/" not in n and not n.endswith(".distcp")}


def _manifests(path: str) -> dict[str, Any]:
    """Every manifest of the checkpoint (a folder's and each of its DCP folders'), by where it lies, without the
    time it was written and what covers it."""
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest

    out = {}
    for sub in ["", *SUBS]:
        if os.path.isfile(os.path.join(path, sub, MANIFEST_FILE)):
            d = read_manifest(os.path.join(path, sub)).to_dict()
            d.pop("created"), d.pop("self_digest", None)
            d["items"] = sorted(d["items"], key=lambda e: (e["file"], e["offset"]))
            out[sub] = d
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where to build the checkpoint (default: a temporary folder)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=("dcp", "folder"), default="dcp",
                        help="a DCP folder, or an FSDP checkpoint-N with DCP folders inside")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.audit.verify import verify_checkpoint

    root = tempfile.mkdtemp(prefix="bench-parts-", dir=args.dir)
    try:
        path = _build(root, args.nodes, args.mib, args.layout)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in _files(path))
        best: dict[str, float] = {}
        sides: dict[str, tuple[list[float], float]] = {}
        stamps: dict[str, dict[str, Any]] = {}
        manifests: dict[str, Any] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)

        for _ in range(args.repeats):
            _tidy(path)
            t0 = time.perf_counter()
            if not verify_checkpoint(path, jobs=1).passed:
                raise SystemExit("the checkpoint does not verify")
            keep("verify whole", time.perf_counter() - t0)
            _tidy(path)
            t0 = time.perf_counter()
            fingerprint_checkpoint(path, jobs=1, trust_uncheckable=True)
            manifests["whole"] = _manifests(path)
            keep("fingerprint whole", time.perf_counter() - t0)
            _tidy(path)
            t0 = time.perf_counter()
            deep = verify_checkpoint(path, jobs=1, deep=True)
            keep("verify --deep whole", time.perf_counter() - t0)
            rebuilt = {"whole": [c.count for c in deep.coverage if c.check == "fingerprint"]}
            for what, fingerprint, deep_parts in (("verify", False, False), ("fingerprint", True, False),
                                                  ("verify --deep", False, True)):
                parts, coordinator, stamp = _in_parts(path, args.nodes, fingerprint, deep_parts)
                if deep_parts:
                    rebuilt["parts"] = [c["count"] for c in stamp["coverage"] if c["check"] == "fingerprint"]
                name = f"{what} in parts"
                if max(parts) + coordinator < best.get(name, float("inf")):
                    sides[name] = (parts, coordinator)
                    stamps[name] = stamp
                keep(name, max(parts) + coordinator)
                if fingerprint is True:
                    manifests["parts"] = _manifests(path)

        same = manifests["whole"] == manifests["parts"] and bool(manifests["whole"])
        held = f"{args.nodes} files (one per node)" if args.layout == "dcp" else \
            f"an FSDP checkpoint-N: {len(SUBS)} DCP folders of {args.nodes} files each (one per node) and " \
            f"{len(_files(path)) - len(SUBS) * (args.nodes + 1)} files of its own"
        print(f"checkpoint: {size / 2**20:.1f} MiB in {held}, page-cached; best of {args.repeats}; one worker "
              "thread per side")
        for what in ("verify", "fingerprint", "verify --deep"):
            whole, name = best[f"{what} whole"], f"{what} in parts"
            parts, coordinator = sides[name]
            opened = [p.get("opened") for p in stamps[name]["parts"]]
            per_node = [p.get("bytes") for p in stamps[name]["parts"]]
            # The coordinator also opens the files of the checkpoint's own (a folder's RNG states, scheduler, ...).
            own_only = all(o == p["files"] if k else not set(o) & set(_files(path)) - _top(path) - set(p["files"])
                           for k, (o, p) in enumerate(zip(opened, stamps[name]["parts"], strict=True)))
            print(f"{what:>13} whole: {whole:.3f} s ({size / whole / 2**20:.0f} MiB/s)")
            print(f"{what:>13} in parts: other nodes {', '.join(f'{s:.3f}' for s in parts)} s; coordinator "
                  f"{coordinator:.3f} s; slowest part + coordinator {max(parts) + coordinator:.3f} s = "
                  f"{(max(parts) + coordinator) / whole:.2f}x whole")
            print(f"{'':>13} bytes read per node: {', '.join(f'{(b or 0) / 2**20:.1f}' for b in per_node)} MiB; "
                  f"each node opened only its own files: {own_only}")
        deep_same = rebuilt["whole"] == rebuilt["parts"] != [0]
        print(f"tensors rebuilt by the deep check, whole and in parts: {rebuilt['whole']} and {rebuilt['parts']}: "
              f"{'same' if deep_same else 'DIFFERENT'}")
        print(f"manifest{'s' if args.layout == 'folder' else ''} from the parts == written whole: {same}")
        return 0 if same and deep_same else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
