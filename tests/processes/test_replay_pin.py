"""A run directory is data: `replay` runs only the training function its caller names, on a bounded number of
ranks, whatever `run.json` says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.inproc_cli import Done, invoke

from ckptverify.errors import UsageError
from ckptverify.replay.replay import replay


def _run_dir(tmp_path: Path, **meta: object) -> tuple[Path, Path]:
    """A run directory whose run.json names a planted script that leaves a mark when it is imported."""
    mark = tmp_path / "planted-code-ran"
    planted = tmp_path / "planted.py"
    planted.write_text(f"open({str(mark)!r}, 'w').write('ran')\n\ndef train(run):\n    pass\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"target": f"{planted}:train", "world_size": 1, "level": "state",
                                              "steps": 6, **meta}))
    return run, mark


def _cli(*args: str) -> Done:
    # In this process: the command's words and exit code are the point, and each is refused before any rank starts.
    return invoke(*args)


def test_replay_without_a_named_target_runs_nothing_and_says_what_run_json_records(tmp_path: Path) -> None:
    run, mark = _run_dir(tmp_path)
    done = _cli("replay", "--no-locate", str(run))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "a run directory is data" in done.stderr.lower() and f"--target {tmp_path / 'planted.py'}:train" in (
        done.stderr.replace("\n", " ").replace("  ", " ")), done.stderr
    assert "Traceback" not in done.stderr and not mark.exists()
    as_json = _cli("replay", "--no-locate", str(run), "--json")
    assert as_json.returncode == 2 and "--target" in json.loads(as_json.stdout)["error"] and not mark.exists()
    with pytest.raises(UsageError, match="A run directory is data"):
        replay(run)
    assert not mark.exists()


@pytest.mark.parametrize("world", [100_000, 0, "2", True, 2.0, None])
def test_a_world_size_that_is_no_bounded_rank_count_is_refused_before_anything_runs(tmp_path: Path,
                                                                                    world: object) -> None:
    run, mark = _run_dir(tmp_path, world_size=world)
    target = f"{tmp_path / 'planted.py'}:train"
    done = _cli("replay", "--no-locate", str(run), "--target", target)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "world size" in done.stderr and "Traceback" not in done.stderr and not mark.exists()
    with pytest.raises(UsageError, match="world size"):
        replay(run, target=target)


def test_max_procs_bounds_the_ranks_a_replay_starts(tmp_path: Path) -> None:
    run, mark = _run_dir(tmp_path, world_size=8)
    done = _cli("replay", "--no-locate", str(run), "--target", f"{tmp_path / 'planted.py'}:train", "--max-procs", "4")
    assert done.returncode == 2 and "more than the 4 allowed" in done.stderr and not mark.exists()
