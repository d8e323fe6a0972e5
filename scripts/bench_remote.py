"""Benchmark ``verify`` of a DCP checkpoint at an ``s3://`` URL against a plain ranged download, in one run.

    python scripts/bench_remote.py [--mib 512] [--repeats 3]

Starts moto's S3 server on a local port (``pip install -e '.[test]'`` brings it), writes a DCP checkpoint of
about ``--mib`` MiB there with torch's fsspec writer, then times, alternating on every repeat:

* ``download``: every object fetched with s3fs (``cat_file``, the client's own parallel ranged reads), bytes
  discarded: the read ceiling of this client against this server;
* ``ranged 8 MiB``: the same objects fetched in 8 MiB ranges, 16 in flight (what verify's reads are);
* ``verify s3``: ``verify_checkpoint`` of the URL in this process (ranged GETs, every CRC);
* ``verify local``: ``verify_checkpoint`` of a local copy (page-cached), for the same checkpoint.

Prints the best throughput of each, verify's ratio to the download, the requests and bytes verify made (from
the report's ``stats.storage``), and peak RSS. Against moto on the same machine this measures the client's
overhead (request handling, Python, hashing), not a real store's bandwidth or latency: moto serves from
memory over loopback, through a single Python process.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from helpers.remote_s3 import MotoS3, apply_env

    server = MotoS3()
    apply_env(server.env())
    import s3fs
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from ckptverify.audit.verify import verify_checkpoint

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("bench")
    per = 16 << 20
    n = max(1, int(args.mib * (1 << 20) // per))
    state = {f"t{i}": torch.randn(per // 4) for i in range(n)}
    url = "s3://bench/ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FsspecWriter(url, thread_count=4))
    del state
    keys = fs.find("bench/ckpt")
    total = sum(fs.size(k) for k in keys)
    local = tempfile.mkdtemp(prefix="bench-remote-")
    fs.get("bench/ckpt/", local + "/", recursive=True)

    def download() -> None:
        for k in keys:
            fs.cat_file(k)

    step = 8 << 20
    ranges = [(k, a, min(a + step, fs.size(k))) for k in keys for a in range(0, fs.size(k), step)]

    def ranged() -> None:
        for i in range(0, len(ranges), 16):  # 16 in flight, as verify's pool
            part = ranges[i: i + 16]
            fs.cat_ranges([r[0] for r in part], [r[1] for r in part], [r[2] for r in part])

    best: dict[str, float] = {}
    storage: dict[str, int] = {}
    for _ in range(args.repeats):
        tools = (("download", download), ("ranged 8 MiB", ranged), ("verify s3", lambda: verify_checkpoint(url)),
                 ("verify local", lambda: verify_checkpoint(local)))
        for name, fn in tools:
            started = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - started
            if out is not None:
                assert out.passed, [f.message for f in out.findings]
                storage = out.stats.get("storage", storage)
            best[name] = min(best.get(name, float("inf")), seconds)
    print(f"checkpoint: {len(keys)} objects, {total / 2**20:.0f} MiB, moto at {server.endpoint}; "
          f"best of {args.repeats}; {os.cpu_count()} cores")
    for name, seconds in best.items():
        print(f"  {name:13s} {total / seconds / 2**20:8.1f} MiB/s  ({seconds:.2f} s)")
    print(f"  verify s3 / download: {best['download'] / best['verify s3']:.2f}x; verify s3 / ranged download: "
          f"{best['ranged 8 MiB'] / best['verify s3']:.2f}x; "
          f"verify s3 / verify local: {best['verify local'] / best['verify s3']:.2f}x")
    print(f"  verify s3 made {storage.get('requests')} ranged requests, {storage.get('bytes', 0) / 2**20:.0f} MiB, "
          f"{storage.get('retries')} retries")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (moto's store included)")
    server.stop()


if __name__ == "__main__":
    main()
