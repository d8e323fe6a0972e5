"""What proving every item while loading costs: ``ckptverify.load``'s DCP read with and without the proof, as
ratios against plain ``dcp.load``, in one run.

    python scripts/bench_load.py [--mb 256] [--repeat 3]

A state dict of float32 tensors (``--mb`` MiB in all) is saved with a manifest into a temporary directory, then
loaded (best of ``--repeat``, warm page cache) by

- ``dcp.load`` with DCP's own ``FileSystemReader`` (the baseline, which checks nothing);
- the same load through :class:`~ckptverify.dcp.storage_reader.SafeFileSystemReader` (no proof);
- :class:`~ckptverify.dcp.storage_reader.ProvingFileSystemReader` with the manifest (xxh3-128 digests);
- :class:`~ckptverify.dcp.storage_reader.ProvingFileSystemReader` without it (every zip record's CRC-32).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.distributed.checkpoint as dcp

    import ckptverify as cv
    from ckptverify.dcp.loading import SafeLoadPlanner
    from ckptverify.dcp.storage_reader import ProvingFileSystemReader, SafeFileSystemReader
    from ckptverify.ownfiles.manifest import read_manifest

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    n = max(1, args.mb // 16)
    per = 16 * (1 << 20) // 4
    state = {f"layer{i}.weight": torch.randn(per) for i in range(n)}
    state["meta"] = {"step": 7, "note": "bench"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        cv.save(state, path)
        manifest = read_manifest(path)

        def template() -> dict:
            return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}

        def timed(reader_of) -> float:
            best = float("inf")
            for _ in range(args.repeat):
                sd = template()
                started = time.perf_counter()
                dcp.load(sd, storage_reader=reader_of(), planner=SafeLoadPlanner())
                best = min(best, time.perf_counter() - started)
                assert torch.equal(sd["layer0.weight"], state["layer0.weight"])
            return best

        timed(lambda: dcp.FileSystemReader(path))  # warm the page cache
        base = timed(lambda: dcp.FileSystemReader(path))
        rows = [("dcp.load (FileSystemReader, no checks)", base),
                ("SafeFileSystemReader (no proof)", timed(lambda: SafeFileSystemReader(path))),
                ("ProvingFileSystemReader, manifest (xxh3-128)",
                 timed(lambda: ProvingFileSystemReader(path, manifest))),
                ("ProvingFileSystemReader, no manifest (zip CRC-32)", timed(lambda: ProvingFileSystemReader(path)))]
    size = n * per * 4
    print(f"load of {size / 2**20:.0f} MiB in {n} tensors, best of {args.repeat}, warm page cache")
    for name, seconds in rows:
        print(f"  {name:<52} {seconds:8.3f} s  {size / seconds / 2**30:6.2f} GiB/s  x{seconds / base:5.2f}")


if __name__ == "__main__":
    main()
