"""Benchmark ``ckptverify verify`` against the read ceiling (``cat``) and common hashers, in one run.

    python scripts/bench_verify.py [--dir DIR] [--gib 4.0] [--repeats 3] [--keep]
    python scripts/bench_verify.py --items 100000 [--dir DIR] [--repeats 3] [--keep]
    python scripts/bench_verify.py --readers 4 [--gib 1.0] [--jobs-per-rank J] [--dir DIR] [--repeats 3] [--keep]

With ``--readers N`` it measures verify across ranks (``ckptverify verify --readers n``, n = 1..N) on one
page-cached checkpoint, in one run: for each rank count the best wall time of the whole command (the ranks'
start-up included), the verification's own time as rank 0 reports it (``stats.seconds``), the throughput of
both and its ratio to one rank, and the bytes each rank read (smallest and largest share, balance). On one
machine the ranks share its cores (each gets cores / n threads unless ``--jobs-per-rank``): the figures show
the cost of sharing the work out; the gain comes when the ranks run on nodes of their own.

    python scripts/bench_verify.py --rss-sizes 2,8 [--dir DIR] [--repeats 3]

With ``--rss-sizes`` it measures memory against size: for each size (GiB) it builds a checkpoint (64 MiB
tensors repeating a few random ones, so building it needs little memory), times ``cat`` and ``verify`` and
``verify`` against a manifest (``fingerprint`` first), prints each one's peak RSS (``wait4`` of the child)
and ratio to ``cat``, and deletes it before the next. Target: peak RSS independent of the checkpoint's size.

With ``--items N`` it measures the other end: a checkpoint of N small tensors (each its own DCP item, one
file), where the cost is per item, not per byte. It times ``torch.distributed.checkpoint``'s own
``FileSystemReader.read_metadata`` (the unrestricted ``pickle.load`` that verify replaces with its safe
reader), ``ckptverify verify`` (the whole command) and ``cat``, and prints verify's time as a ratio to
``read_metadata``'s, and the safe metadata reader's two paths (the C unpickler after the pass over the
bytes, and the pure-Python reference). Target: 100 000 items verified in at most 10 s on an idle machine.

Builds a multi-file DCP checkpoint of at least ``--gib`` GiB (``FileSystemWriter(thread_count=4)``),
reads it once so it sits in the page cache, then times, alternating the tools on every repeat:
``cat FILES > /dev/null`` (the read ceiling), ``ckptverify verify`` (the whole command: interpreter
start, metadata, structure, every CRC), ``verify`` of a hard-linked copy that carries a manifest (every byte
hashed once, by the manifest's block digests; small records also by CRC), ``sha256sum`` and ``b3sum`` when
installed. Prints the best throughput of each, its ratio to ``cat``, and verify's peak RSS. Targets: both
verify lines >= 0.9x cat on page-cached files; peak RSS <= 300 MiB. On a shared machine, run it more than
once: the ratios move with the load (``cat`` is one thread, verify uses every core).

The command's fixed cost (interpreter start-up and imports, about 0.1 s here) is a large share of a 1 GiB
run, where ``cat`` takes about 0.15 s; the default size is therefore 4 GiB. The same run measures that fixed
cost (the same two commands on a checkpoint of one small tensor) and prints verify with it taken off, and the
verification in-process (no start-up at all), without and with the manifest. The commands run with their
bytecode cached (in a folder of the work directory, ``PYTHONPYCACHEPREFIX``), as an installed package has it,
also where the environment says ``PYTHONDONTWRITEBYTECODE``: compiling the package from source at every start
would count as fixed cost what a user never pays.

It also prints what verify does per byte, each on one core in this process: the copy out of the page cache
(``preadv`` into a reused 1 MiB buffer, as verify reads), CRC-32 (ISA-L's and zlib's), xxh3-128 and sha256 on a
cached 1 MiB buffer, and the copy and a hash together.
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


def bytecode_env(workdir: str) -> dict[str, str]:
    """The environment with Python's bytecode cached under ``workdir`` (as an installed package has it), even
    where ``PYTHONDONTWRITEBYTECODE`` is set: the first run compiles, the others load."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(workdir, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def timed(cmd: list[str], cpu: list[float] | None = None,
          env: dict[str, str] | None = None) -> tuple[float, int, int]:
    """Wall seconds, peak RSS in KiB (from wait4), and exit code of ``cmd``; its CPU seconds (user + system)
    are appended to ``cpu`` when given."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if cpu is not None:
        cpu.append(usage.ru_utime + usage.ru_stime)
    return wall, usage.ru_maxrss, proc.returncode


def build_items(path: str, items: int) -> int:
    """A DCP checkpoint of ``items`` small tensors (four floats each: one item apiece, all of one shape)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(items)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def build_reused(path: str, gib: float, distinct: int = 8) -> int:
    """A DCP checkpoint of at least ``gib`` GiB whose 64 MiB tensors repeat ``distinct`` random ones, so building
    an 8 GiB checkpoint holds 512 MiB in memory, not 8 GiB (every item is still its own bytes on disk)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    count = -(-int(gib * (1 << 30)) // (64 << 20))
    pool = [torch.randn(16 << 20, generator=g) for _ in range(min(distinct, count))]
    state = {f"layers.{i}.weight": pool[i % distinct] for i in range(count)}
    state["step"] = torch.tensor(1000)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4))
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main_rss(args: argparse.Namespace, sizes: list[float]) -> int:
    """Peak RSS of ``verify`` (and of ``verify`` against a manifest) at each checkpoint size: it must not grow
    with the checkpoint's bytes. Each checkpoint is built, measured and deleted before the next."""
    workdir = args.dir or tempfile.mkdtemp(prefix="ckptverify-bench-rss-")
    here = os.path.dirname(os.path.abspath(__file__))
    exe = [sys.executable, "-m", "ckptverify"]
    rows = []
    try:
        for gib in sizes:
            ckpt = os.path.join(workdir, f"ckpt-{gib:g}")
            if os.path.isdir(ckpt):
                shutil.rmtree(ckpt)
            print(f"building a {gib:g} GiB checkpoint in {ckpt} ...", flush=True)
            code = (f"import sys; sys.path.insert(0, {here!r}); import bench_verify as b; "
                    f"print(b.build_reused({ckpt!r}, {gib}))")
            size = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                       .stdout.split()[-1])
            files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt))
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
            best: dict[str, float] = {}
            rss: dict[str, int] = {}
            for name, cmd in (("cat", ["cat", *files]), ("verify", [*exe, "verify", "--no-progress", "--json", ckpt])):
                for _ in range(args.repeats):
                    wall, peak, rc = timed(cmd)
                    if rc != 0:
                        print(f"{name} exited {rc} on {ckpt}", file=sys.stderr)
                        return 2
                    best[name] = min(best.get(name, float("inf")), wall)
                    rss[name] = max(rss.get(name, 0), peak)
            subprocess.run([*exe, "fingerprint", "--no-progress", ckpt], check=True, stdout=subprocess.DEVNULL)
            for _ in range(args.repeats):
                wall, peak, rc = timed([*exe, "verify", "--no-progress", "--json", ckpt])
                if rc != 0:
                    print(f"verify with manifest exited {rc} on {ckpt}", file=sys.stderr)
                    return 2
                best["manifest"] = min(best.get("manifest", float("inf")), wall)
                rss["manifest"] = max(rss.get("manifest", 0), peak)
            rows.append({"gib": size / (1 << 30), "verify_peak_rss_mib": rss["verify"] / 1024,
                         "manifest_peak_rss_mib": rss["manifest"] / 1024,
                         "verify_over_cat": best["cat"] / best["verify"],
                         "manifest_over_cat": best["cat"] / best["manifest"], "load_average": os.getloadavg()[0]})
            shutil.rmtree(ckpt)
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"{'checkpoint GiB':>15}{'verify peak RSS MiB':>21}{'with manifest MiB':>19}{'verify x cat':>14}"
          f"{'manifest x cat':>16}{'load':>6}")
    for r in rows:
        print(f"{r['gib']:>15.2f}{r['verify_peak_rss_mib']:>21.0f}{r['manifest_peak_rss_mib']:>19.0f}"
              f"{r['verify_over_cat']:>14.2f}{r['manifest_over_cat']:>16.2f}{r['load_average']:>6.1f}")
    if len(rows) > 1:
        grow = max(r["verify_peak_rss_mib"] for r in rows) - min(r["verify_peak_rss_mib"] for r in rows)
        grow_m = max(r["manifest_peak_rss_mib"] for r in rows) - min(r["manifest_peak_rss_mib"] for r in rows)
        print(f"peak RSS from {rows[0]['gib']:.2f} to {rows[-1]['gib']:.2f} GiB grows by {grow:.0f} MiB (verify), "
              f"{grow_m:.0f} MiB (with manifest): independent of size where both stay within a few MiB")
    print(json.dumps({"rss_by_size": rows}))
    return 0


