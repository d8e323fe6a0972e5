"""A save's background verification shared out among the nodes that wrote it, with real ranks (gloo) as nodes:
``cv.save``/``cv.async_save``, the integrations' ``Verifier``, Lightning's and accelerate's groups, transformers'
FSDP ``checkpoint-N``.

Two "nodes" are simulated on one machine: each rank names its node with ``CKPTVERIFY_NODE`` (the override for
where host names do not tell nodes apart). Each node's part must open only its node's files; the coordinator
stamps once every part reported: passed, failed naming the node and file, or unverified naming a silent node.

Every scenario runs in one pair of ranks, one after the other, each in its own folder (the module's fixture):
starting ranks, importing the frameworks in them and starting each rank's verifier process (which imports torch to
fingerprint) are the slow part. Each rank keeps its process's default verifier (a verifier process) from one
scenario to the next, as a training process does from one save to the next; the tests read what each scenario
left.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj
from helpers.multiproc import spawn_ranks
from helpers.nodeparts import SUBS as _SUBS
from helpers.nodeparts import flip_keeping_mtime as _flip_keeping_mtime
from helpers.nodeparts import manifests as _manifests
from helpers.nodeparts import stamp_of as _stamp

import ckptverify as cv
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.ownfiles.events import read_events
from ckptverify.ownfiles.names import PARTS_PREFIX, STAMP_FILE
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import parts as parts_mod

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------- the scenarios, in the ranks


def _nodes_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    from ckptverify.verifier import background

    warnings.simplefilter("ignore")
    os.environ[parts_mod.NODE_ENV] = f"node{rank}"  # each rank its own node
    out: dict[str, Any] = {"rank": rank, "verdicts": {}}

    def save(step: int) -> None:
        state = {f"w.{rank}": torch.full((4096,), float(step + rank)), "shared": torch.arange(1024.0) * step}
        cv.save(state, os.path.join(root, f"step_{step}"), verify="background", events=root)
        out[f"waited_{step}"] = cv.wait_for_verifications(timeout=240)
        last = cv.last_verification()
        out["verdicts"][step] = None if last is None else last.to_dict()
        dist.barrier()

    def plant(path: str) -> None:
        if path.endswith("step_2"):
            out["fault"] = _flip_keeping_mtime(path, "w.1").file
        elif path.endswith("step_3"):
            raise RuntimeError("this node's verifier is gone")

    try:
        save(1)
        if rank == 1:
            background.default_verifier().before_verify = plant
        dist.barrier()
        save(2)  # a bit flipped in node 1's file, by node 1, before its part reads it
        save(3)  # node 1's part never reports
        os.environ[parts_mod.NODE_ENV] = "node0"  # both ranks on one node: one part, as without nodes
        save(4)
        os.environ[parts_mod.NODE_ENV] = f"node{rank}"
        state = {f"w.{rank}": torch.full((4096,), 5.0 + rank), "shared": torch.arange(1024.0)}
        cv.async_save(state, os.path.join(root, "step_5"), verify="background", events=root).result()
        out["waited_5"] = cv.wait_for_verifications(timeout=240)
        dist.barrier()
        out["has_verifier"] = background._default is not None
    finally:
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)


@contextlib.contextmanager
def _as_node(rank: int, root: str, flip_in: str | None = None) -> Iterator[dict[str, Any]]:
    """Rank ``rank`` of a two-node test as node ``node{rank}``: yields what it records, written to ``rankN.json``
    however the body ends. ``flip_in``: node 1's verifier first flips a bit of ``w.1`` in the checkpoint whose
    path ends so (its times kept), as silent corruption would."""
    from ckptverify.verifier import background

    warnings.simplefilter("ignore")
    os.environ[parts_mod.NODE_ENV] = f"node{rank}"
    if rank == 1 and flip_in is not None:
        background.default_verifier().before_verify = (
            lambda p: _flip_keeping_mtime(p, "w.1") and None if p.endswith(flip_in) else None)
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f, default=str)


def _integration_worker(rank: int, world: int, root: str) -> None:
    from ckptverify.integrations import Verifier, torch_group

    with _as_node(rank, root, flip_in="step_2") as out:
        verifier = Verifier(verify="background", fingerprint=False)
        for step in (1, 2):
            path = os.path.join(root, f"step_{step}")
            # What torchtitan's VerifiedCheckpointManager does: a hashing save, then the check of what it wrote.
            cv.save({f"w.{rank}": torch.full((4096,), float(step + rank)), "shared": torch.arange(512.0)}, path)
            out[f"pending_{step}"] = verifier.after_save(path, step=step, group=torch_group(),
                                                         fingerprint=False).pending
        arrived = verifier.wait(group=torch_group(), timeout=240)
        out["arrived"] = {v.step: v.verdict for v in arrived}


def _deep_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    from ckptverify.options import VerifyOptions

    with _as_node(rank, root, flip_in="step_2") as out:
        out["verdicts"] = {}
        for step in (1, 2):
            state = {f"w.{rank}": torch.full((4096,), float(step + rank)), "shared": torch.arange(1024.0) * step}
            cv.save(state, os.path.join(root, f"step_{step}"), verify=VerifyOptions(when="background", deep=True),
                    events=root)
            out[f"waited_{step}"] = cv.wait_for_verifications(timeout=240)
            last = cv.last_verification()
            out["verdicts"][step] = None if last is None else last.to_dict()
            dist.barrier()


def _integration_deep_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptverify.integrations import Verifier, torch_group
    from ckptverify.options import VerifyOptions

    with _as_node(rank, root) as out:
        for step, fingerprint in ((1, False), (2, "auto"), (3, True)):
            verifier = Verifier(verify=VerifyOptions(when="background", deep=True), fingerprint=fingerprint)
            path = os.path.join(root, f"step_{step}")
            state = {f"w.{rank}": torch.full((4096,), float(step + rank)), "shared": torch.arange(512.0)}
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path))  # the framework's own save, no manifest
            out[f"pending_{step}"] = verifier.after_save(path, step=step, group=torch_group()).pending
            out[f"arrived_{step}"] = {v.step: v.verdict for v in verifier.wait(group=torch_group(), timeout=240)}
            dist.barrier()


def _framework_groups(rank: int) -> dict[str, Any]:
    """The groups the Lightning and accelerate integrations build, on a stand-in for the trainer and the
    accelerator (both run on the default process group)."""
    import dataclasses
    import types

    import torch.distributed as dist

    from ckptverify.integrations import accelerate as acc_mod
    from ckptverify.integrations.lightning import VerifyCheckpointsCallback

    strategy = types.SimpleNamespace(broadcast=lambda obj, src=0: _broadcast(obj))
    trainer = types.SimpleNamespace(strategy=strategy, world_size=2, is_global_zero=rank == 0, global_rank=rank)
    accelerator = types.SimpleNamespace(num_processes=2, is_main_process=rank == 0, process_index=rank,
                                        wait_for_everyone=dist.barrier)
    # accelerate's own broadcast needs its process state set up (no Accelerator here): the group's gather, the
    # integration's own, is what is under test.
    return {"lightning": VerifyCheckpointsCallback._group(VerifyCheckpointsCallback(), trainer),  # type: ignore[arg-type]
            "accelerate": dataclasses.replace(acc_mod._group(accelerator), broadcast=_broadcast)}


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _auto_worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptverify.integrations._core import Verifier

    with _as_node(rank, root, flip_in="step_2") as out:
        groups = _framework_groups(rank)
        out["gather"] = {k: g.gather is not None for k, g in groups.items()}
        verifier = Verifier(verify="background")  # fingerprint="auto", the integrations' default
        for step, framework in ((1, "lightning"), (2, "accelerate"), (3, "lightning"), (4, "accelerate")):
            path = os.path.join(root, f"step_{step}")
            state = {f"w.{rank}": torch.full((4096,), float(step + rank)), "shared": torch.arange(512.0)}
            kwargs: dict[str, Any] = {}
            if step == 3:  # content no CRC-32 protects: fingerprinted ("auto"), in parts
                from torch.distributed.checkpoint.filesystem import SerializationFormat

                kwargs["serialization_format"] = SerializationFormat.SAFETENSORS
            # The framework's own DCP save (no manifest), then the integration's check of what it wrote.
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, **kwargs))
            dist.barrier()
            # Step 4: a manifest asked for (fingerprint=True) over bytes every CRC-32 protects.
            out[f"pending_{step}"] = verifier.after_save(path, step=step, group=groups[framework],
                                                         fingerprint=True if step == 4 else None).pending
        arrived = verifier.wait(group=groups["lightning"], timeout=240)
        out["arrived"] = {v.step: v.verdict for v in arrived}


def _fsdp_worker(rank: int, world: int, root: str, fingerprint: Any, deep: bool) -> None:
    """Two saves as transformers' ``Trainer`` writes them under FSDP (``SHARDED_STATE_DICT``): every rank writes
    its shards of the model and the optimizer through DCP and its own ``rng_state_R.pth``, rank 0 the rest; then
    the transformers callback's ``on_save`` (with ``fingerprint`` and ``deep``), and ``on_train_end`` at the
    end."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptverify.integrations.transformers import VerifyCheckpointsCallback
    from ckptverify.verifier import background

    with _as_node(rank, root) as out:
        from ckptverify.options import VerifyOptions

        callback = VerifyCheckpointsCallback(verify=VerifyOptions(when="background", deep=deep),
                                             fingerprint=fingerprint)
        args = SimpleNamespace(output_dir=root)
        if rank == 1:
            def flip(path: str) -> None:
                if path.endswith("checkpoint-2"):
                    sub = os.path.join(path, "pytorch_model_fsdp_0")
                    item = next(i for i in inj.tensor_zip_items(sub) if i.file == "__1_0.distcp")
                    out["fault"] = f"pytorch_model_fsdp_0/{_flip_keeping_mtime(sub, item.fqn).file}"

            background.default_verifier().before_verify = flip
        for step in (1, 2):
            path = os.path.join(root, f"checkpoint-{step}")
            os.makedirs(path, exist_ok=True)
            model = {f"layer.{rank}.weight": torch.full((4096,), float(step + rank)), "bias": torch.arange(64.0)}
            dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(os.path.join(path, "pytorch_model_fsdp_0")))
            optim = {f"state.{rank}.exp_avg": torch.full((4096,), 0.5 * step), "lr": 1e-3}
            dcp.save({"optimizer": optim}, storage_writer=dcp.FileSystemWriter(os.path.join(path, "optimizer_0")))
            torch.save({"cpu": torch.get_rng_state()}, os.path.join(path, f"rng_state_{rank}.pth"))
            if rank == 0:
                torch.save({"last_epoch": step}, os.path.join(path, "scheduler.pt"))
                with open(os.path.join(path, "trainer_state.json"), "w") as f:
                    json.dump({"global_step": step}, f)
            callback.on_save(args, SimpleNamespace(global_step=step), None)
            out[f"pending_{step}"] = callback.verdicts[-1].pending
            dist.barrier()
        callback.on_train_end(args, SimpleNamespace(global_step=2), None)
        out["verdicts"] = {v.step: v.verdict for v in callback.verdicts}


