"""``verify`` across ranks: ``--readers 2``, torchrun and srun give the findings one process gives, each rank
reads its share (the shares sum to the checkpoint's bytes, the largest within 1.2/N), and a rank that dies or
stops is named, never a hang. Real processes and a real rendezvous store on this machine.

Where what a test proves is the findings and shares (not a process's start-up, exit or signals), the one-process
reference runs in this process, and so does rank 0 of ``--readers 2`` (:func:`invoke`): the other rank is still a
real process it starts, meeting it at a real store. The launches a test is about stay real processes: torchrun,
srun, dead or stopped ranks, a rank without rank 0, exit codes through a launcher."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import inproc_cli
from helpers.inproc_cli import Done
from helpers.multiproc import process_gone
from helpers.ports import on_a_free_port, refused_port

from ckptverify.cluster.split import assign, balance

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300
TORCHRUN = ("-m", "torch.distributed.run", "--nproc-per-node", "2")


def _stripped(key: str) -> bool:
    """A variable of an outer launcher (or of ckptverify's own) that must not leak into the command under test."""
    return key.startswith(("SLURM_", "TORCHELASTIC_", "CKPTVERIFY_")) or key in ("RANK", "WORLD_SIZE")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _stripped(k)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
                          env=env or _env())


def invoke(*args: str, **extra: str) -> Done:
    """``ckptverify ARGS`` in this process (the environment cleaned as :func:`_env` does, ``extra`` added). Under
    ``--readers N`` this process is rank 0 and hosts the store; ranks 1..N-1 are real processes it starts
    (``python -m ckptverify``), as from the command line."""
    env: dict[str, str | None] = {k: None for k in os.environ if _stripped(k)}
    env.update(extra)
    return inproc_cli.invoke(*args, env=env)


def verify_json(path: Path, *extra: str, launcher: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    """``verify PATH --json EXTRA``: under ``launcher`` (e.g. torchrun) as real processes, else in this process
    (:func:`invoke`; ``--readers``'s other ranks real processes)."""
    if launcher:
        proc = run(*launcher, "-m", "ckptverify", "verify", str(path), "--json", *extra)
    else:
        proc = invoke("verify", str(path), "--json", *extra)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def findings(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(f["check"], f["severity"], json.dumps(f.get("location"), sort_keys=True), f["message"])
            for f in data["findings"]]


def build(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(320 * 1024 + 37 * i, generator=g) for i in range(8)}
    state["step"] = torch.tensor(7)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=4))
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("cluster") / "clean")


