"""Benchmark the per-item costs of ``verify`` and ``fingerprint`` on checkpoints of many small items, in one run.

    python scripts/bench_items.py [--items 100000] [--layout one|per|both] [--cache DIR] [--repeats 3]
                                  [--no-load] [--profile] [--compare-with CHECKOUT]

Builds, once into ``--cache`` (kept between runs: building 100 000 files takes minutes), DCP checkpoints of
``--items`` tensors of four floats each (one item apiece): ``one`` saved one file for all
(``FileSystemWriter(single_file_per_rank=True)``), ``per`` one file per item (``single_file_per_rank=False``).
For each layout it times, alternating the tools on every repeat, in fresh interpreters:

- DCP's own ``FileSystemReader.read_metadata`` (the unrestricted ``pickle.load`` verify replaces with its
  safe reader): the baseline the ratios are given against;
- DCP's own ``dcp.load`` of the whole state dict (once: it takes longer than the rest; ``--no-load`` skips it);
- ``ckptverify verify --json`` (the whole command: start-up, metadata, structure, every CRC);
- ``ckptverify fingerprint --force`` on a hard-linked copy (verify, then digest every item and file,
  fingerprint every tensor, write the manifest);
- ``ckptverify verify --json`` of that copy, against its manifest.

Prints the best wall time of each, the CPU time (user + system) of that process (on an idle machine the wall
time is about the CPU time: the per-item work runs mostly on one core), the ratio to ``read_metadata``,
microseconds per item, and the peak RSS; then the targets (100 000 items: verify <= 10 s, fingerprint <=
15 s, on an idle machine) and the load average the run saw. ``--profile`` writes a cProfile of one verify and
one fingerprint of each layout beside the cache (``--jobs 1``, so the profile sees the workers' share too).
``--compare-with CHECKOUT`` times another source checkout's verify and fingerprint in the same run
(alternating), so before/after ratios share the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The checkout this script belongs to: what the lines not marked ``(compared)`` time.
CHECKOUT = os.path.dirname(HERE)


def build(path: str, items: int, per_item: bool) -> None:
    """A DCP checkpoint of ``items`` tensors of four floats at ``path`` (one file per item if ``per_item``)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.full((4,), float(i)) for i in range(items)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save, as intended
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1, single_file_per_rank=not per_item))