_FSDP_CASES = [("auto", False), (True, False), (False, True)]


def _fsdp_name(fingerprint: Any, deep: bool) -> str:
    return f"fsdp-{fingerprint}-{deep}"


#: ``(folder, worker, part timeout in seconds, extra arguments)``, in the order the ranks run them. The silent node
#: of the first is waited for as long as its part timeout: the others, whose every part reports, have a generous
#: one.
_SCENARIOS: list[tuple[str, Any, int, tuple[Any, ...]]] = [
    ("nodes", _nodes_worker, 30, ()),
    ("integration", _integration_worker, 120, ()),
    ("deep", _deep_worker, 120, ()),
    ("integration-deep", _integration_deep_worker, 120, ()),
    ("frameworks", _auto_worker, 120, ()),
    *((_fsdp_name(f, d), _fsdp_worker, 120, (f, d)) for f, d in _FSDP_CASES),
]


def _scenarios_worker(rank: int, world: int, root: str) -> None:
    """Every scenario of :data:`_SCENARIOS` in turn, each in its own folder under ``root``, its verifications all
    finished on both ranks before the next begins."""
    import torch.distributed as dist

    from ckptverify.verifier import background

    for name, worker, part_timeout, args in _SCENARIOS:
        if os.environ.get(parts_mod.PART_TIMEOUT_ENV) != str(part_timeout):
            # The verifier process reads the part timeout from its environment when it starts: a new timeout
            # needs a new one (the first scenario's verifier process verifies without torch: nothing is lost).
            if background._default is not None:
                background._default.close(timeout=240)
                background._default = None
            os.environ[parts_mod.PART_TIMEOUT_ENV] = str(part_timeout)
        if background._default is not None:
            background._default.before_verify = None  # the damage a former scenario planted is not this one's
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        dist.barrier()
        worker(rank, world, folder, *args)
        if background._default is not None:
            background._default.wait(timeout=240)
        dist.barrier()


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of every scenario's folder, after two gloo ranks (each its own node, reads unthrottled) ran
    them all."""
    root = tmp_path_factory.mktemp("parts-among-nodes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CKPTVERIFY_VERIFY_THROTTLE", "0")
        mp.delenv(parts_mod.PART_TIMEOUT_ENV, raising=False)
        spawn_ranks(_scenarios_worker, 2, str(root))
    return root


def _ranks(folder: Path) -> list[Any]:
    """What each rank of a scenario wrote to ``rankN.json``."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