@pytest.fixture(scope="module")
def with_manifest(clean: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ckptverify.audit.adopt import fingerprint_checkpoint

    path = tmp_path_factory.mktemp("cluster") / "manifest"
    shutil.copytree(clean, path)
    report, manifest = fingerprint_checkpoint(path)
    assert manifest is not None, report
    return path


def _flip(path: Path, name: str, at: float = 0.6) -> None:
    file = path / name
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _planted(kind: str, clean: Path, with_manifest: Path, dst: Path) -> Path:
    shutil.copytree(with_manifest if kind == "manifest-digest" else clean, dst)
    if kind in ("bit-flip", "manifest-digest"):
        _flip(dst, "__0_1.distcp")
    elif kind == "truncated":
        file = dst / "__0_2.distcp"
        os.truncate(file, file.stat().st_size // 2)
    elif kind == "missing":
        (dst / "__0_3.distcp").unlink()
    elif kind == "metadata":
        _flip(dst, ".metadata", 0.5)
    return dst


KINDS = ["bit-flip", "truncated", "missing", "manifest-digest", "metadata"]
#: Verified under ``torchrun -m ckptverify verify`` itself: the command's exit code through torchrun, 0 for a clean
#: checkpoint, 1 for a planted fault. The other checkpoints share one torchrun launch (:func:`torchrun_reports`).
TORCHRUN_CLI = ("clean", "bit-flip")


@pytest.fixture(scope="module")
def planted(clean: Path, with_manifest: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fault planted in a copy of its own, once for the module (verify only reads them)."""
    root = tmp_path_factory.mktemp("planted")
    return {kind: _planted(kind, clean, with_manifest, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def torchrun_reports(with_manifest: Path, planted: dict[str, Path],
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict[str, Any]]]:
    """Rank 0's exit code and report of ``verify PATH --json`` under torchrun (two ranks), for each checkpoint not
    in :data:`TORCHRUN_CLI`: one launch runs the commands in turn in the same ranks
    (``helpers/ranked_verify_runs.py``), each across the ranks as ``torchrun -m ckptverify verify`` runs it."""
    paths = {"manifest": with_manifest, **{k: p for k, p in planted.items() if k not in TORCHRUN_CLI}}
    out = tmp_path_factory.mktemp("torchrun-out")
    proc = run(*TORCHRUN, str(ROOT / "tests" / "helpers" / "ranked_verify_runs.py"),
               str(out), *(json.dumps(["verify", str(p), "--json"]) for p in paths.values()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert len(rank0) == len(rank1) == len(paths)
    for r in rank1:  # rank 1 served its share of every command and left quietly
        assert r["exit_code"] == 0 and r["error"] is None and r["stdout"] == "", r
    reports = {}
    for name, r in zip(paths, rank0, strict=True):
        assert r["error"] is None and r["stdout"].strip(), r
        reports[name] = (r["exit_code"], json.loads(r["stdout"]))
    return reports


def torchrun_verify(name: str, path: Path, reports: dict[str, tuple[int, dict[str, Any]]]) -> tuple[int, dict]:
    if name in TORCHRUN_CLI:
        return verify_json(path, launcher=TORCHRUN)
    return reports[name]


def srun_like(path: Path, nproc: int = 2, **extra: str) -> list[subprocess.CompletedProcess[str]]:
    """The ranks as Slurm's ``srun`` starts them: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_* set."""
    return on_a_free_port(lambda port: _srun_on(path, str(port), nproc, **extra), _port_taken)


def _port_taken(procs: list[subprocess.CompletedProcess[str]]) -> bool:
    """Rank 0 could not bind the port picked: another job took it in between."""
    return "could not start the rendezvous store" in procs[0].stderr


def _srun_on(path: Path, port: str, nproc: int, **extra: str) -> list[subprocess.CompletedProcess[str]]:
    procs = [subprocess.Popen([sys.executable, "-m", "ckptverify", "verify", str(path), "--json"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(SLURM_PROCID=str(r), SLURM_NTASKS=str(nproc), SLURM_LOCALID=str(r),
                                       SLURM_STEP_NUM_TASKS=str(nproc), MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, **extra))
             for r in range(nproc)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def assert_shares(data: dict[str, Any], nproc: int) -> None:
    stats = data["stats"]
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == list(range(nproc))
    assert stats["world_size"] == nproc
    assert sum(r["bytes_read"] for r in ranks) == stats["bytes"]
    assert all(r["bytes_read"] > 0 and r["host"] for r in ranks)
    assert max(r["bytes_read"] for r in ranks) <= 1.2 / nproc * stats["bytes"]
    assert stats["balance"]["met"] and stats["balance"]["why_not"] is None


# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["clean", "manifest"])
def test_readers_and_torchrun_equal_one_process(which: str, clean: Path, with_manifest: Path,
                                              torchrun_reports: dict[str, tuple[int, dict[str, Any]]]) -> None:
    path = clean if which == "clean" else with_manifest
    code, one = verify_json(path)
    assert code == 0 and "ranks" not in one["stats"]
    code2, two = verify_json(path, "--readers", "2")
    assert code2 == 0 and findings(two) == findings(one)
    assert two["stats"]["launcher"] == "local" and two["stats"]["manifest"] == (which == "manifest")
    assert_shares(two, 2)
    code3, tr = torchrun_verify(which, path, torchrun_reports)
    assert code3 == 0 and findings(tr) == findings(one)
    assert tr["stats"]["launcher"] == "torchrun"
    assert_shares(tr, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_planted_faults_same_findings(kind: str, planted: dict[str, Path],
                                      torchrun_reports: dict[str, tuple[int, dict[str, Any]]]) -> None:
    path = planted[kind]
    code, one = verify_json(path)
    assert code == 1, one["findings"]
    expected = {"bit-flip": "zip-crc", "truncated": "item-bounds", "missing": "file-missing",
                "manifest-digest": "manifest-digest", "metadata": "metadata"}[kind]
    assert any(f["check"].startswith(expected.split("-")[0]) for f in one["findings"]), findings(one)
    code2, two = verify_json(path, "--readers", "2")
    assert code2 == 1 and findings(two) == findings(one)
    code3, tr = torchrun_verify(kind, path, torchrun_reports)
    assert code3 == 1 and findings(tr) == findings(one)  # torchrun exits 1 when rank 0 does
    assert tr["stats"]["launcher"] == "torchrun"


def test_srun_environment(clean: Path) -> None:
    _, one = verify_json(clean)
    procs = srun_like(clean)
    assert [p.returncode for p in procs] == [0, 0], [p.stderr[-2000:] for p in procs]
    data = json.loads(procs[0].stdout)
    assert findings(data) == findings(one) and data["stats"]["launcher"] == "slurm"
    assert_shares(data, 2)
    assert procs[1].stdout == ""  # one report, from rank 0


def test_srun_without_master_is_exit_2_saying_what_to_set(clean: Path) -> None:
    proc = run("-m", "ckptverify", "verify", str(clean),
               env=_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID="0"))
    assert proc.returncode == 2
    assert "MASTER_ADDR and MASTER_PORT are not set" in proc.stderr and "--no-cluster" in proc.stderr
    assert "Traceback" not in proc.stderr
    alone = run("-m", "ckptverify", "verify", str(clean), "--no-cluster",
                env=_env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2"))
    assert alone.returncode == 0, alone.stderr
    # A batch script's own environment (the job's SLURM_NTASKS, no step): one process, no waiting for ranks.
    batch = run("-m", "ckptverify", "verify", str(clean), "--json", env=_env(SLURM_PROCID="0", SLURM_NTASKS="4"))
    assert batch.returncode == 0 and "ranks" not in json.loads(batch.stdout)["stats"], batch.stderr[-2000:]


def test_readers_with_no_cluster_is_exit_2_not_one_process(clean: Path) -> None:
    proc = run("-m", "ckptverify", "verify", str(clean), "--readers", "2", "--no-cluster", env=_env())
    assert proc.returncode == 2 and "contradict" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_text_report_lists_each_rank(clean: Path) -> None:
    proc = invoke("verify", str(clean), "--readers", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "read by 2 ranks (local)" in proc.stdout
    assert "rank 0 on " in proc.stdout and "rank 1 on " in proc.stdout and "balanced" in proc.stdout


@pytest.mark.parametrize("fault", ["kill", "stop", "exit"])
def test_dead_or_stopped_rank_is_named(fault: str, clean: Path) -> None:
    import re

    proc = run("-m", "ckptverify", "verify", str(clean), "--readers", "2", "--rank-timeout", "5",
               env=_env(CKPTVERIFY_TEST_RANK_FAULT=f"1:{fault}"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    host = socket.gethostname()
    assert f"rank 1 on {host} (pid " in line, line
    want = {"kill": "was killed by signal 9 (SIGKILL)", "stop": "gave no sign of life for 5 s",
            "exit": "exited with code 3"}[fault]
    assert want in line and "while reading its share" in line, line
    pid = int(re.search(r"pid (\d+)", line).group(1))  # type: ignore[union-attr]
    assert process_gone(pid)  # no rank outlives the command, a stopped one neither


def test_dead_rank_as_json(clean: Path) -> None:
    proc = run("-m", "ckptverify", "verify", str(clean), "--readers", "2", "--rank-timeout", "5", "--json",
               env=_env(CKPTVERIFY_TEST_RANK_FAULT="1:kill"))
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    assert "rank 1 on" in json.dumps(data) and "SIGKILL" in json.dumps(data)


def test_assign_is_balanced_and_deterministic() -> None:
    sizes = [64, 10, 30, 30, 20, 20, 5, 1]
    loads = [0, 0, 0]
    owner = assign(sizes, loads)
    assert owner == assign(sizes, [0, 0, 0])
    assert loads == [sum(s for s, o in zip(sizes, owner, strict=True) if o == r) for r in range(3)]
    assert max(loads) == 64
    preloaded = [50, 0]
    assign([25, 25], preloaded)
    assert preloaded == [50, 50]


def test_balance_says_why_not() -> None:
    assert balance([100, 0, 0], 100, 1, 100, 0)["why_not"].startswith("1 work unit(s) for 3 ranks")
    assert "one work unit alone" in balance([80, 20], 100, 2, 80, 0)["why_not"]
    assert "rank 0 read 70 bytes itself" in balance([70, 30], 100, 3, 20, 70)["why_not"]
    assert "rank 0 read 100 bytes itself" in balance([100, 0], 100, 0, 0, 100)["why_not"]  # only small items
    # Three units of 5 for 2 ranks: the least-loaded rank gets the third, 10 of 15 bytes, over 0.6.
    assert balance([10, 5], 15, 3, 5, 0)["why_not"].startswith("the units could not be split more evenly")
    ok = balance([50, 50], 100, 4, 30, 0)
    assert ok["met"] and ok["why_not"] is None and ok["limit_fraction"] == 0.6


def test_deep_and_single_file_under_ranks(with_manifest: Path, tmp_path: Path) -> None:
    _, one = verify_json(with_manifest, "--deep")
    code, two = verify_json(with_manifest, "--deep", "--readers", "2")
    assert code == 0 and findings(two) == findings(one) and two["coverage"] == one["coverage"]
    assert "a second time" in two["stats"]["ranks_note"]
    # The tensors are rebuilt on both ranks: each read its share of the blocks and of the tensors.
    ranks = two["stats"]["ranks"]
    assert sum(r["bytes_read"] for r in ranks) > 1.9 * two["stats"]["bytes"]
    assert max(r["bytes_read"] for r in ranks) <= 0.6 * sum(r["bytes_read"] for r in ranks)
    flipped = _planted("manifest-digest", with_manifest, with_manifest, tmp_path / "flipped")
    _, one = verify_json(flipped, "--deep")
    code, two = verify_json(flipped, "--deep", "--readers", "2")
    assert code == 1 and findings(two) == findings(one)
    assert any(f["check"] == "fingerprint" for f in two["findings"]), findings(two)
    single = tmp_path / "model.pt"
    torch.save({"w": torch.arange(1000.0)}, single)
    _, alone = verify_json(single)
    code, ranked = verify_json(single, "--readers", "2")
    assert code == 0 and findings(ranked) == findings(alone)
    assert ranked["stats"]["ranks"][1]["bytes_read"] == 0
    assert ranked["stats"]["balance"]["why_not"].startswith("nothing was shared out")


def test_stopped_rank_under_torchrun_is_named(clean: Path) -> None:
    import re
    import signal
    import tempfile
    import threading

    # Once rank 0 has failed (naming the stopped rank), torchrun's agent sends the stopped rank SIGTERM, held while
    # it is stopped, and SIGKILLs it 30 s later: torch 2.13 hard-codes that grace where a worker fails
    # (PContext._poll -> close(), timeout=30; --shutdown-timeout governs only the agent's own shutdown). When the
    # agent says it is ending the very process rank 0 named, the test sends the SIGKILL itself rather than idle
    # 30 s; should the agent's log line differ, the test waits out torchrun's grace as before.
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, *TORCHRUN, "-m", "ckptverify", "verify", str(clean),
                                 "--rank-timeout", "5"], stdout=out, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=_env(CKPTVERIFY_TEST_RANK_FAULT="1:stop"))
        assert proc.stderr is not None
        timed_out = threading.Event()

        def hang() -> None:  # a hang fails the test: the launcher is killed and the test says so
            timed_out.set()
            proc.kill()

        hung = threading.Timer(TIMEOUT, hang)
        hung.start()
        stderr, named = [], None
        for line in proc.stderr:
            stderr.append(line)
            if line.startswith("ckptverify verify: error:") and (m := re.search(r"rank 1 on \S+ \(pid (\d+)\)", line)):
                named = int(m.group(1))
            closing = re.search(r"Sending process (\d+) closing signal SIGTERM", line)
            if named is not None and closing and int(closing.group(1)) == named:
                os.kill(named, signal.SIGKILL)  # what the agent does after its grace
        returncode = proc.wait()
        hung.cancel()
        out.seek(0)
        stdout = out.read()
    text = "".join(stderr)
    assert not timed_out.is_set(), f"torchrun still running after {TIMEOUT} s: {text[-3000:]}"
    assert returncode != 0 and stdout == ""
    ours = [ln for ln in text.splitlines() if ln.startswith("ckptverify verify: error:")]
    assert len(ours) == 1, text[-3000:]
    assert f"rank 1 on {socket.gethostname()} (pid " in ours[0] and "gave no sign of life for 5 s" in ours[0]
    assert named is not None and process_gone(named)


def test_rank_without_rank_0_exits_2_saying_so(clean: Path) -> None:
    with refused_port() as port:  # nothing listens there: no rank 0
        proc = run("-m", "ckptverify", "verify", str(clean), "--rank-timeout", "2",
                   env=_env(CKPTVERIFY_CLUSTER="local", RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)))
    assert proc.returncode == 2 and proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptverify verify: error: could not reach the rendezvous store at 127.0.0.1:"), last


def test_small_items_are_rank_0s_and_the_report_says_so(tmp_path: Path) -> None:
    path = tmp_path / "small"
    dcp.save({f"b{i}": torch.full((64,), float(i)) for i in range(20)},
             storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
    _, one = verify_json(path)
    code, two = verify_json(path, "--readers", "2")
    assert code == 0 and findings(two) == findings(one)
    ranks = two["stats"]["ranks"]
    assert sum(r["bytes_read"] for r in ranks) == two["stats"]["bytes"] and ranks[1]["bytes_read"] == 0
    bal = two["stats"]["balance"]
    assert not bal["met"] and bal["why_not"].startswith("rank 0 read ")
