"""Several ``ckptverify`` commands, one after another, in the ranks of one torchrun launch.

    python -m torch.distributed.run --nproc-per-node N tests/helpers/ranked_verify_runs.py OUT ARGS_JSON...

Each ``ARGS_JSON`` is one command's arguments (a JSON list, e.g. ``["verify", PATH, "--json"]``). Every rank
runs the commands in order through the CLI (``ckptverify.cli.main``, in this process), with torchrun's
environment as the rank has it, so each command runs across the ranks exactly as ``torchrun -m ckptverify ...``
runs it: rank 0 hosting nothing (torchrun's agent hosts the store), every rank reading its share, rank 0 printing
the one report. Each rank writes ``OUT/rank<R>.json``: per command, its exit code, stdout and stderr.

One launch serves several checkpoints: a torchrun launch starts N + 1 interpreters that each import torch.
The agent's store outlives each command, as it outlives a restart of the ranks: like a restarted worker group's,
each command's keys get a namespace of their own (the restart count ckptverify puts in its keys' prefix).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(out: str, commands: list[list[str]]) -> int:
    from click.testing import CliRunner

    from ckptverify.cli import main as cli

    rank = int(os.environ["RANK"])
    base = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    results = []
    for n, args in enumerate(commands):
        result = CliRunner().invoke(cli, args, env={"TORCHELASTIC_RESTART_COUNT": f"{base}.{n}"})
        error = None
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            error = "".join(traceback.format_exception(result.exception))
        results.append({"args": args, "exit_code": result.exit_code, "stdout": result.stdout,
                        "stderr": result.stderr, "error": error})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], [json.loads(a) for a in sys.argv[2:]]))
