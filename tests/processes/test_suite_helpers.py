"""The test suite's own house: ranks started through one helper that races for no port, the fault injector a
test helper that the command line imports (never the reverse), a steady hypothesis profile, a per-test timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers import faults
from helpers.multiproc import spawn_ranks
from hypothesis import settings

REPO = Path(__file__).resolve().parents[2]


def _report_rank(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    got = {"rank": dist.get_rank(), "world": dist.get_world_size(), "args": [rank, world],
           "env_rank": os.environ.get("RANK"), "threads": __import__("torch").get_num_threads()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))


def _fail_on_rank_1(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits for a peer that is gone: it fails too, after rank 1


@pytest.mark.slow
def test_spawn_ranks_joins_every_rank_in_one_group_and_sets_the_launcher_environment_only_when_asked(
        tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "launcher").mkdir()
    spawn_ranks(_report_rank, 2, str(tmp_path / "plain"))
    spawn_ranks(_report_rank, 2, str(tmp_path / "launcher"), launcher_env=True)
    for kind, env_rank in (("plain", lambda r: None), ("launcher", str)):
        got = [json.loads((tmp_path / kind / f"rank{r}.json").read_text()) for r in range(2)]
        assert got == [{"rank": r, "world": 2, "args": [r, 2], "env_rank": env_rank(r), "threads": 1}
                       for r in range(2)], kind


@pytest.mark.slow
def test_a_failing_rank_fails_the_launch_with_its_own_error_not_its_peer_s() -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 gives up") as caught:
        spawn_ranks(_fail_on_rank_1, 2)
    assert caught.value.error_index == 1


def test_no_test_or_script_picks_a_port_by_binding_and_releasing_it() -> None:
    """A port bound, released and handed to the ranks can be taken in between by any other job."""
    bind = re.compile(r"\.bind\(\(\s*['\"](127\.0\.0\.1|localhost|)['\"]\s*,\s*0\s*\)\)")
    master_port = re.compile(r"MASTER_PORT\s*=")
    # One helper picks such ports, for launchers that need one before rank 0 binds it, and starts again on
    # another port when one was taken in between (helpers/ports.py); a file may hand MASTER_PORT to ranks only
    # with a port from it.
    vetted = {Path(__file__), REPO / "tests" / "helpers" / "ports.py"}
    offenders = []
    for p in (p for folder in ("tests", "scripts") for p in (REPO / folder).rglob("*.py") if p not in vetted):
        text = p.read_text()
        if bind.search(text) or (master_port.search(text) and "from helpers.ports import" not in text):
            offenders.append(str(p.relative_to(REPO)))
    assert offenders == []


def test_tests_import_the_fault_injector_from_the_helpers_not_from_scripts() -> None:
    pattern = re.compile(r"^\s*(import inject_fault|from inject_fault import)", re.M)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
    helpers = "\n".join(p.read_text() for p in (REPO / "tests" / "helpers").glob("*.py"))
    assert "scripts" not in re.findall(r"sys\.path\.\w+\(.*", helpers) and "import inject_fault" not in helpers


def test_the_inject_fault_command_line_uses_the_helper_library(fresh_ckpt) -> None:
    ckpt = fresh_ckpt("single")
    target = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    before = target.read_bytes()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "inject_fault.py"), str(ckpt), "flip-bit",
                           "--file", target.name, "--offset", "7", "--bit", "3"], capture_output=True, text=True,
                          timeout=120, cwd=str(ckpt))
    assert done.returncode == 0, done.stderr
    fault = json.loads(done.stdout)
    assert {k: fault[k] for k in ("kind", "file", "byte_offset", "bit")} == {
        "kind": "bit-flip", "file": target.name, "byte_offset": 7, "bit": 3}
    after = target.read_bytes()
    assert after[7] == before[7] ^ 0b1000 and after[:7] + after[8:] == before[:7] + before[8:]
    # Imported as a module (scripts/ on the path), the script still gives the library.
    code = "import inject_fault, helpers.faults as f; print(inject_fault.flip_bit is f.flip_bit)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO)])})
    assert shown.stdout.strip() == "True", shown.stderr
    assert faults.flip_bit.__module__ == "helpers.faults"


def test_hypothesis_runs_the_steady_ci_profile_unless_told_otherwise() -> None:
    ci = settings.get_profile("ci")
    assert ci.deadline is None and ci.derandomize and ci.print_blob and ci.database is None
    if not os.environ.get("HYPOTHESIS_PROFILE"):
        assert settings.default.derandomize and settings.default.deadline is None


def test_every_test_runs_under_a_timeout_and_the_readme_runs_the_suite_in_parallel(
        pytestconfig: pytest.Config) -> None:
    assert float(pytestconfig.getini("timeout")) >= 600
    assert pytestconfig.getini("timeout_method") == "thread"  # a hang in C code or a join is stopped too
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(d.startswith("pytest-xdist") for d in extra) and any(d.startswith("pytest-timeout") for d in extra)
    blocks = re.findall(r"^```bash\n(.*?)\n```", (REPO / "README.md").read_text(), re.M | re.S)
    assert re.search(r"python -m pytest -n \S+", blocks[1]), blocks[1]
    # The longest files start first (conftest.START_FIRST), which needs xdist to keep the collection's order.
    assert "--dist loadfile --no-loadscope-reorder" in blocks[1], blocks[1]
    import conftest

    assert [n for n in conftest.START_FIRST if not list((REPO / "tests").rglob(n))] == []
    # The install skips byte-compiling (--no-compile); the suite's processes cache what they import instead, also
    # where the environment sets PYTHONDONTWRITEBYTECODE (conftest drops it).
    assert "--no-compile" in blocks[1], blocks[1]
    assert not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ


def test_test_file_basenames_are_unique_across_folders() -> None:
    """pytest imports each test file by its basename (the default import mode), test modules import one another
    by it (conftest.py puts every folder on ``sys.path``), and START_FIRST names files by it."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