# ---------------------------------------------------------------------------------- two nodes, cv.save


def test_two_nodes_verify_their_own_files_and_one_stamp_names_a_failed_or_silent_node(scenarios: Path) -> None:
    tmp_path = scenarios / "nodes"
    ranks = _ranks(tmp_path)
    assert all(r[f"waited_{s}"] for r in ranks for s in (1, 2, 3, 4)), ranks
    verdicts = ranks[0]["verdicts"]
    # Rank 1 verified its node's part in its own verifier; the coordinator alone reports verdicts.
    assert ranks[1]["has_verifier"] and all(v is None for v in ranks[1]["verdicts"].values())

    clean = _stamp(tmp_path / "step_1")
    assert clean["passed"] and verdicts["1"]["verdict"] == "passed"
    by_node = {p["node"]: p for p in clean["parts"]}
    assert [by_node[k]["host"] for k in (0, 1)] == ["node0", "node1"]
    assert by_node[0]["ranks"] == [0] and by_node[1]["ranks"] == [1]
    files = {n for n in os.listdir(tmp_path / "step_1") if n.endswith(".distcp")}
    for k in (0, 1):
        # No part read another node's files: each opened exactly the files its ranks wrote.
        assert by_node[k]["opened"] == by_node[k]["files"] == sorted(n for n in files if n.startswith(f"__{k}_"))
    sizes = {n: (tmp_path / "step_1" / n).stat().st_size for n in files}
    assert clean["bytes_checked"] == sum(sizes.values()) == sum(p["bytes"] for p in clean["parts"])
    assert not [n for n in os.listdir(tmp_path / "step_1") if n.startswith(PARTS_PREFIX)]  # tidied after stamping
    assert read_stamp(tmp_path / "step_1").current

    failed = _stamp(tmp_path / "step_2")
    fault = ranks[1]["fault"]
    assert fault.startswith("__1_") and not failed["passed"] and verdicts["2"]["verdict"] == "failed"
    named = [e for e in failed["errors"] if e["check"] == "node-part-failed"]
    assert len(named) == 1 and "node 1 (host node1" in named[0]["message"] and fault in named[0]["message"], named
    assert {e["location"].get("file") for e in failed["errors"] if e["check"] != "node-part-failed"} == {fault}
    assert {p["node"]: p["verdict"] for p in failed["parts"]} == {0: "passed", 1: "failed"}
    assert (tmp_path / "step_2" / fault).exists()  # evidence kept

    silent = verdicts["3"]
    assert silent["verdict"] == "unverified" and not (tmp_path / "step_3" / STAMP_FILE).exists()
    assert "node 1 (host node1, ranks [1])" in silent["reason"] and "__1_0.distcp" in silent["reason"], silent

    one_node = _stamp(tmp_path / "step_4")
    assert one_node["passed"] and "parts" not in one_node
    after_upload = _stamp(tmp_path / "step_5")  # async_save: the parts are queued once the upload committed
    assert after_upload["passed"] and [p["opened"] for p in after_upload["parts"]] == [["__0_0.distcp"],
                                                                                     ["__1_0.distcp"]]
    events = [(e["event"], e["step"], e["rank"]) for e in read_events(tmp_path) if e["event"].startswith("checkpoint-")]
    assert events == [("checkpoint-verified", 1, 0), ("checkpoint-failed", 2, 0), ("checkpoint-unverified", 3, 0),
                      ("checkpoint-verified", 4, 0), ("checkpoint-verified", 5, 0)], events


