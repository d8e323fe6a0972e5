"""How ranks start: from a fork server that already imported torch and ckptverify, yet each rank a fresh process
with the launcher's environment as it is at the launch, nothing of an earlier run's state, and CUDA never
initialised before the workload asks for it."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from ckptverify.resume.launch import launch_jobs, start_method
from ckptverify.resume.run import RunConfig

SCRIPT = textwrap.dedent('''
    import json
    import os

    import torch

    import ckptverify as cv

    CALLS = []


    def train(run):
        run.restore(cv.TrainState(model=torch.nn.Linear(2, 2)))
        CALLS.append(1)  # module state: a fresh process per launch starts it empty
        out = os.environ["PROBE_OUT"]
        with open(os.path.join(out, f"{os.environ['PROBE_NAME']}-rank{run.rank}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "calls": len(CALLS),
                       "probe": os.environ.get("PROBE_VALUE"), "gone": "PROBE_GONE" in os.environ,
                       "cuda_initialized": torch.cuda.is_initialized(), "threads": torch.get_num_threads()}, f)
''')


def _launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, nproc: int = 2) -> list[dict]:
    script = tmp_path / "probe_train.py"
    script.write_text(SCRIPT)
    target = f"{script}:train"
    monkeypatch.setenv("PROBE_NAME", name)
    config = RunConfig(name=name, stop_step=1, workload=target, log_dir=str(tmp_path / "logs"))
    launch_jobs(nproc, "cpu", [(target, config)])
    return [json.loads((tmp_path / "out" / f"{name}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.skipif(start_method() != "forkserver", reason="no fork server on this platform")
def test_ranks_are_fresh_processes_with_the_launchers_environment_of_the_moment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("PROBE_VALUE", "first")
    monkeypatch.setenv("PROBE_GONE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = _launch(tmp_path, monkeypatch, "A")
    # Changed after the fork server started: the next launch's ranks see the launcher's environment as it is now.
    monkeypatch.setenv("PROBE_VALUE", "second")
    monkeypatch.delenv("PROBE_GONE")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = _launch(tmp_path, monkeypatch, "B")
    assert [r["probe"] for r in first] == ["first", "first"] and all(r["gone"] for r in first)
    assert [r["probe"] for r in second] == ["second", "second"] and not any(r["gone"] for r in second)
    assert [r["threads"] for r in first] == [1, 1] and [r["threads"] for r in second] == [2, 2]
    pids = {r["pid"] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids  # four fresh processes
    assert all(r["calls"] == 1 for r in first + second)  # no module state carried from one launch to the next
    assert all(not r["cuda_initialized"] for r in first + second)
    # Forked from the server, which had imported torch: no rank paid the import.
    assert all(r["ppid"] != os.getpid() for r in first + second)