def _best_in_child(code: str) -> float:
    """Run ``code`` (which prints a number of seconds last) in a fresh interpreter; that number."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.split()[-1])


def main_items(args: argparse.Namespace) -> int:
    workdir = args.dir or tempfile.mkdtemp(prefix="ckptverify-bench-items-")
    ckpt = os.path.join(workdir, "ckpt")
    if os.path.isdir(ckpt):
        shutil.rmtree(ckpt)
    print(f"building a checkpoint of {args.items} small tensors in {ckpt} ...", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {here!r}); import bench_verify as b; "
            f"print(b.build_items({ckpt!r}, {args.items}))")
    size = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
               .stdout.split()[-1])
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt))
    meta = os.path.getsize(os.path.join(ckpt, ".metadata"))
    print(f"{len(files)} files, {size / (1 << 20):.1f} MiB ({meta / (1 << 20):.1f} MiB of metadata)", flush=True)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)

    best: dict[str, float] = {}
    rss = 0
    cpu: list[float] = []
    for _ in range(args.repeats):
        wall, peak, code_ = timed(["cat", *files])
        best["cat"] = min(best.get("cat", float("inf")), wall)
        wall, peak, code_ = timed([sys.executable, "-m", "ckptverify", "verify", "--no-progress", "--json", ckpt],
                                  cpu)
        if code_ != 0:
            print(f"ckptverify verify exited {code_} on the clean benchmark checkpoint", file=sys.stderr)
            return 2
        best["ckptverify verify"] = min(best.get("ckptverify verify", float("inf")), wall)
        rss = max(rss, peak)
    repeat = f"for _ in range({args.repeats}):\n"
    best["dcp read_metadata"] = _best_in_child(
        "import time, torch.distributed.checkpoint as dcp\nbest = float('inf')\n" + repeat
        + f"    t0 = time.perf_counter(); dcp.FileSystemReader({ckpt!r}).read_metadata()\n"
        "    best = min(best, time.perf_counter() - t0)\nprint(best)")
    best["verify (in-process core)"] = _best_in_child(
        "import time\nfrom ckptverify.audit.verify import verify_checkpoint\nbest = float('inf')\n" + repeat
        + f"    t0 = time.perf_counter(); r = verify_checkpoint({ckpt!r})\n"
        "    best = min(best, time.perf_counter() - t0)\n"
        f"assert r.passed and r.stats['items'] == {args.items} and r.stats['bytes_hashed'] > 0, r.stats\nprint(best)")
    for name, fn in (("safe metadata read (C path)", "parse"), ("safe metadata read (reference)", "parse_reference")):
        best[name] = _best_in_child(
            "import time\nfrom ckptverify.dcp import metadata_pickle as sp\n"
            f"data = open({os.path.join(ckpt, '.metadata')!r}, 'rb').read()\nbest = float('inf')\n" + repeat
            + f"    t0 = time.perf_counter(); sp.{fn}(data); best = min(best, time.perf_counter() - t0)\nprint(best)")

    base = best["dcp read_metadata"]
    print()
    print(f"{'step':<34}{'best s':>9}{'x read_metadata':>17}{'us/item':>9}")
    for name, t in best.items():
        print(f"{name:<34}{t:>9.3f}{t / base:>17.2f}{t / args.items * 1e6:>9.1f}")
    total = best["ckptverify verify"]
    print()
    print(f"verify of {args.items} items: {total:.2f} s = {total / base:.2f}x dcp read_metadata, "
          f"{total / best['cat']:.0f}x cat; {min(cpu):.2f} s of CPU (the wall time of an idle machine: verify "
          f"runs on one core here); peak RSS {rss / 1024:.0f} MiB")
    if args.items >= 100_000:
        per_100k = total * 100_000 / args.items
        cpu_100k = min(cpu) * 100_000 / args.items
        print(f"target <= 10 s per 100 000 items (idle machine): {per_100k:.2f} s wall, {cpu_100k:.2f} s CPU: "
              f"{'MET' if per_100k <= 10 else 'NOT MET'} (load average now {os.getloadavg()[0]:.1f})")
    print(json.dumps({"items": args.items, "bytes": size, "metadata_bytes": meta, "seconds": best,
                      "verify_cpu_seconds": min(cpu),
                      "verify_over_read_metadata": total / base, "verify_peak_rss_mib": rss / 1024,
                      "load_average": os.getloadavg()[0]}))
    if not args.keep and args.dir is None:
        shutil.rmtree(workdir)
    return 0


def build_cached(args: argparse.Namespace, prefix: str) -> tuple[str, str, list[str], int]:
    """Build a checkpoint of at least ``args.gib`` GiB under ``args.dir`` (or a new temporary directory named
    ``prefix...``) and read it once so it sits in the page cache: (workdir, checkpoint, its files, bytes).

    Built in a child process, so this process stays small: a child forked from a large parent would report the
    parent's pages in its peak RSS."""
    workdir = args.dir or tempfile.mkdtemp(prefix=prefix)
    ckpt = os.path.join(workdir, "ckpt")
    if os.path.isdir(ckpt):
        shutil.rmtree(ckpt)
    print(f"building a >= {args.gib} GiB checkpoint in {ckpt} ...", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import bench_verify as b; print(b.build({ckpt!r}, {args.gib}))"
    size = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
               .stdout.split()[-1])
    files = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt))
    print(f"{len(files)} files, {size / (1 << 30):.2f} GiB; warming the page cache", flush=True)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return workdir, ckpt, files, size


