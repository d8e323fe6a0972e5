#!/usr/bin/env python
"""Inject faults into a DCP checkpoint directory, for testing checkpoint verification.

The command line of ``tests/helpers/faults.py`` (the library the tests use), which this script imports and
re-exports, so ``import inject_fault`` with ``scripts/`` on the path still gives the library::

    python scripts/inject_fault.py CKPT flip-payload --fqn model.0.weight --element 10 --bit 30
    python scripts/inject_fault.py CKPT truncate --file __0_0.distcp --nbytes 1
    python scripts/inject_fault.py --help

The command line prints the fault description as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.faults import *  # noqa: F403 (the library, re-exported for `import inject_fault`)
from helpers.faults import (
    MALICIOUS_VIA,
    ZIP_HEADER_FIELDS,
    Fault,
    InjectError,
    add_extra_file,
    append_bytes,
    delete_file,
    delete_metadata,
    flip_bit,
    flip_in_bytes_item,
    flip_in_tensor_payload,
    flip_in_zip_header,
    malicious_metadata,
    swap_same_size_files,
    truncate,
    zero_page,
)


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="checkpoint directory (changed in place)")
    sub = parser.add_subparsers(dest="fault", required=True)

    p = sub.add_parser("flip-bit", help="flip one bit of one byte of a file")
    p.add_argument("--file", required=True)
    p.add_argument("--offset", type=int, required=True)
    p.add_argument("--bit", type=int, default=0)

    p = sub.add_parser("flip-payload", help="flip a bit of one element of a tensor payload")
    p.add_argument("--fqn")
    p.add_argument("--element", type=int)
    p.add_argument("--bit", type=int, help="bit of the element, 0 = least significant")
    p.add_argument("--seed", type=int, help="pick item, element and bit at random")

    p = sub.add_parser("flip-bytes-item", help="flip a bit in a non-tensor item's pickle")
    p.add_argument("--fqn")

    p = sub.add_parser("flip-zip-header", help="flip a bit in a zip header field")
    p.add_argument("--which", choices=ZIP_HEADER_FIELDS, default="local")
    p.add_argument("--fqn")

    p = sub.add_parser("truncate", help="cut bytes off the end of a file")
    p.add_argument("--file")
    p.add_argument("--nbytes", type=int)

    p = sub.add_parser("delete-file", help="delete one file")
    p.add_argument("--file")

    p = sub.add_parser("add-extra-file", help="add a file no metadata references")
    p.add_argument("--name", default="__0_99.distcp")

    p = sub.add_parser("append-bytes", help="append unreferenced bytes to a file")
    p.add_argument("--file")

    sub.add_parser("swap-same-size-files", help="exchange two equal-size .distcp files")

    p = sub.add_parser("zero-page", help="zero a 4 KiB page (default: inside a tensor payload)")
    p.add_argument("--file")
    p.add_argument("--offset", type=int)

    sub.add_parser("delete-metadata", help="delete .metadata / __N.metadata")

    p = sub.add_parser("malicious-metadata", help="replace .metadata with a code-running pickle")
    p.add_argument("--canary", required=True, help="file the pickle would create if ever loaded")
    p.add_argument("--via", choices=MALICIOUS_VIA, default="open")
    p.add_argument("--nested", action="store_true")

    args = parser.parse_args(argv)
    ckpt = args.ckpt
    actions: dict[str, Callable[[], Fault]] = {
        "flip-bit": lambda: flip_bit(ckpt, args.file, args.offset, args.bit),
        "flip-payload": lambda: flip_in_tensor_payload(ckpt, args.fqn, args.element, args.bit, args.seed),
        "flip-bytes-item": lambda: flip_in_bytes_item(ckpt, args.fqn),
        "flip-zip-header": lambda: flip_in_zip_header(ckpt, args.which, args.fqn),
        "truncate": lambda: truncate(ckpt, args.file, args.nbytes),
        "delete-file": lambda: delete_file(ckpt, args.file),
        "add-extra-file": lambda: add_extra_file(ckpt, args.name),
        "append-bytes": lambda: append_bytes(ckpt, args.file),
        "swap-same-size-files": lambda: swap_same_size_files(ckpt),
        "zero-page": lambda: zero_page(ckpt, args.file, args.offset),
        "delete-metadata": lambda: delete_metadata(ckpt),
        "malicious-metadata": lambda: malicious_metadata(ckpt, args.canary, args.via, args.nested),
    }
    try:
        fault = actions[args.fault]()
    except (InjectError, OSError) as exc:
        print(f"inject_fault: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(fault.to_dict(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
