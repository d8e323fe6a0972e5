"""A save's verification shared out among the nodes that wrote it (``ckptverify.verifier.parts``,
``ckptverify.ownfiles.partsplan``), each side run in this one process: what a node's part opens and judges, how
the coordinator merges the parts into one stamp, a manifest written from the parts' digests, a folder of DCP
folders (a transformers FSDP ``checkpoint-N``), and the deep check in parts. The same with real ranks as nodes:
``test_parts_among_nodes.py``; a production job on two torchrun nodes: ``test_parts_torchrun_job.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj
from helpers.nodeparts import SUBS as _SUBS
from helpers.nodeparts import manifests as _manifests
from helpers.nodeparts import plain_dcp as _plain_dcp
from helpers.nodeparts import stamp_of as _stamp
from helpers.nodeparts import without_times as _without_times

import ckptverify as cv
from ckptverify.audit.verify import verify_checkpoint, verify_part
from ckptverify.findings import Report
from ckptverify.ownfiles.names import PARTS_PLAN, PARTS_PREFIX, STAMP_FILE
from ckptverify.runs.stamp import read_stamp
from ckptverify.safeparse import readers
from ckptverify.verifier import parts as parts_mod

# ---------------------------------------------------------------------------------- one process


@pytest.fixture
def opened_paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path a ``ReadOnlyFile`` opens (the reader every byte-level check reads through)."""
    seen: list[str] = []
    original = readers.ReadOnlyFile.__init__

    def recording(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(os.path.basename(os.fspath(path)))
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(readers.ReadOnlyFile, "__init__", recording)
    return seen


def _two_file_checkpoint(root: Path) -> str:
    path = str(root / "ckpt")
    cv.save({f"w{i}": torch.randn(4096) for i in range(6)}, path, thread_count=2)
    assert sorted(n for n in os.listdir(path) if n.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    return path


def test_a_part_opens_only_its_files_and_the_parts_add_up_to_the_whole(tmp_path: Path,
                                                                       opened_paths: list[str]) -> None:
    path = _two_file_checkpoint(tmp_path)
    whole = verify_checkpoint(path)
    opened_paths.clear()
    node = verify_part(path, only=frozenset({"__0_1.distcp"}))
    assert set(opened_paths) - {".metadata"} == {"__0_1.distcp"}, opened_paths
    opened_paths.clear()
    coordinator = verify_part(path, skip=frozenset({"__0_1.distcp"}))
    assert "__0_1.distcp" not in opened_paths and "__0_0.distcp" in opened_paths, opened_paths
    assert node.passed and coordinator.passed
    assert node.stats["opened"] == ["__0_1.distcp"] and coordinator.stats["opened"] == ["__0_0.distcp"]
    assert node.stats["bytes"] + coordinator.stats["bytes"] == whole.stats["bytes"]
    # The whole-checkpoint checks are done once, by the part that does not restrict itself to its files.
    assert not any(c.check in ("metadata", "chunk-tiling") for c in node.coverage), node.coverage
    assert any(c.check == "metadata" for c in coordinator.coverage)


def test_a_part_judges_only_its_files_and_never_reports_another_s_missing(tmp_path: Path) -> None:
    path = _two_file_checkpoint(tmp_path)
    fault = inj.flip_in_tensor_payload(path)
    damaged, intact = fault.file, ({"__0_0.distcp", "__0_1.distcp"} - {fault.file}).pop()
    assert verify_part(path, only=frozenset({intact})).passed
    failed = verify_part(path, only=frozenset({damaged}))
    assert not failed.passed and {f.location.file for f in failed.errors} == {damaged}
    os.unlink(os.path.join(path, damaged))
    other = verify_part(path, only=frozenset({intact}))
    assert other.passed and not any(f.location.file == damaged for f in other.findings), other.findings
    coordinator = verify_part(path, skip=frozenset({damaged}))
    assert coordinator.passed, coordinator.errors
    mine = verify_part(path, only=frozenset({damaged}))
    assert {f.check for f in mine.errors} >= {"file-missing"}


def test_part_files_are_not_part_of_the_checkpoint_or_of_its_stamp(tmp_path: Path) -> None:
    path = _two_file_checkpoint(tmp_path)
    from ckptverify.runs.stamp import files_fingerprint

    before = files_fingerprint(path)
    (Path(path) / PARTS_PLAN).write_text("{}")
    (Path(path) / f"{PARTS_PREFIX}-3.json").write_text("{}")
    assert files_fingerprint(path) == before
    report = verify_checkpoint(path)
    assert report.passed and not any(f.check == "file-unreferenced" for f in report.findings), report.findings


def test_part_files_left_in_a_folder_of_weights_are_ours_not_the_checkpoint_s(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from ckptverify.formats.describe import is_own_file

    save_file({"w": torch.arange(8, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / PARTS_PLAN).write_text("{}")
    (tmp_path / f"{PARTS_PREFIX}-1.json").write_text("{}")
    assert is_own_file(PARTS_PLAN) and is_own_file(f"{PARTS_PREFIX}-1.json") and not is_own_file("model.safetensors")
    report = verify_checkpoint(str(tmp_path))
    assert not any(PARTS_PREFIX in (f.location.file or "") for f in report.findings), report.findings


def test_without_a_plan_the_coordinator_verifies_everything_itself(tmp_path: Path) -> None:
    from ckptverify.verifier.stamper import VerifyingLock

    path = _two_file_checkpoint(tmp_path)
    lock = VerifyingLock(path)
    assert lock.acquire()
    try:
        result = parts_mod.stamp_parts_locked(path, step=1, jobs=1, settle=0.0, wait_s=0.0)
    finally:
        lock.release()
    assert result.verdict == "passed" and "parts" not in _stamp(Path(path))
    assert result.bytes_checked == verify_checkpoint(path).stats["bytes"]


def _planned(root: Path) -> tuple[str, dict[str, Any]]:
    """A two-file checkpoint whose plan gives each file to one of two nodes."""
    from ckptverify.ownfiles.partsplan import make_plan, write_plan

    path = _two_file_checkpoint(root)
    plan = make_plan(["hostA", "hostB"], [["__0_0.distcp"], ["__0_1.distcp"]])
    write_plan(path, plan)
    return path, plan


def _gather(path: str, wait_s: float) -> Any:
    from ckptverify.verifier.stamper import VerifyingLock

    lock = VerifyingLock(path)
    assert lock.acquire()
    try:
        return parts_mod.stamp_parts_locked(path, step=7, jobs=1, settle=0.0, wait_s=wait_s)
    finally:
        lock.release()


def test_the_coordinator_merges_a_reported_part_into_one_stamp(tmp_path: Path) -> None:
    path, _ = _planned(tmp_path)
    written = parts_mod.part_job(path, 1, wait_s=0)
    assert written["written"] and written["passed"]
    result = _gather(path, wait_s=5)
    stamp = _stamp(Path(path))
    assert result.verdict == "passed" and stamp["passed"] and stamp["step"] == 7
    assert [(p["host"], p["opened"], p["verdict"]) for p in stamp["parts"]] == [
        ("hostA", ["__0_0.distcp"], "passed"), ("hostB", ["__0_1.distcp"], "passed")]
    assert result.bytes_checked == verify_checkpoint(path).stats["bytes"]
    assert read_stamp(path).current and sorted(os.listdir(path)) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "ckptverify.manifest.json", STAMP_FILE]


def test_a_part_whose_plan_never_comes_says_so_instead_of_waiting_out_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _two_file_checkpoint(tmp_path)  # committed, no plan (it could not be written)
    monkeypatch.setattr(parts_mod, "_PLAN_GRACE_SECONDS", 0.3)
    out = parts_mod.part_job(path, 1, wait_s=600)
    assert out == {"written": False, "why": f"no committed checkpoint with a plan ({PARTS_PLAN}) at {path}"}
    assert not [n for n in os.listdir(path) if n.startswith(PARTS_PREFIX)]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_background_verifier_gathers_the_parts_in_its_process_or_thread(tmp_path: Path, isolation: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptverify.verifier.background import BackgroundVerifier, Task
    from ckptverify.verifier.jobs import VERIFY_PART

    monkeypatch.setenv(parts_mod.PART_TIMEOUT_ENV, "60")
    path, _ = _planned(tmp_path)
    verifier = BackgroundVerifier(isolation=isolation, throttle=False)
    node: list[Any] = []
    try:
        verifier.submit(path, step=3, parts=True)  # the coordinator's: takes the lock, waits for node 1
        verifier_b = BackgroundVerifier(isolation=isolation, throttle=False)  # node 1's, lockless
        verifier_b.submit(path, step=3, task=Task(
            job=VERIFY_PART, args={"root": path, "node": 1}, locked=False, done=lambda r, why: node.append(r)))
        assert verifier_b.close(timeout=120) and verifier.wait(timeout=120)
    finally:
        verifier.close(timeout=10)
    assert node and node[0]["written"] and node[0]["passed"], node
    last = verifier.last()
    assert last is not None and last.verdict == "passed" and last.stamped, last
    assert [p["opened"] for p in _stamp(Path(path))["parts"]] == [["__0_0.distcp"], ["__0_1.distcp"]]


@pytest.mark.parametrize("planted", ["stale", "garbage"])
def test_a_part_verdict_of_another_save_or_no_verdict_at_all_is_no_report(tmp_path: Path, planted: str) -> None:
    path, plan = _planned(tmp_path)
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    if planted == "stale":  # a passed part of an earlier save into the same folder
        parts_mod.part_job(path, 1, wait_s=0)
        data = json.loads(verdict.read_text())
        verdict.write_text(json.dumps({**data, "save_id": "0" * 32}))
    else:
        verdict.write_text(json.dumps({"schema": parts_mod.PART_SCHEMA, "save_id": plan["save_id"], "report": 3}))
    result = _gather(path, wait_s=0.5)
    assert result.verdict == "unverified" and not (Path(path) / STAMP_FILE).exists()
    assert "node 1 (host hostB, ranks [1])" in result.reason and "__0_1.distcp" in result.reason


# ---------------------------------------------------------------------------------- fingerprint="auto"


def _job_in_parts(path: str, fingerprint: Any, opened: list[str] | None = None, deep: bool = False,
                  nodes: list[list[str]] | None = None) -> dict[str, Any]:
    """What the coordinator's verifier runs for an integration's save shared out among two nodes (``nodes``:
    each one's files; by default the DCP folder's first file, then the rest), node 1's part having reported
    first (``opened``, when given, holds what each side opened: ``part: ...`` then ``coordinator: ...``)."""
    from ckptverify.ownfiles.partsplan import make_plan, write_plan
    from ckptverify.verifier.saved import saved_job

    if nodes is None:
        files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
        nodes = [files[:1], files[1:]]
    write_plan(path, {**make_plan(["hostA", "hostB"], nodes), "fingerprint": fingerprint, "deep": deep})
    if opened is not None:
        opened.clear()
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    if opened is not None:
        opened[:] = [f"part: {n}" for n in opened]
    out = saved_job(path, 5, fingerprint, 1, deep, 0.0, parts=True)
    if opened is not None:
        opened[:] = [n if n.startswith("part: ") else f"coordinator: {n}" for n in opened]
    return out


def test_auto_shares_out_a_checkpoint_every_byte_of_which_a_crc_protects(tmp_path: Path) -> None:
    path = _plain_dcp(tmp_path / "ckpt", {f"w{i}": torch.randn(4096) for i in range(6)})
    out = _job_in_parts(path, "auto")
    assert out["event"] == "checkpoint-verified" and "fingerprint" not in out["extra"], out["extra"]
    stamp = _stamp(Path(path))
    assert stamp["passed"] and [p["opened"] for p in stamp["parts"]] == [["__0_0.distcp"], ["__0_1.distcp"]]
    # Nothing was fingerprinted: every byte is under a CRC-32, and the manifest is not written.
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__0_1.distcp", STAMP_FILE]


def _mixed_state() -> dict[str, Any]:
    """Tensors large and small (batched), of several dtypes, a non-tensor item."""
    return {**{f"w{i}": torch.randn(4096 * (i + 1)) for i in range(6)}, "big": torch.randn(300_000),
            "half": torch.arange(10, dtype=torch.float16), "step": 3, "ids": torch.arange(77)}


@pytest.mark.parametrize(("fingerprint", "safetensors"), [(True, False), ("auto", True), (True, True)])
def test_a_manifest_from_the_parts_is_the_one_a_single_process_writes_and_no_node_opens_another_s_file(
        tmp_path: Path, opened_paths: list[str], fingerprint: Any, safetensors: bool) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, read_manifest

    path = _plain_dcp(tmp_path / "ckpt", _mixed_state(), safetensors=safetensors)
    alone = _plain_dcp(tmp_path / "alone", _mixed_state(), safetensors=safetensors)
    for name in os.listdir(path):  # the same bytes in a second folder, adopted by one process
        Path(alone, name).write_bytes(Path(path, name).read_bytes())
    single = fingerprint_checkpoint(alone, force=True, trust_uncheckable=True)[1]
    opened_paths.clear()
    out = _job_in_parts(path, fingerprint, opened_paths)
    assert out["event"] == "checkpoint-verified", out
    note = out["extra"]["fingerprint"]
    assert note.startswith("manifest written") and "1 other node(s)" in note and "read whole" not in note
    assert _without_times(read_manifest(path)) == _without_times(single)
    shards = {n for n in opened_paths if n.endswith(".distcp")}
    assert shards == {"part: __0_1.distcp", "coordinator: __0_0.distcp"}, opened_paths
    stamp = _stamp(Path(path))
    assert stamp["passed"] and [p["opened"] for p in stamp["parts"]] == [["__0_0.distcp"], ["__0_1.distcp"]]
    sizes = {n: Path(path, n).stat().st_size for n in ("__0_0.distcp", "__0_1.distcp")}
    assert [p["bytes"] for p in stamp["parts"]][1] == sizes["__0_1.distcp"]
    assert (Path(path) / MANIFEST_FILE).is_file() and verify_checkpoint(path).passed
    assert not [n for n in os.listdir(path) if n.startswith(PARTS_PREFIX)]


def test_auto_fingerprints_again_over_a_former_save_s_manifest(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    target = tmp_path / "ckpt"
    _plain_dcp(target, {f"w{i}": torch.zeros(4096) for i in range(6)})
    assert fingerprint_checkpoint(str(target))[1] is not None
    old = (target / MANIFEST_FILE).read_bytes()
    path = _plain_dcp(target, {f"w{i}": torch.randn(4096) for i in range(6)})  # saved again into the same place
    out = _job_in_parts(path, "auto")
    assert out["event"] == "checkpoint-verified" and out["extra"]["fingerprint"].startswith("manifest written"), out
    assert (target / MANIFEST_FILE).read_bytes() != old and _stamp(target)["passed"] and verify_checkpoint(path).passed


def test_a_damaged_part_refuses_the_manifest_and_names_its_node(tmp_path: Path) -> None:
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    path = _plain_dcp(tmp_path / "ckpt", _mixed_state())
    on_node_1 = next(i.fqn for i in inj.tensor_zip_items(path) if i.file == "__0_1.distcp")
    fault = inj.flip_in_tensor_payload(path, on_node_1)
    out = _job_in_parts(path, True)
    assert out["event"] == "checkpoint-failed" and out["extra"]["fingerprint"].startswith("no manifest"), out
    assert not (Path(path) / MANIFEST_FILE).exists() and (Path(path) / fault.file).exists()
    stamp = _stamp(Path(path))
    named = [e["message"] for e in stamp["errors"] if e["check"] == "node-part-failed"]
    assert named == ["the part of node 1 (host hostB, ranks [1]) failed: __0_1.distcp"], stamp["errors"]
    assert {p["node"]: p["verdict"] for p in stamp["parts"]} == {0: "passed", 1: "failed"}
    assert {e["location"].get("file") for e in stamp["errors"] if e["check"] != "node-part-failed"} == \
        {"__0_1.distcp"}


def test_parts_that_cannot_be_merged_are_adopted_whole_here_and_the_stamp_says_what_was_opened(
        tmp_path: Path) -> None:
    """A part whose records lack a unit the adoption asks of its files (digested otherwise, cut short): the
    coordinator cannot merge it and adopts the whole checkpoint itself."""
    from ckptverify.ownfiles.partsplan import make_plan, write_plan
    from ckptverify.verifier.saved import saved_job

    path = _plain_dcp(tmp_path / "ckpt", _mixed_state())
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    write_plan(path, {**make_plan(["hostA", "hostB"], [files[:1], files[1:]]), "fingerprint": True})
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    data = json.loads(verdict.read_text())
    cut = [r for r in data["adoption"] if r[0][0] != "digest"]
    verdict.write_text(json.dumps({**data, "adoption": cut}))
    out = saved_job(path, 5, True, 1, False, 0.0, parts=True)
    assert out["event"] == "checkpoint-verified", out
    assert out["extra"]["fingerprint"].endswith("; read whole here: no part brought the digest of __0_1.distcp, a "
                                                 "file not opened here"), out["extra"]
    assert "taken from their parts" not in out["extra"]["fingerprint"]
    stamp = _stamp(Path(path))
    # The coordinator read node 1's file too, and its part says so.
    assert stamp["passed"] and stamp["parts"][0]["opened"] == ["__0_0.distcp", "__0_1.distcp"], stamp["parts"]
    assert verify_checkpoint(path).stats["manifest"]


def test_only_a_dcp_folder_is_shared_out_among_nodes(tmp_path: Path) -> None:
    """A folder of other files (a Hugging Face ``checkpoint-N``) has no per-rank files to give each node: the
    coordinator verifies it whole; a DCP folder is shared out."""
    from safetensors.torch import save_file

    from ckptverify.integrations import Group, Verifier

    gathered: list[Any] = []

    def gather(obj: Any) -> list[Any]:
        gathered.append(obj)
        return ["hostA", "hostB"]

    group = Group(coordinator=True, broadcast=lambda obj: obj, barrier=lambda: None, gather=gather)
    hf = tmp_path / "checkpoint-10"
    hf.mkdir()
    save_file({"w": torch.randn(8)}, str(hf / "model.safetensors"))
    verifier = Verifier(verify="background")
    assert verifier._node_hosts(str(hf), group) is None and not gathered
    dcp_folder = _plain_dcp(tmp_path / "dcp", {"w": torch.randn(8)})
    assert verifier._node_hosts(dcp_folder, group) == ["hostA", "hostB"] and len(gathered) == 1
    assert Verifier(verify="inline")._node_hosts(dcp_folder, group) is None


@pytest.mark.parametrize("fingerprint", [False, "auto", True])
def test_a_node_whose_ranks_wrote_no_file_reports_an_empty_part(tmp_path: Path, fingerprint: Any) -> None:
    from ckptverify.ownfiles.partsplan import make_plan, write_plan
    from ckptverify.verifier.saved import saved_job

    path = _plain_dcp(tmp_path / "ckpt", {f"w{i}": torch.randn(4096) for i in range(4)})
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    write_plan(path, {**make_plan(["hostA", "hostB"], [files, []]), "fingerprint": fingerprint})
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    out = saved_job(path, 5, fingerprint, 1, False, 0.0, parts=True)
    assert out["event"] == "checkpoint-verified", out
    stamp = _stamp(Path(path))
    assert [(p["opened"], p["bytes"], p["verdict"]) for p in stamp["parts"]][1] == ([], 0, "passed")
    assert stamp["parts"][0]["opened"] == files and stamp["bytes_checked"] == sum(
        Path(path, n).stat().st_size for n in files)


@pytest.mark.parametrize("planted", [{"report": 3}, [1, 2], {"report": {}, "only": ["__0_1.distcp"], "items": "x"}])
def test_digests_a_part_verdict_does_not_hold_as_written_are_taken_by_reading_its_files_here(
        tmp_path: Path, planted: Any) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import read_manifest
    from ckptverify.ownfiles.partsplan import make_plan, write_plan
    from ckptverify.verifier.saved import saved_job

    path = _plain_dcp(tmp_path / "ckpt", _mixed_state())
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    write_plan(path, {**make_plan(["hostA", "hostB"], [files[:1], files[1:]]), "fingerprint": True})
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    verdict.write_text(json.dumps({**json.loads(verdict.read_text()), "adoption": planted}))
    out = saved_job(path, 5, True, 1, False, 0.0, parts=True)
    assert out["event"] == "checkpoint-verified" and "the digests of 0 other node(s)" in out["extra"]["fingerprint"]
    stamp = _stamp(Path(path))
    assert stamp["parts"][0]["opened"] == files  # node 1's file, read here: and said so
    manifest = read_manifest(path)
    assert manifest is not None and verify_checkpoint(path).stats["manifest"]
    assert _without_times(manifest) == _without_times(fingerprint_checkpoint(path, force=True)[1])


# ---------------------------------------------------------------------------------- a folder with DCP folders inside

def _fsdp_folder(root: Path, *, weights: bool = False) -> str:
    """A ``checkpoint-N`` as transformers writes it under FSDP (``SHARDED_STATE_DICT``): the model and the
    optimizer in DCP folders (here each in two files of one rank, as two nodes would write them), the scheduler,
    the RNG states of two ranks and the trainer state beside them. ``weights``: also a ``model.safetensors``,
    content no CRC-32 protects."""
    path = root / "checkpoint-4"
    path.mkdir(parents=True)
    _plain_dcp(path / _SUBS[1], {f"w{i}": torch.randn(4096) for i in range(4)})
    _plain_dcp(path / _SUBS[0], {f"state.w{i}.exp_avg": torch.randn(4096) for i in range(4)})
    for r in (0, 1):
        torch.save({"cpu": torch.get_rng_state(), "python": r}, path / f"rng_state_{r}.pth")
    torch.save({"last_epoch": 4}, path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    if weights:
        from safetensors.torch import save_file

        save_file({"lm_head": torch.randn(64)}, str(path / "model.safetensors"))
    return str(path)


def _folder_nodes(path: str) -> list[list[str]]:
    """Each DCP folder's two files, one to each of two nodes: what ranks 0 and 1 would have written."""
    files = {s: sorted(n for n in os.listdir(os.path.join(path, s)) if n.endswith(".distcp")) for s in _SUBS}
    assert all(len(f) == 2 for f in files.values()), files
    return [[f"{s}/{files[s][k]}" for s in _SUBS] for k in (0, 1)]


def _plan_folder(path: str, nodes: list[list[str]], fingerprint: Any = False, deep: bool = False) -> None:
    from ckptverify.ownfiles.partsplan import make_plan, write_plan

    write_plan(path, {**make_plan(["hostA", "hostB"], nodes), "fingerprint": fingerprint, "deep": deep})


_TOP = ["rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]


def test_a_folder_s_dcp_folders_are_shared_out_by_file_and_its_own_files_stay_with_the_coordinator(
        tmp_path: Path, opened_paths: list[str]) -> None:
    path = _fsdp_folder(tmp_path)
    nodes = _folder_nodes(path)
    whole = verify_checkpoint(path)
    assert whole.passed, whole.errors
    opened_paths.clear()
    node = verify_part(path, only=frozenset(nodes[1]))
    assert set(opened_paths) - {".metadata"} == {"__0_1.distcp"} and opened_paths.count("__0_1.distcp") == 2
    opened_paths.clear()
    coordinator = verify_part(path, skip=frozenset(nodes[1]))
    assert "__0_1.distcp" not in opened_paths and "__0_0.distcp" in opened_paths, opened_paths
    assert node.passed and coordinator.passed, (node.errors, coordinator.errors)
    assert node.stats["opened"] == sorted(nodes[1])
    assert coordinator.stats["opened"] == sorted([*_TOP, *nodes[0]])
    assert node.stats["bytes"] + coordinator.stats["bytes"] == whole.stats["bytes"]
    # The checks of each DCP folder as a whole (its metadata, the tiling of its tensors) are the coordinator's.
    assert not any(c.check == "metadata" for c in node.coverage)
    assert any(c.check == "metadata" for c in coordinator.coverage)

    from ckptverify.ownfiles.partsplan import dcp_folders

    assert dcp_folders(path) == list(_SUBS) and dcp_folders(os.path.join(path, _SUBS[0])) == [""]


def test_a_bit_flipped_in_a_node_s_shard_of_a_folder_names_that_node_and_the_shard(tmp_path: Path) -> None:
    path = _fsdp_folder(tmp_path)
    nodes = _folder_nodes(path)
    _plan_folder(path, nodes)
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    clean = _gather(path, wait_s=5)
    stamp = _stamp(Path(path))
    assert clean.verdict == "passed" and [p["opened"] for p in stamp["parts"]] == [sorted([*_TOP, *nodes[0]]),
                                                                                   sorted(nodes[1])]
    assert clean.bytes_checked == verify_checkpoint(path).stats["bytes"]
    assert not [n for n in os.listdir(path) if n.startswith(PARTS_PREFIX)]

    os.unlink(os.path.join(path, STAMP_FILE))
    sub = os.path.join(path, "optimizer_0")
    item = next(i for i in inj.tensor_zip_items(sub) if i.file == "__0_1.distcp")
    inj.flip_in_tensor_payload(sub, item.fqn)
    _plan_folder(path, nodes)
    assert parts_mod.part_job(path, 1, wait_s=0)["passed"] is False
    failed = _gather(path, wait_s=5)
    stamp = _stamp(Path(path))
    assert failed.verdict == "failed" and {p["node"]: p["verdict"] for p in stamp["parts"]} == {0: "passed",
                                                                                                 1: "failed"}
    named = [e["message"] for e in stamp["errors"] if e["check"] == "node-part-failed"]
    assert len(named) == 1 and "node 1 (host hostB" in named[0] and "optimizer_0/__0_1.distcp" in named[0], named
    assert {e["location"].get("file") for e in stamp["errors"] if e["check"] != "node-part-failed"} == {
        "optimizer_0/__0_1.distcp"}
    assert os.path.exists(os.path.join(sub, "__0_1.distcp"))  # evidence kept


def test_a_planted_plan_cannot_lead_a_part_out_of_the_folder_or_leave_its_own_files_unchecked(
        tmp_path: Path, opened_paths: list[str]) -> None:
    path = _fsdp_folder(tmp_path)
    (tmp_path / "outside").mkdir()
    _plain_dcp(tmp_path / "outside" / "x", {"w": torch.randn(8)})
    hostile = frozenset({"../outside/x/__0_0.distcp", "rng_state_1.pth", "optimizer_0/../../outside/__0_0.distcp",
                         "absent/__0_0.distcp", "../outside", "/etc/passwd"})
    opened_paths.clear()
    part = verify_part(path, only=hostile)
    assert part.stats["opened"] == [] and part.stats["bytes"] == 0 and not opened_paths, opened_paths
    # The files at the folder's top are always checked by the coordinator, whatever a plan gives away.
    coordinator = verify_part(path, skip=hostile)
    assert coordinator.passed and set(_TOP) <= set(coordinator.stats["opened"])
    assert coordinator.stats["bytes"] == verify_checkpoint(path).stats["bytes"]


def _folder_job(path: str, fingerprint: Any, opened: list[str] | None = None, deep: bool = False) -> dict[str, Any]:
    """:func:`_job_in_parts` for a folder of checkpoint files, each node given its shards in both DCP folders."""
    return _job_in_parts(path, fingerprint, opened, deep, nodes=_folder_nodes(path))


@pytest.mark.parametrize("weights", [False, True])
def test_a_folder_is_fingerprinted_in_parts_as_one_process_would_and_no_node_opens_another_s_shards(
        tmp_path: Path, opened_paths: list[str], weights: bool) -> None:
    import shutil

    from ckptverify.audit.adopt import fingerprint_checkpoint

    path = _fsdp_folder(tmp_path / "a", weights=weights)
    alone = str(tmp_path / "alone")
    shutil.copytree(path, alone)  # the same bytes, adopted by one process
    assert fingerprint_checkpoint(alone, force=True, trust_uncheckable=True)[1] is not None
    out = _folder_job(path, True, opened_paths)
    assert out["event"] == "checkpoint-verified", out
    note = out["extra"]["fingerprint"]
    assert note.startswith("manifest written") and "a manifest in each of 2 DCP folder(s), the digests of 1 other " \
        "node(s) taken from their parts" in note and "read" not in note, note
    # The manifests are the ones one process writes of the same bytes: the folder's and each DCP folder's.
    assert sorted(_manifests(path)) == ["", *_SUBS] and _manifests(path) == _manifests(alone)
    shards = {n for n in opened_paths if n.endswith(".distcp")}
    assert shards == {"part: __0_1.distcp", "coordinator: __0_0.distcp"}, opened_paths
    nodes = _folder_nodes(path)
    top = [*_TOP, *(["model.safetensors"] if weights else [])]
    stamp = _stamp(Path(path))
    assert stamp["passed"] and [p["opened"] for p in stamp["parts"]] == [sorted([*top, *nodes[0]]), sorted(nodes[1])]
    again = verify_checkpoint(path)
    assert again.passed and again.stats["manifest"], again.findings
    assert not [n for n in os.listdir(path) if n.startswith(PARTS_PREFIX)]


def test_auto_writes_the_manifest_a_folder_s_own_files_need_and_leaves_shards_a_crc_protects_to_their_nodes(
        tmp_path: Path, opened_paths: list[str]) -> None:
    from ckptverify.checks.dcp_pipeline import UNCHECKABLE

    path = _fsdp_folder(tmp_path, weights=True)  # model.safetensors: content no checksum protects
    out = _folder_job(path, "auto", opened_paths)
    assert out["event"] == "checkpoint-verified", out
    note = out["extra"]["fingerprint"]
    assert note.startswith("manifest written: 5 files at the top") and "none in optimizer_0, pytorch_model_fsdp_0: " \
        "their shards, under CRC-32, were verified on the nodes that wrote them" in note, note
    assert "coordinator: __0_1.distcp" not in opened_paths, opened_paths
    assert sorted(_manifests(path)) == [""]
    nodes = _folder_nodes(path)
    stamp = _stamp(Path(path))
    assert stamp["passed"] and stamp["parts"][1]["opened"] == sorted(nodes[1])
    assert not set(nodes[1]) & set(stamp["parts"][0]["opened"])
    again = verify_checkpoint(path)
    assert again.passed and not [f for f in again.findings if f.check == UNCHECKABLE], again.findings


def test_auto_writes_again_the_manifests_a_former_save_left_in_a_folder_s_dcp_folders(
        tmp_path: Path, opened_paths: list[str]) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint

    path = _fsdp_folder(tmp_path)
    assert fingerprint_checkpoint(path, force=True, trust_uncheckable=True)[1] is not None
    before = _manifests(path)
    for sub in _SUBS:  # saved again into the same place: the DCP folders' manifests are a former save's
        _plain_dcp(Path(path) / sub, {f"w{i}": torch.randn(4096) for i in range(4)})
    out = _folder_job(path, "auto", opened_paths)
    assert out["event"] == "checkpoint-verified", out
    assert "a manifest in each of 2 DCP folder(s), the digests of 1 other node(s)" in out["extra"]["fingerprint"]
    after = _manifests(path)
    assert sorted(after) == ["", *_SUBS] and all(after[s] != before[s] for s in _SUBS)
    assert "coordinator: __0_1.distcp" not in opened_paths, opened_paths
    assert verify_checkpoint(path).passed and _stamp(Path(path))["passed"]


def test_a_bit_flipped_in_a_node_s_shard_refuses_every_manifest_of_the_folder_and_names_the_node(
        tmp_path: Path) -> None:
    path = _fsdp_folder(tmp_path)
    sub = os.path.join(path, _SUBS[1])  # the second DCP folder: nothing may be written before it is judged
    item = next(i for i in inj.tensor_zip_items(sub) if i.file == "__0_1.distcp")
    inj.flip_in_tensor_payload(sub, item.fqn)
    out = _folder_job(path, True)
    assert out["event"] == "checkpoint-failed" and out["extra"]["fingerprint"].startswith("no manifest"), out
    assert _manifests(path) == {}
    stamp = _stamp(Path(path))
    named = [e["message"] for e in stamp["errors"] if e["check"] == "node-part-failed"]
    assert named == [f"the part of node 1 (host hostB, ranks [1]) failed: {_SUBS[1]}/__0_1.distcp"], stamp["errors"]
    assert os.path.exists(os.path.join(sub, "__0_1.distcp"))  # evidence kept


@pytest.mark.parametrize("planted", [None, {"folders": {"optimizer_0": {"x": 1}}}, {"folders": {}}])
def test_a_folder_part_without_usable_digests_has_its_shards_read_here_and_the_note_says_so(
        tmp_path: Path, opened_paths: list[str], monkeypatch: pytest.MonkeyPatch, planted: Any) -> None:
    real = parts_mod._part_checks

    def planting(*args: Any) -> Any:
        report, _ = real(*args)
        return report, planted

    monkeypatch.setattr(parts_mod, "_part_checks", planting)
    path = _fsdp_folder(tmp_path)
    out = _folder_job(path, True, opened_paths)
    assert out["event"] == "checkpoint-verified", out
    assert "the shards of 1 other node(s) read here" in out["extra"]["fingerprint"], out["extra"]
    assert "coordinator: __0_1.distcp" in opened_paths  # read here, and said so
    nodes = _folder_nodes(path)
    assert set(nodes[1]) <= set(_stamp(Path(path))["parts"][0]["opened"])
    assert sorted(_manifests(path)) == ["", *_SUBS] and verify_checkpoint(path).passed


def test_a_folder_s_dcp_folders_are_shared_out_fingerprinted_or_not_deep_or_not(
        tmp_path: Path) -> None:
    from ckptverify.integrations import Group, Verifier
    from ckptverify.options import VerifyOptions

    group = Group(coordinator=True, broadcast=lambda obj: obj, barrier=lambda: None,
                  gather=lambda obj: ["hostA", "hostB"])
    path = _fsdp_folder(tmp_path)
    for fingerprint in (False, "auto", True):
        for deep in (False, True):
            verifier = Verifier(verify=VerifyOptions(when="background", deep=deep), fingerprint=fingerprint)
            assert verifier._node_hosts(path, group) == ["hostA", "hostB"]

    from ckptverify.ownfiles.partsplan import plan_from_names

    plan = plan_from_names(path, ["hostA", "hostB"])  # every file here is rank 0's
    assert [n["files"] for n in plan["nodes"]] == [sorted(f for n in _folder_nodes(path) for f in n), []]


def test_a_plan_that_cannot_be_written_leaves_the_coordinator_to_verify_whole(tmp_path: Path) -> None:
    from ckptverify.errors import CkptVerifyWarning
    from ckptverify.ownfiles.partsplan import read_plan, share_out

    path = _fsdp_folder(tmp_path)
    os.mkdir(os.path.join(path, PARTS_PLAN))  # something not a file where the plan goes
    with pytest.warns(CkptVerifyWarning, match="cannot be shared out among nodes"):
        assert share_out(path, ["hostA", "hostB"]) is False
    os.rmdir(os.path.join(path, PARTS_PLAN))
    assert share_out(path, ["hostA", "hostB"], deep=True) is True
    assert read_plan(path)["deep"] is True  # type: ignore[index]


# ---------------------------------------------------------------------------------- deep, in parts


def _deep_planned(root: Path) -> str:
    """A hashing save in two files, node 1's holding NaNs and node 0's infinities, planned deep for two nodes."""
    from ckptverify.ownfiles.partsplan import make_plan, write_plan

    path = str(root / "ckpt")
    state = {f"w{i}": torch.randn(4096 * (i + 1)) for i in range(6)}
    state["w0"][:3] = float("nan")
    state["w5"][:2] = float("inf")
    cv.save(state, path, thread_count=2)
    files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
    write_plan(path, {**make_plan(["hostA", "hostB"], [files[:1], files[1:]]), "deep": True})
    return path


def _gather_deep(path: str, wait_s: float) -> Any:
    from ckptverify.verifier.stamper import VerifyingLock

    lock = VerifyingLock(path)
    assert lock.acquire()
    try:
        return parts_mod.stamp_parts_locked(path, step=7, jobs=1, settle=0.0, wait_s=wait_s, deep=True)
    finally:
        lock.release()


def _piece_files(records: list[Any]) -> set[str]:
    """The files of the tensor pieces a deep part recorded (its ``payload`` units)."""
    return {unit[3]["file"] for unit, _ in records if unit[0] == "payload"}


def _moved(unit: list[Any], **piece: Any) -> list[Any]:
    """A ``payload`` unit whose piece says ``piece`` instead."""
    return [*unit[:3], {**unit[3], **piece}]


def _kinds(findings: Any) -> list[tuple[str, str, str]]:
    return sorted((f.check, f.severity.value, f.message) for f in findings)


def test_a_deep_check_in_parts_gives_the_findings_of_one_process_and_each_node_reads_its_own_file(
        tmp_path: Path, opened_paths: list[str]) -> None:
    path = _deep_planned(tmp_path)
    whole = verify_checkpoint(path, deep=True)
    assert whole.passed and any(f.check == "nonfinite" for f in whole.findings)
    opened_paths.clear()
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    part_opened = set(opened_paths) - {".metadata", "ckptverify.manifest.json"}
    data = json.loads(Path(parts_mod.part_verdict_path(path, 1)).read_text())
    assert _piece_files(data["deep"]) == {"__0_1.distcp"}
    opened_paths.clear()
    result = _gather_deep(path, wait_s=5)
    coordinator_opened = set(opened_paths)
    assert part_opened == {"__0_1.distcp"} and "__0_1.distcp" not in coordinator_opened, coordinator_opened
    stamp = _stamp(Path(path))
    assert result.verdict == "passed" and stamp["passed"] and stamp["deep"], stamp
    assert [p["opened"] for p in stamp["parts"]] == [["__0_0.distcp"], ["__0_1.distcp"]]
    # Every tensor rebuilt from the two nodes' pieces, and judged as one process judges them.
    assert _kinds(result.report.findings) == _kinds(whole.findings)
    fingerprinted = [c.count for c in result.report.coverage if c.check == "fingerprint"]
    assert fingerprinted == [c.count for c in whole.coverage if c.check == "fingerprint"] == [6]


@pytest.mark.parametrize("planted", ["none", "garbage", "foreign", "chunk-outside", "no-piece"])
def test_a_deep_part_without_its_own_pieces_did_not_report(tmp_path: Path, planted: str) -> None:
    path = _deep_planned(tmp_path)
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    data = json.loads(verdict.read_text())
    unit, scan = next(r for r in data["deep"] if r[0][0] == "payload")
    data["deep"] = {"none": None, "garbage": [[1, 2]],
                    "foreign": [[_moved(unit, file="__0_0.distcp"), scan]],  # a file that is not its own
                    "chunk-outside": [[_moved(unit, chunk_offsets=[10**9]), scan]],
                    "no-piece": [[unit[:3], scan]]}[planted]  # a payload unit that names no piece
    verdict.write_text(json.dumps(data))
    result = _gather_deep(path, wait_s=0.5)
    assert result.verdict == "unverified" and not (Path(path) / STAMP_FILE).exists()
    assert "node 1 (host hostB, ranks [1])" in result.reason and "__0_1.distcp" in result.reason


def test_deep_records_that_cannot_be_merged_make_the_coordinator_read_every_piece_itself(
        tmp_path: Path, opened_paths: list[str]) -> None:
    path = _deep_planned(tmp_path)
    whole = verify_checkpoint(path, deep=True)
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    data = json.loads(verdict.read_text())
    # Its pieces in its file, but of tensors shaped otherwise: no unit the coordinator asks for.
    data["deep"] = [[[*u[:2], [n + 1 for n in u[2]], u[3]] if u[0] == "payload" else u, r] for u, r in data["deep"]]
    verdict.write_text(json.dumps(data))
    opened_paths.clear()
    result = _gather_deep(path, wait_s=5)
    assert result.verdict == "passed" and "__0_1.distcp" in opened_paths, opened_paths
    assert _kinds(result.report.findings) == _kinds(whole.findings)


def _deep_folder(root: Path) -> str:
    """:func:`_fsdp_folder` whose DCP folders hold NaNs and infinities in both nodes' shards, planned deep."""
    path = _fsdp_folder(root)
    for sub in _SUBS:
        state = {f"w{i}": torch.randn(4096 * (i + 1)) for i in range(4)}
        state["w0"][:3] = float("nan")
        state["w3"][:2] = float("inf")
        _plain_dcp(Path(path) / sub, state)
    _plan_folder(path, _folder_nodes(path), deep=True)
    return path


def test_a_deep_check_of_a_folder_in_parts_gives_the_findings_of_one_process_and_no_node_reads_another_s_shard(
        tmp_path: Path, opened_paths: list[str]) -> None:
    path = _deep_folder(tmp_path)
    whole = verify_checkpoint(path, deep=True)
    assert whole.passed and any(f.check == "nonfinite" for f in whole.findings), whole.findings
    assert whole.stats["deep"] and not verify_checkpoint(path).stats["deep"]  # what a stamp records
    opened_paths.clear()
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    part_opened = set(opened_paths) - {".metadata", "ckptverify.manifest.json"}
    data = json.loads(Path(parts_mod.part_verdict_path(path, 1)).read_text())
    assert sorted(data["deep"]["folders"]) == list(_SUBS)
    assert all(_piece_files(records) == {"__0_1.distcp"} for records in data["deep"]["folders"].values())
    opened_paths.clear()
    result = _gather_deep(path, wait_s=5)
    assert part_opened == {"__0_1.distcp"} and "__0_1.distcp" not in opened_paths, opened_paths
    stamp = _stamp(Path(path))
    nodes = _folder_nodes(path)
    assert result.verdict == "passed" and stamp["passed"] and stamp["deep"], stamp
    assert [p["opened"] for p in stamp["parts"]] == [sorted([*_TOP, *nodes[0]]), sorted(nodes[1])]
    # Every tensor of both DCP folders rebuilt from the two nodes' pieces, and judged as one process judges them.
    assert _kinds(result.report.findings) == _kinds(whole.findings)
    assert {f.location.file for f in result.report.findings if f.check == "nonfinite"} == \
        {f.location.file for f in whole.findings if f.check == "nonfinite"}
    fingerprinted = [c.count for c in result.report.coverage if c.check == "fingerprint"]
    assert fingerprinted == [c.count for c in whole.coverage if c.check == "fingerprint"] and fingerprinted[0] >= 8


@pytest.mark.parametrize("planted", ["flat", "one-folder", "foreign-folder", "foreign-file"])
def test_a_deep_folder_part_that_does_not_bring_each_of_its_folders_pieces_did_not_report(
        tmp_path: Path, planted: str) -> None:
    path = _deep_folder(tmp_path)
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    verdict = Path(parts_mod.part_verdict_path(path, 1))
    data = json.loads(verdict.read_text())
    folders = data["deep"]["folders"]
    unit, scan = next(r for r in folders[_SUBS[0]] if r[0][0] == "payload")
    data["deep"] = {"flat": folders[_SUBS[0]],  # a DCP folder's pieces, not the folder's
                    "one-folder": {"folders": {_SUBS[0]: folders[_SUBS[0]]}},
                    "foreign-folder": {"folders": {**folders, "elsewhere_0": []}},
                    "foreign-file": {"folders": {**folders, _SUBS[0]: [[_moved(unit, file="__0_0.distcp"),
                                                                        scan]]}}}[planted]
    verdict.write_text(json.dumps(data))
    result = _gather_deep(path, wait_s=0.5)
    assert result.verdict == "unverified" and not (Path(path) / STAMP_FILE).exists()
    assert "node 1 (host hostB, ranks [1])" in result.reason and f"{_SUBS[0]}/__0_1.distcp" in result.reason


def _nonfinite(state: dict[str, Any]) -> dict[str, Any]:
    state["w0"][:3] = float("nan")
    state["w3"][:2] = float("inf")
    return state


@pytest.mark.parametrize("layout", ["dcp", "folder"])
def test_a_deep_check_of_a_save_fingerprinted_in_parts_is_judged_against_the_manifest_written_from_them(
        tmp_path: Path, opened_paths: list[str], layout: str) -> None:
    import shutil

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.ownfiles.manifest import read_manifest

    if layout == "dcp":
        path = _plain_dcp(tmp_path / "a" / "ckpt", _nonfinite(_mixed_state()))
    else:
        path = _fsdp_folder(tmp_path / "a")
        for sub in _SUBS:
            _plain_dcp(Path(path) / sub, _nonfinite({f"w{i}": torch.randn(4096 * (i + 1)) for i in range(4)}))
    alone = str(tmp_path / "alone")
    shutil.copytree(path, alone)
    assert fingerprint_checkpoint(alone, force=True, trust_uncheckable=True)[1] is not None
    opened_paths.clear()
    out = (_job_in_parts if layout == "dcp" else _folder_job)(path, True, opened_paths, deep=True)
    shards = {n for n in opened_paths if n.endswith(".distcp")}
    assert shards == {"part: __0_1.distcp", "coordinator: __0_0.distcp"}, opened_paths
    assert out["event"] == "checkpoint-verified", out
    assert "the digests of 1 other node(s) taken from their parts" in out["extra"]["fingerprint"], out["extra"]
    # The manifest one process writes, and the deep check one process makes of the checkpoint with it.
    got = _manifests(path) if layout == "folder" else {"": _without_times(read_manifest(path))}
    want = _manifests(alone) if layout == "folder" else {"": _without_times(read_manifest(alone))}
    assert got == want
    whole = verify_checkpoint(path, deep=True)
    stamp = _stamp(Path(path))
    assert stamp["passed"] and stamp["deep"] and any(f.check == "nonfinite" for f in whole.findings)
    written = [f for f in Report.from_dict(out["report"]).findings if f.check != "manifest-written"]
    assert _kinds(written) == _kinds(whole.findings)
    rebuilt = [c["count"] for c in stamp["coverage"] if c["check"] == "fingerprint"]
    assert rebuilt == [c.count for c in whole.coverage if c.check == "fingerprint"] and rebuilt[0] >= 6, rebuilt


def test_a_deep_check_over_a_former_save_s_manifest_fingerprints_again_and_judges_against_the_new_one(
        tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint

    target = tmp_path / "ckpt"
    _plain_dcp(target, {f"w{i}": torch.zeros(4096) for i in range(6)})
    assert fingerprint_checkpoint(str(target))[1] is not None
    path = _plain_dcp(target, _nonfinite({f"w{i}": torch.randn(4096) for i in range(6)}))  # saved again there
    out = _job_in_parts(path, "auto", deep=True)
    assert out["event"] == "checkpoint-verified" and out["extra"]["fingerprint"].startswith("manifest written"), out
    stamp = _stamp(target)
    assert stamp["passed"] and stamp["deep"] and not [e for e in stamp["errors"] if e["check"] == "node-part-failed"]
    assert verify_checkpoint(path, deep=True).passed


def test_a_deep_check_whose_manifest_was_refused_is_not_judged_against_a_former_save_s(tmp_path: Path) -> None:
    from ckptverify.audit.adopt import fingerprint_checkpoint

    target = tmp_path / "ckpt"
    _plain_dcp(target, {f"w{i}": torch.zeros(4096) for i in range(6)})
    assert fingerprint_checkpoint(str(target))[1] is not None
    path = _plain_dcp(target, {f"w{i}": torch.randn(4096) for i in range(6)})  # saved again there
    on_node_1 = next(i.fqn for i in inj.tensor_zip_items(path) if i.file == "__0_1.distcp")
    inj.flip_in_tensor_payload(path, on_node_1)
    out = _job_in_parts(path, True, deep=True)
    assert out["event"] == "checkpoint-failed" and out["extra"]["fingerprint"].startswith("no manifest"), out
    stamp = _stamp(target)
    assert stamp["deep"] and any(e["check"] == "node-part-failed" for e in stamp["errors"]), stamp["errors"]
    # The pieces of every tensor were judged against no manifest: the former save's zeros are not "what was in
    # memory at save time", so no tensor is said to differ from them.
    assert not [e for e in stamp["errors"] if e["check"] == "fingerprint"], stamp["errors"]



@pytest.fixture
def scanned_pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Every tensor piece fingerprinted (``scan_payload``: the one read of a piece's values), as (tensor, file,
    offset)."""
    from ckptverify.checks import deep

    seen: list[tuple[str, str, int]] = []
    original = deep.scan_payload

    def counting(f: Any, name: str, p: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((name, p.file, p.offset))
        return original(f, name, p, *args, **kwargs)

    monkeypatch.setattr(deep, "scan_payload", counting)
    return seen


@pytest.fixture
def byte_passes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int, int]]:
    """Every byte range read by a verification's passes over the bytes, here or as a work unit, as (pass, path, start,
    end): ``crc`` (CRC-32 of records) and ``blocks`` (block digests against a manifest, ``hash_task``)."""
    from ckptverify.checks import manifest_check

    seen: list[tuple[str, str, int, int]] = []
    hash_task, crc32 = manifest_check.hash_task, readers.ReadOnlyFile.crc32

    def blocks(f: Any, task: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(("blocks", f.path, task.start, task.end))
        return hash_task(f, task, *args, **kwargs)

    def crc(f: Any, start: int, end: int) -> Any:
        seen.append(("crc", f.path, start, end))
        return crc32(f, start, end)

    monkeypatch.setattr(manifest_check, "hash_task", blocks)
    monkeypatch.setattr(readers.ReadOnlyFile, "crc32", crc)
    return seen


@pytest.mark.parametrize(("layout", "fingerprint"), [("dcp", "auto"), ("dcp", True), ("folder", "auto"),
                                                     ("folder", True)])
def test_a_deep_check_fingerprinted_in_parts_scans_each_of_the_coordinator_s_pieces_once(
        tmp_path: Path, scanned_pieces: list[tuple[str, str, int]], byte_passes: list[tuple[str, str, int, int]],
        layout: str, fingerprint: Any) -> None:
    import shutil
    from collections import Counter

    from ckptverify.audit.adopt import fingerprint_checkpoint
    from ckptverify.checks.deep import CHECKS
    from ckptverify.ownfiles.manifest import MANIFEST_FILE
    from ckptverify.verifier.saved import saved_job

    def state(prefix: str = "") -> dict[str, Any]:  # each DCP folder's tensors named apart: pieces told apart
        return {f"{prefix}{k}": t for k, t in _nonfinite({f"w{i}": torch.randn(4096 * (i + 1))
                                                          for i in range(6)}).items()}

    if layout == "dcp":  # in safetensors: content no CRC-32 protects, which "auto" fingerprints
        path = _plain_dcp(tmp_path / "ckpt", state(), safetensors=True)
        files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
        nodes = [files[:1], files[1:]]
        _plan_folder(path, nodes, fingerprint, deep=True)
    else:  # a model.safetensors beside the DCP folders: the same
        path = _fsdp_folder(tmp_path, weights=True)
        for sub in _SUBS:
            _plain_dcp(Path(path) / sub, state(f"{sub}."))
        nodes = _folder_nodes(path)
        _plan_folder(path, nodes, fingerprint, deep=True)
    alone = str(tmp_path / "alone")
    shutil.copytree(path, alone)
    for name in os.listdir(alone):
        if name.startswith(PARTS_PREFIX):
            os.unlink(os.path.join(alone, name))
    assert parts_mod.part_job(path, 1, wait_s=0)["written"]
    scanned_pieces.clear()
    byte_passes.clear()
    out = saved_job(path, 5, fingerprint, 1, True, 0.0, parts=True)
    assert out["event"] == "checkpoint-verified" and out["extra"]["fingerprint"].startswith("manifest written"), out
    # Judged against the former manifest (none here) when "auto", adopted, judged against the manifest written:
    # each of this node's pieces read once for all three, none of the other node's.
    shards = Counter((name, file, offset) for name, file, offset in scanned_pieces if file.endswith(".distcp"))
    assert {file for _, file, _ in shards} == {n.rpartition("/")[2] for n in nodes[0]}
    assert set(shards.values()) == {1}, shards
    # Its bytes go through each pass once per verification: the deep check's and the adoption's own. Judged before
    # the adoption ("auto"), the manifest written judges the same scans and reads nothing again: no block of it is
    # digested against that manifest (True: the deep check runs once, after the adoption).
    passes = Counter(r for r in byte_passes if r[1].endswith(".distcp"))
    assert {p[1] for p in passes} <= {os.path.join(path, n) for n in nodes[0]}, passes
    assert max((n for p, n in passes.items() if p[0] == "crc"), default=0) <= 2, passes
    assert {n for p, n in passes.items() if p[0] == "blocks"} == ({1} if fingerprint is True else set()), passes
    # The manifest one process writes, and the deep check one process makes with it.
    assert fingerprint_checkpoint(alone, force=True, trust_uncheckable=True)[1] is not None
    want = _manifests(alone)
    if layout == "folder" and fingerprint == "auto":  # its DCP folders, under CRC-32, are left without one
        want = {"": want[""]}
        for sub in _SUBS:
            os.unlink(os.path.join(alone, sub, MANIFEST_FILE))
    assert _manifests(path) == want
    whole = verify_checkpoint(alone, deep=True)
    report = Report.from_dict(out["report"])
    assert report.passed and any(f.check == "nonfinite" for f in whole.findings)
    assert _kinds(f for f in report.findings if f.check in CHECKS) == _kinds(f for f in whole.findings
                                                                            if f.check in CHECKS)
    assert [c.count for c in report.coverage if c.check == "fingerprint"] == \
        [c.count for c in whole.coverage if c.check == "fingerprint"]
