"""Benchmark ``ckptverify verify`` against the read ceiling (``cat``) and common hashers, in one run.

    python scripts/bench_verify.py [--dir DIR] [--gib 4.0] [--repeats 3] [--keep]

Builds a multi-file DCP checkpoint of at least ``--gib`` GiB (``FileSystemWriter(thread_count=4)``),
reads it once so it sits in the page cache, then times, alternating the tools on every repeat:
``cat FILES > /dev/null`` (the read ceiling), ``ckptverify verify`` (the whole command: interpreter
start, metadata, structure, every CRC), ``verify`` of a hard-linked copy that carries a manifest (every byte
hashed once, by the manifest's block digests; small records also by CRC), ``sha256sum`` and ``b3sum`` when
installed. Prints the best throughput of each, its ratio to ``cat``, and verify's peak RSS. Targets: both
verify lines >= 0.9x cat on page-cached files; peak RSS <= 300 MiB. On a shared machine, run it more than
once: the ratios move with the load (``cat`` is one thread, verify uses every core).

The command's fixed cost (interpreter start-up and imports, about 0.1 s here) is a large share of a 1 GiB
run, where ``cat`` takes about 0.15 s; the default size is therefore 4 GiB. The in-process line shows the
verification alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def build(path: str, gib: float) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    total = int(gib * (1 << 30))
    tensor_bytes = 64 << 20
    g = torch.Generator().manual_seed(0)
    state = {}
    i = 0
    while sum(t.numel() * t.element_size() for t in state.values()) < total:
        n = min(tensor_bytes, total - i * tensor_bytes) // 4
        state[f"layers.{i}.weight"] = torch.randn(max(n, 1), generator=g)
        i += 1
    state["step"] = torch.tensor(1000)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4))
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def timed(cmd: list[str]) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in KiB (from wait4), and exit code of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to build the checkpoint [a temporary directory]")
    ap.add_argument("--gib", type=float, default=4.0, help="checkpoint size in GiB, at least 1 [4.0]")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per tool [3]")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = ap.parse_args(argv)
    if args.gib < 1:
        ap.error("--gib must be at least 1")

    workdir = args.dir or tempfile.mkdtemp(prefix="ckptverify-bench-")
    ckpt = os.path.join(workdir, "ckpt")
    if os.path.isdir(ckpt):
        shutil.rmtree(ckpt)
    print(f"building a >= {args.gib} GiB checkpoint in {ckpt} ...", flush=True)
    # Built (and verified in-process, below) in child processes, so this process stays small: a child
    # forked from a large parent would report the parent's pages in its peak RSS.
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import bench_verify as b; print(b.build({ckpt!r}, {args.gib}))"
    size = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
               .stdout.split()[-1])
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt))
    print(f"{len(files)} files, {size / (1 << 30):.2f} GiB; warming the page cache", flush=True)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

    exe = [sys.executable, "-m", "ckptverify"]
    # A copy of the checkpoint that carries a manifest (hard links: same page-cached bytes).
    with_manifest = os.path.join(workdir, "ckpt-manifest")
    if os.path.isdir(with_manifest):
        shutil.rmtree(with_manifest)
    os.mkdir(with_manifest)
    for name in os.listdir(ckpt):
        os.link(os.path.join(ckpt, name), os.path.join(with_manifest, name))
    subprocess.run([*exe, "fingerprint", "--no-progress", with_manifest], check=True, stdout=subprocess.DEVNULL)
    tools: dict[str, list[str]] = {
        "cat": ["cat", *files],
        "ckptverify verify": [*exe, "verify", "--no-progress", "--json", ckpt],
        "verify with manifest": [*exe, "verify", "--no-progress", "--json", with_manifest],
        "sha256sum": ["sha256sum", *files],
    }
    if shutil.which("b3sum"):
        tools["b3sum"] = ["b3sum", *files]
    else:
        print("b3sum not installed: skipped")

    best: dict[str, float] = {}
    rss: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, cmd in tools.items():
            wall, peak, code = timed(cmd)
            if code != 0:
                print(f"{name} exited {code}", file=sys.stderr)
                return 2
            best[name] = min(best.get(name, float("inf")), wall)
            rss[name] = max(rss.get(name, 0), peak)

    # The same verification in-process, without interpreter start-up, for reference.
    code = (
        "import time; from ckptverify.verify import verify_checkpoint\n"
        f"best = float('inf')\nfor _ in range({args.repeats}):\n"
        f"    t0 = time.perf_counter(); r = verify_checkpoint({ckpt!r}); best = min(best, time.perf_counter() - t0)\n"
        "assert r.passed and r.stats['bytes_hashed'] > 0.99 * r.stats['bytes'], r.stats\nprint(best)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        print("verify failed on the clean benchmark checkpoint:", out.stderr[-2000:], file=sys.stderr)
        return 2
    core = float(out.stdout.split()[-1])

    gbs = {name: size / t / 1e9 for name, t in best.items()}
    print()
    print(f"{'tool':<26}{'best s':>9}{'GB/s':>8}{'x cat':>8}{'peak RSS MiB':>14}")
    for name in tools:
        print(f"{name:<26}{best[name]:>9.3f}{gbs[name]:>8.2f}{gbs[name] / gbs['cat']:>8.2f}{rss[name] / 1024:>14.1f}")
    core_gbs = size / core / 1e9
    print(f"{'verify (in-process core)':<26}{core:>9.3f}{core_gbs:>8.2f}{core_gbs / gbs['cat']:>8.2f}{'':>14}")
    ratio = gbs["ckptverify verify"] / gbs["cat"]
    peak = rss["ckptverify verify"] / 1024
    print()
    print(f"verify / cat = {ratio:.2f}x (target >= 0.90): {'MET' if ratio >= 0.9 else 'NOT MET'}")
    print(f"verify peak RSS = {peak:.0f} MiB (target <= 300): {'MET' if peak <= 300 else 'NOT MET'}")
    ratio_m = gbs["verify with manifest"] / gbs["cat"]
    peak_m = rss["verify with manifest"] / 1024
    print(f"verify with manifest / cat = {ratio_m:.2f}x (target >= 0.90): {'MET' if ratio_m >= 0.9 else 'NOT MET'}"
          f"; peak RSS {peak_m:.0f} MiB")
    print(json.dumps({"bytes": size, "files": len(files), "gbps": gbs, "verify_core_gbps": core_gbs,
                      "verify_over_cat": ratio, "verify_peak_rss_mib": peak,
                      "verify_manifest_over_cat": ratio_m, "verify_manifest_peak_rss_mib": peak_m}))
    if not args.keep and args.dir is None:
        shutil.rmtree(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
