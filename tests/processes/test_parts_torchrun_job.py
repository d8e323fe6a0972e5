"""A production job on two nodes, started as torchrun starts it (one agent per node): each checkpoint's background
verification is shared out among the nodes that wrote it and stamped once from both parts. The same with gloo ranks
as nodes: ``test_parts_among_nodes.py``; each side in one process: ``test_parts_verdicts.py``.

Real torchrun agents, not ranks from the test's fork server: that torchrun's node rank tells two agents on one host
apart as two nodes is part of what is tested.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.names import PARTS_PREFIX
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import parts as parts_mod

# ---------------------------------------------------------------------------------- a production job on two nodes

PRODUCTION_SCRIPT = Path(__file__).resolve().parents[1] / "user_scripts" / "production_train.py"


def _two_node_job(run_dir: Path, steps: int, save_every: int, *extra: str) -> None:
    """The production script started as torchrun starts it on two nodes: one agent per node, one rank each (both
    agents on this machine: torchrun's node rank tells them apart)."""
    import subprocess
    import sys

    from helpers.ports import on_a_free_port

    env = {**os.environ, "CKPTVERIFY_VERIFY_THROTTLE": "0", parts_mod.PART_TIMEOUT_ENV: "240"}
    env.pop(parts_mod.NODE_ENV, None)

    def start(port: int) -> tuple[list[int | None], list[str]]:
        agents = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={k}", "--nproc-per-node=1",
             "--master-addr=127.0.0.1", f"--master-port={port}", str(PRODUCTION_SCRIPT), "--run-dir", str(run_dir),
             "--steps", str(steps), "--save-every", str(save_every), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for k in (0, 1)]
        outputs = [a.communicate(timeout=600)[0] for a in agents]
        return [a.returncode for a in agents], outputs

    def taken(result: tuple[list[int | None], list[str]]) -> bool:
        return any("EADDRINUSE" in o or "address already in use" in o for o in result[1])

    codes, outputs = on_a_free_port(start, taken)
    assert codes == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)


@pytest.mark.slow
@pytest.mark.parametrize("deep", [False, True])
def test_a_production_run_on_two_nodes_stamps_each_checkpoint_once_from_both_parts(tmp_path: Path,
                                                                                    deep: bool) -> None:
    run = tmp_path / "run"
    _two_node_job(run, 4, 2, *(["--deep"] if deep else []))
    for step in (2, 4):
        ckpt = run / f"step_{step}"
        stamp = read_stamp(ckpt)
        assert stamp is not None and stamp.current and stamp.passed and stamp.step == step
        assert stamp.data["deep"] is deep
        if deep:  # every tensor of the TrainState rebuilt from both nodes' pieces
            rebuilt = [c["count"] for c in stamp.data["coverage"] if c["check"] == "fingerprint"]
            whole = verify_checkpoint(ckpt, deep=True)
            assert rebuilt == [c.count for c in whole.coverage if c.check == "fingerprint"] and rebuilt[0] > 0
        parts = stamp.data["parts"]
        assert [p["ranks"] for p in parts] == [[0], [1]] and parts[0]["host"] != parts[1]["host"], parts
        # Rank r's node opened only what rank r wrote.
        assert [p["opened"] for p in parts] == [sorted(n for n in os.listdir(ckpt) if n.startswith(f"__{r}_"))
                                                for r in (0, 1)]
        assert not [n for n in os.listdir(ckpt) if n.startswith(PARTS_PREFIX)]
    verified = [(e["step"], e["rank"]) for e in read_events(run, "checkpoint-verified")]
    assert sorted(verified) == [(2, 0), (4, 0)], verified