def test_a_deep_background_check_after_a_save_is_shared_out_among_nodes(scenarios: Path) -> None:
    tmp_path = scenarios / "deep"
    ranks = _ranks(tmp_path)
    assert all(r["waited_1"] and r["waited_2"] for r in ranks), ranks
    verdicts = ranks[0]["verdicts"]
    clean = _stamp(tmp_path / "step_1")
    assert verdicts["1"]["verdict"] == "passed" and clean["passed"] and clean["deep"], clean
    assert [p["opened"] for p in clean["parts"]] == [["__0_0.distcp"], ["__1_0.distcp"]]
    assert any(c["check"] == "fingerprint" and c["count"] == 3 for c in clean["coverage"]), clean["coverage"]
    failed = _stamp(tmp_path / "step_2")
    named = [e["message"] for e in failed["errors"] if e["check"] == "node-part-failed"]
    assert verdicts["2"]["verdict"] == "failed" and not failed["passed"] and failed["deep"]
    assert len(named) == 1 and "node 1 (host node1" in named[0] and "__1_0.distcp" in named[0], failed["errors"]
    assert (tmp_path / "step_2" / "__1_0.distcp").exists()  # evidence kept


# ---------------------------------------------------------------------------------- the integrations' path


def test_an_integration_s_background_check_is_shared_out_among_nodes_too(scenarios: Path) -> None:
    tmp_path = scenarios / "integration"
    ranks = _ranks(tmp_path)
    assert all(r["pending_1"] and r["pending_2"] for r in ranks), ranks
    assert ranks[0]["arrived"] == ranks[1]["arrived"] == {"1": "passed", "2": "failed"}, ranks
    clean = _stamp(tmp_path / "step_1")
    assert clean["passed"] and [p["opened"] for p in clean["parts"]] == [["__0_0.distcp"], ["__1_0.distcp"]]
    failed = _stamp(tmp_path / "step_2")
    named = [e["message"] for e in failed["errors"] if e["check"] == "node-part-failed"]
    assert len(named) == 1 and "node 1 (host node1" in named[0] and "__1_0.distcp" in named[0], failed["errors"]
    events = {(e["event"], e["step"]) for e in read_events(tmp_path) if e["event"].startswith("checkpoint-")}
    assert events == {("checkpoint-verified", 1), ("checkpoint-failed", 2)}, events