def main_readers(args: argparse.Namespace) -> int:
    """Throughput of ``verify`` per rank count, 1..``args.readers``, on one checkpoint."""
    workdir, ckpt, files, size = build_cached(args, "ckptverify-bench-readers-")
    rows = []
    for n in range(1, args.readers + 1):
        cmd = [sys.executable, "-m", "ckptverify", "verify", "--no-progress", "--json", ckpt]
        if n > 1:
            cmd += ["--readers", str(n)]
        if args.jobs_per_rank:
            cmd += ["--jobs", str(args.jobs_per_rank)]
        best_wall, best_core, stats = float("inf"), float("inf"), {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if out.returncode != 0:
                print(f"verify with {n} rank(s) exited {out.returncode}: {out.stderr[-2000:]}", file=sys.stderr)
                return 2
            data = json.loads(out.stdout)
            best_wall = min(best_wall, wall)
            if data["stats"]["seconds"] < best_core:
                best_core, stats = data["stats"]["seconds"], data["stats"]
        ranks = stats.get("ranks") or [{"rank": 0, "bytes_read": stats["bytes"], "units": None}]
        shares = [r["bytes_read"] for r in ranks]
        rows.append({"ranks": n, "wall_s": best_wall, "verify_s": best_core, "wall_gbps": size / best_wall / 1e9,
                     "verify_gbps": size / best_core / 1e9, "bytes_per_rank": shares,
                     "balanced": (stats.get("balance") or {"met": True})["met"], "jobs": stats.get("jobs"),
                     "checkpoint_bytes": stats["bytes"]})
    one = rows[0]
    print()
    print(f"{'ranks':>5}{'threads/rank':>13}{'wall s':>8}{'GB/s':>7}{'x 1':>6}{'verify s':>10}{'GB/s':>7}{'x 1':>6}"
          f"{'least share':>13}{'largest':>9}  balanced")
    for r in rows:
        least, most = min(r["bytes_per_rank"]) / size, max(r["bytes_per_rank"]) / size
        print(f"{r['ranks']:>5}{r['jobs']!s:>13}{r['wall_s']:>8.2f}{r['wall_gbps']:>7.2f}"
              f"{r['wall_gbps'] / one['wall_gbps']:>6.2f}{r['verify_s']:>10.2f}{r['verify_gbps']:>7.2f}"
              f"{r['verify_gbps'] / one['verify_gbps']:>6.2f}{least:>13.1%}{most:>9.1%}  {r['balanced']}")
    print()
    print(f"bytes per rank sum to the checkpoint's {one['checkpoint_bytes']} bytes (its files, .metadata aside): "
          f"{all(sum(r['bytes_per_rank']) == r['checkpoint_bytes'] for r in rows)}; cores here: {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(json.dumps({"bytes": size, "files": len(files), "rows": rows, "load_average": os.getloadavg()[0]}))
    if not args.keep and args.dir is None:
        shutil.rmtree(workdir)
    return 0


def per_byte_costs(path: str, seconds: float = 0.25) -> dict[str, float]:
    """GB/s on one core (this thread) of each per-byte step of verify: the copy out of the page cache of
    ``path`` (``preadv`` into a reused 1 MiB buffer), each checksum on a 1 MiB buffer in cache, and the copy
    followed by each checksum (what a verify thread does per piece). Best of a few timed passes each."""
    import hashlib
    import mmap
    import zlib

    import xxhash

    from ckptverify.safeparse.readers import READ_BYTES

    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:  # pragma: no cover - isal is a dependency
        isal_crc32 = None
    buf = mmap.mmap(-1, READ_BYTES)
    view = memoryview(buf)
    view[:] = os.urandom(READ_BYTES)
    hashes = {"crc32 (isal)": isal_crc32, "crc32 (zlib)": zlib.crc32,
              "xxh3-128 (xxhash, streaming)": lambda v: xxhash.xxh3_128(v).hexdigest(),
              "sha256 (hashlib)": lambda v: hashlib.sha256(v).hexdigest()}
    out: dict[str, float] = {}

    def rate(step: object) -> float:
        best = 0.0
        for _ in range(3):
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / 3:
                n += step()  # type: ignore[operator]
            best = max(best, n / (time.perf_counter() - start) / 1e9)
        return best

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = [0]

        def copy() -> int:  # round and round the file (cached: read once, before the timings)
            got = os.preadv(fd, [view], pos[0])
            pos[0] = pos[0] + got if pos[0] + got < size else 0
            return got

        out["copy from page cache (preadv, 1 MiB)"] = rate(copy)
        for name, fn in hashes.items():
            if fn is None:
                continue
            out[name] = rate(lambda fn=fn: (fn(view), READ_BYTES)[1])
        for name in ("crc32 (isal)", "xxh3-128 (xxhash, streaming)"):
            fn = hashes[name]
            if fn is not None:
                out[f"copy + {name}"] = rate(lambda fn=fn: (copy(), fn(view))[0])
    finally:
        os.close(fd)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to build the checkpoint [a temporary directory]")
    ap.add_argument("--gib", type=float, default=4.0, help="checkpoint size in GiB, at least 1 [4.0]")
    ap.add_argument("--items", type=int, default=None,
                    help="instead: a checkpoint of this many small tensors, per-item costs [off]")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per tool [3]")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    ap.add_argument("--readers", type=int, default=None,
                    help="instead: verify throughput with 1..N ranks (verify --readers), bytes per rank [off]")
    ap.add_argument("--jobs-per-rank", type=int, default=None,
                    help="with --readers: threads per rank [the machine's cores / ranks]")
    ap.add_argument("--rss-sizes", default=None, metavar="GIB,GIB",
                    help="instead: peak RSS of verify at each of these checkpoint sizes, e.g. 2,8 [off]")
    args = ap.parse_args(argv)
    if args.readers is not None:
        if args.readers < 1 or args.gib <= 0:
            ap.error("--readers must be at least 1 and --gib above 0")
        return main_readers(args)
    if args.rss_sizes:
        try:
            sizes = [float(x) for x in args.rss_sizes.split(",")]
        except ValueError:
            ap.error("--rss-sizes takes sizes in GiB separated by commas, e.g. 2,8")
        if not sizes or min(sizes) <= 0:
            ap.error("--rss-sizes must be positive")
        return main_rss(args, sizes)
    if args.items is not None:
        if args.items < 1:
            ap.error("--items must be at least 1")
        return main_items(args)
    if args.gib <= 0:
        ap.error("--gib must be above 0")
    if args.gib < 1:
        print(f"--gib {args.gib}: the command's fixed cost dominates below 1 GiB; the figures say little")

    # Verified in-process (below) in a child process too, so this process stays small.
    workdir, ckpt, files, size = build_cached(args, "ckptverify-bench-")
    env = bytecode_env(workdir)

    exe = [sys.executable, "-m", "ckptverify"]
    here = os.path.dirname(os.path.abspath(__file__))
    # The fixed cost: a checkpoint of one small tensor, verified by the same commands.
    tiny = os.path.join(workdir, "tiny")
    if os.path.isdir(tiny):
        shutil.rmtree(tiny)
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import bench_verify as b; "
                    f"b.build({tiny!r}, {1 / 1024})"], check=True, capture_output=True, env=env)
    # Copies of both checkpoints that carry a manifest (hard links: same page-cached bytes).
    copies = {}
    for src in (ckpt, tiny):
        dst = src + "-manifest"
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        os.mkdir(dst)
        for name in os.listdir(src):
            os.link(os.path.join(src, name), os.path.join(dst, name))
        subprocess.run([*exe, "fingerprint", "--no-progress", dst], check=True, stdout=subprocess.DEVNULL, env=env)
        copies[src] = dst
    with_manifest = copies[ckpt]
    verify = [*exe, "verify", "--no-progress", "--json"]
    tools: dict[str, list[str]] = {
        "cat": ["cat", *files],
        "ckptverify verify": [*verify, ckpt],
        "verify with manifest": [*verify, with_manifest],
        "sha256sum": ["sha256sum", *files],
    }
    if shutil.which("b3sum"):
        tools["b3sum"] = ["b3sum", *files]
    else:
        print("b3sum not installed: skipped")
    fixed_tools = {"verify fixed cost": [*verify, tiny], "with manifest fixed cost": [*verify, copies[tiny]]}
    for cmd in fixed_tools.values():  # compiles the bytecode once, untimed
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)

    # The same verification in-process (timed inside a child, after its imports: no start-up), in the same
    # alternation as the commands, so the load moves all figures alike; in a child so this process stays small.
    in_process = {"verify (in-process core)": ckpt, "with manifest (in-process core)": with_manifest}

    def in_process_seconds(path: str) -> float:
        code = (
            "import time; from ckptverify.audit.verify import verify_checkpoint\n"
            f"t0 = time.perf_counter(); r = verify_checkpoint({path!r}); print(time.perf_counter() - t0)\n"
            "assert r.passed and r.stats['bytes_hashed'] > 0.99 * r.stats['bytes'], r.stats\n"
            f"assert r.stats['manifest'] is {path == with_manifest}, r.stats"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"verify failed on the clean benchmark checkpoint: {out.stderr[-2000:]}")
        return float(out.stdout.split()[-1])

    best: dict[str, float] = {}
    rss: dict[str, int] = {}
    core: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, cmd in {**tools, **fixed_tools}.items():
            wall, peak, code = timed(cmd, env=env)
            if code != 0:
                print(f"{name} exited {code}", file=sys.stderr)
                return 2
            best[name] = min(best.get(name, float("inf")), wall)
            rss[name] = max(rss.get(name, 0), peak)
        for name, path in in_process.items():
            try:
                core[name] = min(core.get(name, float("inf")), in_process_seconds(path))
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 2

    gbs = {name: size / t / 1e9 for name, t in best.items() if name not in fixed_tools}
    # Each command with its fixed cost taken off (measured in this run, on the tiny checkpoint).
    net = {"verify, fixed cost off": best["ckptverify verify"] - best["verify fixed cost"],
           "with manifest, fixed cost off": best["verify with manifest"] - best["with manifest fixed cost"]}
    print()
    print(f"{'tool':<32}{'best s':>9}{'GB/s':>8}{'x cat':>8}{'peak RSS MiB':>14}")
    for name in tools:
        print(f"{name:<32}{best[name]:>9.3f}{gbs[name]:>8.2f}{gbs[name] / gbs['cat']:>8.2f}{rss[name] / 1024:>14.1f}")
    for name in fixed_tools:
        print(f"{name:<32}{best[name]:>9.3f}{'':>8}{'':>8}{rss[name] / 1024:>14.1f}")
    for name, t in {**net, **core}.items():
        if t <= 0:  # the difference of two noisy timings: no figure
            print(f"{name:<32}{t:>9.3f}{'n/a':>8}{'n/a':>8}{'':>14}")
            continue
        rate = size / t / 1e9
        print(f"{name:<32}{t:>9.3f}{rate:>8.2f}{rate / gbs['cat']:>8.2f}{'':>14}")
    ratio = gbs["ckptverify verify"] / gbs["cat"]
    ratio_m = gbs["verify with manifest"] / gbs["cat"]
    # None where the difference is not above zero: the fixed cost's noise swamps the work (a small checkpoint).
    ratio_net = {k: best["cat"] / t if t > 0 else None for k, t in net.items()}
    ratio_core = {k: best["cat"] / t for k, t in core.items()}
    peak = rss["ckptverify verify"] / 1024
    peak_m = rss["verify with manifest"] / 1024

    def met(value: float | None, target: float) -> str:
        if value is None:
            return "cannot tell (the fixed cost's noise exceeds the work: use a larger --gib)"
        return "MET" if value >= target else "NOT MET"

    def x(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    print()
    print(f"verify / cat = {ratio:.2f}x whole command, {x(ratio_net['verify, fixed cost off'])}x with the fixed "
          f"cost ({best['verify fixed cost']:.3f} s) off, {ratio_core['verify (in-process core)']:.2f}x in-process "
          f"(target >= 1.00): {met(ratio, 1.0)} / {met(ratio_net['verify, fixed cost off'], 1.0)} / "
          f"{met(ratio_core['verify (in-process core)'], 1.0)}")
    print(f"verify with manifest / cat = {ratio_m:.2f}x whole command, "
          f"{x(ratio_net['with manifest, fixed cost off'])}x with the fixed cost "
          f"({best['with manifest fixed cost']:.3f} s) off, {ratio_core['with manifest (in-process core)']:.2f}x "
          f"in-process (target >= 0.90): {met(ratio_m, 0.9)} / {met(ratio_net['with manifest, fixed cost off'], 0.9)}"
          f" / {met(ratio_core['with manifest (in-process core)'], 0.9)}")
    print(f"verify peak RSS = {peak:.0f} MiB, with manifest {peak_m:.0f} MiB (target <= 300): "
          f"{'MET' if max(peak, peak_m) <= 300 else 'NOT MET'}")
    costs = per_byte_costs(max(files, key=os.path.getsize))
    print()
    print(f"per byte, one core (this process): {'step':<40}{'GB/s':>8}")
    for name, rate in costs.items():
        print(f"{'':<35}{name:<40}{rate:>8.2f}")
    load = os.getloadavg()[0]
    print(f"cores: {os.cpu_count()}, load average {load:.1f} (ratios move with the load: cat is one thread, "
          "verify uses every core)")
    print(json.dumps({"bytes": size, "files": len(files), "gbps": gbs, "verify_core_gbps": size / core[
                          "verify (in-process core)"] / 1e9,
                      "verify_manifest_core_gbps": size / core["with manifest (in-process core)"] / 1e9,
                      "fixed_cost_s": best["verify fixed cost"],
                      "manifest_fixed_cost_s": best["with manifest fixed cost"],
                      "verify_over_cat": ratio, "verify_net_over_cat": ratio_net["verify, fixed cost off"],
                      "verify_core_over_cat": ratio_core["verify (in-process core)"],
                      "verify_peak_rss_mib": peak,
                      "verify_manifest_over_cat": ratio_m,
                      "verify_manifest_net_over_cat": ratio_net["with manifest, fixed cost off"],
                      "verify_manifest_core_over_cat": ratio_core["with manifest (in-process core)"],
                      "verify_manifest_peak_rss_mib": peak_m, "per_byte_gbps": costs, "load_average": load}))
    if not args.keep and args.dir is None:
        shutil.rmtree(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