def ensure(cache: str, layout: str, items: int) -> str:
    """The checkpoint of ``layout`` in ``cache``, built if absent (a marker beside it says it is complete)."""
    path = os.path.join(cache, f"{layout}-{items}")
    done = path + ".complete"
    if os.path.exists(done) and os.path.isdir(path):
        return path
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(cache, exist_ok=True)
    print(f"building {path} ({items} items, {'one file per item' if layout == 'per' else 'one file'}) ...",
          flush=True)
    t0 = time.perf_counter()
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import bench_items as b; "
            f"b.build({path!r}, {items}, {layout == 'per'})")
    subprocess.run([sys.executable, "-c", code], check=True)
    open(done, "w").close()
    print(f"  built in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def linked_copy(src: str, dst: str) -> None:
    """``dst``: hard links to every file of ``src`` (same page-cached bytes), made once."""
    if os.path.exists(dst + ".complete"):
        return
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.mkdir(dst)
    with os.scandir(src) as entries:
        for e in entries:
            if e.is_file(follow_symlinks=False):
                os.link(e.path, os.path.join(dst, e.name))
    open(dst + ".complete", "w").close()


def checkout_env(checkout: str) -> dict[str, str]:
    """The environment that runs ``python -m ckptverify`` from the source checkout ``checkout``."""
    return {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}


def timed(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> tuple[float, float, float, int]:
    """Wall seconds, CPU seconds (user + system), peak RSS in MiB and exit code of ``cmd``, run in ``cwd``
    (``python -m`` puts its working directory first on the import path: run from a checkout, it would import
    that checkout whatever ``PYTHONPATH`` says, so the tools run in the cache folder)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else b""
    code = os.waitstatus_to_exitcode(status)
    if code not in (0,):
        sys.stderr.write(err.decode(errors="replace")[-2000:])
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, code


def read_metadata_cmd(path: str) -> list[str]:
    return [sys.executable, "-c", "import torch.distributed.checkpoint as dcp\n"
            f"dcp.FileSystemReader({path!r}).read_metadata()"]


def load_cmd(path: str) -> list[str]:
    return [sys.executable, "-c", "import warnings, torch, torch.distributed.checkpoint as dcp\n"
            "warnings.simplefilter('ignore')\n"
            f"md = dcp.FileSystemReader({path!r}).read_metadata()\n"
            "sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}\n"
            f"dcp.load(sd, storage_reader=dcp.FileSystemReader({path!r}))"]


def bench_layout(args: argparse.Namespace, layout: str) -> dict[str, dict[str, float]]:
    path = ensure(args.cache, layout, args.items)
    adopted = path + "-adopted"
    linked_copy(path, adopted)
    subprocess.run(["cat", os.path.join(path, ".metadata")], stdout=subprocess.DEVNULL, check=True)
    exe = [sys.executable, "-m", "ckptverify"]
    tools = {
        "dcp read_metadata": read_metadata_cmd(path),
        "ckptverify verify": [*exe, "verify", "--no-progress", "--json", path],
        "ckptverify fingerprint": [*exe, "fingerprint", "--force", "--no-progress", "--json", adopted],
        "verify with manifest": [*exe, "verify", "--no-progress", "--json", adopted],
    }
    envs: dict[str, dict[str, str] | None] = dict.fromkeys(tools, checkout_env(CHECKOUT))
    if args.compare_with:
        other = checkout_env(args.compare_with)
        for name in ("ckptverify verify", "ckptverify fingerprint", "verify with manifest"):
            tools[f"{name} (compared)"] = tools[name]
            envs[f"{name} (compared)"] = other
    best: dict[str, dict[str, float]] = {}
    loads: list[float] = []
    for _ in range(args.repeats):
        for name, cmd in tools.items():
            loads.append(os.getloadavg()[0])
            wall, cpu, rss, code = timed(cmd, envs[name], cwd=args.cache)
            if code != 0:
                raise SystemExit(f"{name} exited {code} on the clean benchmark checkpoint {path}")
            got = best.get(name)
            if got is None or wall < got["wall"]:
                best[name] = {"wall": wall, "cpu": cpu, "rss_mib": rss}
    if not args.no_load:
        loads.append(os.getloadavg()[0])
        wall, cpu, rss, code = timed(load_cmd(path), cwd=args.cache)
        if code != 0:
            raise SystemExit(f"dcp.load exited {code}")
        best["dcp.load (once)"] = {"wall": wall, "cpu": cpu, "rss_mib": rss}
    base = best["dcp read_metadata"]["wall"]
    files = len(os.listdir(path))
    print()
    print(f"layout {layout!r}: {args.items} items, {files} files; best of {args.repeats}; "
          f"load average {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
    print(f"{'step':<26}{'best s':>9}{'CPU s':>8}{'x read_metadata':>17}{'us/item':>9}{'peak RSS MiB':>14}")
    for name, b in best.items():
        print(f"{name:<26}{b['wall']:>9.2f}{b['cpu']:>8.2f}{b['wall'] / base:>17.2f}"
              f"{b['wall'] / args.items * 1e6:>9.1f}{b['rss_mib']:>14.0f}")
    scale = 100_000 / args.items
    for name, target in (("ckptverify verify", 10.0), ("ckptverify fingerprint", 15.0)):
        b = best[name]
        print(f"target {name.split()[1]} <= {target:.0f} s per 100 000 items (idle machine): {b['wall'] * scale:.2f} s "
              f"wall, {b['cpu'] * scale:.2f} s CPU: {'MET' if b['cpu'] * scale <= target else 'NOT MET'} "
              "(judged by CPU time: the wall time of an idle machine)")
    for name in best:
        best[name]["load_min"] = min(loads)
        best[name]["load_max"] = max(loads)
    return best


def profile(args: argparse.Namespace, layout: str) -> None:
    path = ensure(args.cache, layout, args.items)
    adopted = path + "-adopted"
    linked_copy(path, adopted)
    for what, target, extra in (("verify", path, []), ("fingerprint", adopted, ["--force"])):
        out = os.path.join(args.cache, f"{layout}-{args.items}.{what}.prof")
        subprocess.run([sys.executable, "-m", "cProfile", "-o", out, "-m", "ckptverify", what, *extra, "--jobs", "1",
                        "--no-progress", "--json", target], stdout=subprocess.DEVNULL, check=False,
                       env=checkout_env(CHECKOUT), cwd=args.cache)
        print(f"wrote {out} (python -m pstats {out})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=100_000, help="tensors per checkpoint [100000]")
    ap.add_argument("--layout", choices=("one", "per", "both"), default="both",
                    help="one file for all items, one file per item, or both [both]")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ckptverify-bench-items"),
                    help="where the checkpoints are built once and kept [$TMPDIR/ckptverify-bench-items]")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per tool [3]")
    ap.add_argument("--no-load", action="store_true", help="skip the dcp.load baseline")
    ap.add_argument("--profile", action="store_true", help="write cProfiles instead of timing")
    ap.add_argument("--compare-with", default=None, metavar="CHECKOUT",
                    help="also time verify and fingerprint of this source checkout (its root on PYTHONPATH), "
                         "alternating with this one, lines marked (compared)")
    args = ap.parse_args(argv)
    args.cache = os.path.abspath(args.cache)  # the tools run there (see timed)
    if args.items < 1 or args.repeats < 1:
        ap.error("--items and --repeats must be at least 1")
    layouts = ["one", "per"] if args.layout == "both" else [args.layout]
    if args.profile:
        for layout in layouts:
            profile(args, layout)
        return 0
    results = {layout: bench_layout(args, layout) for layout in layouts}
    print(json.dumps({"items": args.items, "repeats": args.repeats, "cores": os.cpu_count(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