def test_an_integration_s_deep_check_is_shared_out_fingerprinted_or_not(scenarios: Path) -> None:
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    tmp_path = scenarios / "integration-deep"
    ranks = _ranks(tmp_path)
    for step in (1, 2, 3):
        assert all(r[f"arrived_{step}"] == {str(step): "passed"} for r in ranks), ranks
        stamp = _stamp(tmp_path / f"step_{step}")
        assert stamp["deep"] and [p["opened"] for p in stamp["parts"]] == [["__0_0.distcp"], ["__1_0.distcp"]]
        assert any(c["check"] == "fingerprint" and c["count"] == 3 for c in stamp["coverage"]), stamp["coverage"]
    # "auto" found every byte under a CRC-32: no manifest; True wrote it from both nodes' digests.
    assert [(tmp_path / f"step_{s}" / MANIFEST_FILE).exists() for s in (1, 2, 3)] == [False, False, True]
    notes = [e.get("fingerprint") for e in read_events(tmp_path) if e["event"] == "checkpoint-verified"]
    assert [n for n in notes if n] and all("taken from their parts" in n for n in notes if n), notes


def test_lightning_and_accelerate_saves_are_verified_and_fingerprinted_in_parts_among_nodes(scenarios: Path) -> None:
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    tmp_path = scenarios / "frameworks"
    ranks = _ranks(tmp_path)
    assert all(r["gather"] == {"lightning": True, "accelerate": True} for r in ranks), ranks
    assert all(r[f"pending_{s}"] for r in ranks for s in (1, 2, 3, 4)), ranks
    assert ranks[0]["arrived"] == ranks[1]["arrived"] == {"1": "passed", "2": "failed", "3": "passed",
                                                          "4": "passed"}, ranks
    clean = _stamp(tmp_path / "step_1")
    assert clean["passed"] and [p["opened"] for p in clean["parts"]] == [["__0_0.distcp"], ["__1_0.distcp"]]
    assert not (tmp_path / "step_1" / MANIFEST_FILE).exists()  # every byte under a CRC-32: nothing to fingerprint
    failed = _stamp(tmp_path / "step_2")
    named = [e["message"] for e in failed["errors"] if e["check"] == "node-part-failed"]
    assert len(named) == 1 and "node 1 (host node1" in named[0] and "__1_0.distcp" in named[0], failed["errors"]
    assert (tmp_path / "step_2" / "__1_0.distcp").exists()  # evidence kept
    for step in (3, 4):  # fingerprinted in parts: each node digested what it wrote
        adopted = _stamp(tmp_path / f"step_{step}")
        assert adopted["passed"] and (tmp_path / f"step_{step}" / MANIFEST_FILE).is_file()
        assert [p["opened"] for p in adopted["parts"]] == [["__0_0.distcp"], ["__1_0.distcp"]]
        assert verify_checkpoint(tmp_path / f"step_{step}").stats["manifest"]
    events = {e["step"]: e for e in read_events(tmp_path) if e["event"].startswith("checkpoint-")}
    assert [events[s]["event"] for s in (1, 2, 3, 4)] == ["checkpoint-verified", "checkpoint-failed",
                                                          "checkpoint-verified", "checkpoint-verified"], events
    assert "fingerprint" not in events[1], events
    assert all(events[s]["fingerprint"].startswith("manifest written") for s in (3, 4)), events
    for step in (1, 2, 3, 4):
        assert not [n for n in os.listdir(tmp_path / f"step_{step}") if n.startswith(PARTS_PREFIX)]


@pytest.mark.parametrize(("fingerprint", "deep"), _FSDP_CASES)
def test_a_transformers_fsdp_checkpoint_is_verified_among_the_nodes_that_wrote_its_shards(
        scenarios: Path, fingerprint: Any, deep: bool) -> None:
    tmp_path = scenarios / _fsdp_name(fingerprint, deep)
    ranks = _ranks(tmp_path)
    assert all(r["pending_1"] and r["pending_2"] for r in ranks), ranks
    assert ranks[0]["verdicts"] == ranks[1]["verdicts"] == {"1": "passed", "2": "failed"}, ranks
    shards = [[f"{s}/__{k}_0.distcp" for s in _SUBS] for k in (0, 1)]
    top = ["rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"]
    clean = _stamp(tmp_path / "checkpoint-1")
    # Each node opened the shards its rank wrote, and the coordinator the folder's own files besides.
    assert clean["passed"] and [p["opened"] for p in clean["parts"]] == [sorted([*top, *shards[0]]), shards[1]]
    assert [p["files"] for p in clean["parts"]] == shards
    failed = _stamp(tmp_path / "checkpoint-2")
    fault = ranks[1]["fault"]
    assert fault == "pytorch_model_fsdp_0/__1_0.distcp", ranks[1]
    named = [e["message"] for e in failed["errors"] if e["check"] == "node-part-failed"]
    assert len(named) == 1 and "node 1 (host node1" in named[0] and fault in named[0], failed["errors"]
    assert {e["location"].get("file") for e in failed["errors"] if e["check"] != "node-part-failed"} == {fault}
    assert (tmp_path / "checkpoint-2" / fault).exists()  # evidence kept
    events = {(e["event"], e["step"]) for e in read_events(tmp_path) if e["event"].startswith("checkpoint-")}
    assert events == {("checkpoint-verified", 1), ("checkpoint-failed", 2)}, events
    for step in (1, 2):
        assert not [n for n in os.listdir(tmp_path / f"checkpoint-{step}") if n.startswith(PARTS_PREFIX)]
    # Always fingerprinted: the clean save's manifests came from both nodes' parts (the parts opened no more than
    # above), the failed save has none.
    assert sorted(_manifests(str(tmp_path / "checkpoint-1"))) == (["", *_SUBS] if fingerprint is True else [])
    assert _manifests(str(tmp_path / "checkpoint-2")) == {}
    if fingerprint is True:
        notes = [e.get("fingerprint") for e in read_events(tmp_path) if e["event"] == "checkpoint-verified"]
        assert len(notes) == 1 and "the digests of 1 other node(s) taken from their parts" in notes[0], notes
        assert verify_checkpoint(str(tmp_path / "checkpoint-1")).stats["manifest"]
    # Deep: every tensor of both DCP folders rebuilt from the two nodes' pieces, as many as one process rebuilds.
    assert clean["deep"] is deep and failed["deep"] is deep
    if deep:
        whole = verify_checkpoint(str(tmp_path / "checkpoint-1"), deep=True)
        rebuilt = [c["count"] for c in clean["coverage"] if c["check"] == "fingerprint"]
        assert rebuilt == [c.count for c in whole.coverage if c.check == "fingerprint"] and rebuilt[0] >= 5, rebuilt
