"""``ckptverify.load`` is all or nothing: every refusal is an ``Exception`` from ``ckptverify.errors`` (or a
``UsageError`` subclass that explains it), and after it the state is exactly what it was before the call:
parameters, optimizer state, every random stream, counters, scheduler, scaler, data position, extras."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptverify
from ckptverify.errors import CheckpointRefusedError, CkptVerifyError, UsageError
from ckptverify.ownfiles.names import SAVE_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Extra:
    """A user Stateful; ``fail`` makes its load_state_dict raise (after changing nothing)."""

    def __init__(self) -> None:
        self.value = 0
        self.fail = False

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.fail:
            raise RuntimeError("extra refuses")
        self.value = sd["value"]


def build(seed: int, *, hidden: int = 8, stepped: bool = True) -> ckptverify.TrainState:
    """A small job with every kind of state; ``stepped`` trains it a little (else the optimizer is fresh)."""
    from ckptverify.state.sampler import ResumableSampler

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    data = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(20, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=ResumableSampler(20, seed=0))
    gen = torch.Generator().manual_seed(seed)
    state = ckptverify.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=loader,
                                  generators={"aux": gen}, extras={"extra": Extra()})
    if stepped:
        it = iter(loader)
        for _ in range(2 + seed % 3):
            next(it)
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            state.counters.step += 1
        scaler.scale(torch.ones(()))
        scaler.update(100.0 + seed)
        state.extras["extra"].value = seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + 1)
    return state


def snapshot(state: ckptverify.TrainState) -> dict[str, Any]:
    """Everything a load may change, copied (taking it changes nothing)."""
    from ckptverify.state.dataloader import loader_state
    from ckptverify.state.rng import capture_rng

    opt = state.optimizers[0]
    return {
        "params": {k: v.detach().clone() for k, v in state.model.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in state.model.parameters()],
        "optim": copy.deepcopy(opt.state_dict()),
        "optim_state_len": len(opt.state),
        "rng": capture_rng(state.rng.generators),
        "counters": state.counters.state_dict(),
        "scheduler": copy.deepcopy(state.schedulers[0].state_dict()),
        "scaler": copy.deepcopy(state.scaler.state_dict()),
        "loader": copy.deepcopy(loader_state(state.dataloader)),
        "extra": state.extras["extra"].state_dict(),
        "saved_world_size": state.saved_world_size,
        "saved_digests": dict(state.saved_digests),
        "warnings": list(state.warnings),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    changed = [k for k in before if not same(before[k], after[k])]
    assert not changed, f"a refused load changed {changed}"


def save_sd(sd: dict[str, Any], path: Path) -> None:
    ckptverify.save(sd, path)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A clean checkpoint of ``build(1)`` and its state dict."""
    path = tmp_path_factory.mktemp("atomic") / "good"
    sd = build(1).state_dict()
    save_sd(sd, path)
    return path, sd


def test_a_clean_load_changes_everything_it_should(good: tuple[Path, dict[str, Any]]) -> None:
    """The control: the same comparison sees a successful load change every field."""
    path, _ = good
    state = build(5)
    before = snapshot(state)
    report = ckptverify.load(state, path)
    assert report.passed, report.findings
    after = snapshot(state)
    for field in ("params", "optim", "rng", "counters", "scheduler", "scaler", "loader", "extra"):
        assert not same(before[field], after[field]), field


def _planted(good: tuple[Path, dict[str, Any]], tmp_path: Path, edit: Any) -> Path:
    _, sd = good
    sd = copy.deepcopy(sd)
    edit(sd)
    path = tmp_path / "planted"
    save_sd(sd, path)
    return path


def _set(path: tuple[str, ...], value: Any) -> Any:
    def edit(sd: dict[str, Any]) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


@pytest.mark.parametrize(("what", "edit", "error"), [
    # Counters are checked before anything is applied.
    ("counter of the wrong type", _set(("counters", "step"), "seven"), CkptVerifyError),
    ("counter that is a float", _set(("counters", "tokens_seen"), 1.5), CkptVerifyError),
    ("field digests that are not a mapping", _set(("digests", "rank0"), "junk"), CkptVerifyError),
    # These fail while applying, after the counters, scheduler and scaler were set: all of it is put back.
    ("python RNG state of the wrong length", _set(("rng", "rank0", "python", "state"),
                                                  torch.zeros(7, dtype=torch.int64)), CkptVerifyError),
    ("numpy RNG keys out of range", _set(("rng", "rank0", "numpy", "keys"),
                                         torch.full((624,), -5, dtype=torch.int64)), CkptVerifyError),
    ("data position of another loader kind", _set(("data", "rank0", "kind"), "somebody.else"), CkptVerifyError),
    ("data position of another dataset", _set(("data", "rank0", "state", "dataset_len"), 999), CkptVerifyError),
    ("RNG saved by another world size", _set(("rng", "world_size"), 4), UsageError),
])
@pytest.mark.parametrize("stepped", [True, False], ids=["trained", "fresh"])
def test_a_refused_field_leaves_the_state_as_it_was(good, tmp_path, what, edit, error, stepped) -> None:
    path = _planted(good, tmp_path, edit)
    state = build(5, stepped=stepped)
    before = snapshot(state)
    with pytest.raises(error) as info:
        ckptverify.load(state, path)
    assert not isinstance(info.value, CheckpointRefusedError)  # the checkpoint is sound: exit 2, not a refusal
    assert_unchanged(before, snapshot(state))


def test_an_extra_that_refuses_leaves_the_state_as_it_was(good: tuple[Path, dict[str, Any]]) -> None:
    path, _ = good
    state = build(5)
    state.extras["extra"].fail = True
    before = snapshot(state)
    with pytest.raises(CkptVerifyError, match="extra refuses"):
        ckptverify.load(state, path)
    assert_unchanged(before, snapshot(state))


@pytest.mark.parametrize("kind", ["missing key", "other shape"])
def test_dcp_failures_are_exceptions_and_change_nothing(good, tmp_path, kind) -> None:
    """DCP raises ``CheckpointException``, a ``BaseException``; load raises an ``Exception`` instead."""
    path, sd = good
    if kind == "missing key":
        sd = copy.deepcopy(sd)
        del sd["scheduler"]  # the state to load has a scheduler, the checkpoint has none
        path = tmp_path / "no-scheduler"
        save_sd(sd, path)
        state = build(5)
    else:
        state = build(5, hidden=16)  # parameters of another shape than saved
    before = snapshot(state)
    try:
        ckptverify.load(state, path)
    except Exception as exc:  # the point: `except Exception` catches it
        assert type(exc) is CkptVerifyError, type(exc)  # not a refusal: the checkpoint is sound
        assert "nothing was changed" in str(exc)
    else:
        pytest.fail("load did not refuse")
    assert_unchanged(before, snapshot(state))


def test_an_uncommitted_save_is_refused_even_without_verification(good, tmp_path) -> None:
    import shutil

    path, _ = good
    torn = tmp_path / "torn"
    shutil.copytree(path, torn)
    (torn / SAVE_MARKER).write_text('{"save_id": "x", "pid": 1}')
    for verify in ("inline", "off"):
        state = build(5)
        before = snapshot(state)
        with pytest.raises(CheckpointRefusedError, match="save-uncommitted"):
            ckptverify.load(state, torn, verify=verify)
        assert_unchanged(before, snapshot(state))


def test_an_untrustworthy_manifest_is_refused_without_verification_and_changes_nothing(good, tmp_path) -> None:
    import json
    import shutil

    from ckptverify.errors import ProofFailedError
    from ckptverify.ownfiles.manifest import MANIFEST_FILE

    path, _ = good
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    manifest = json.loads((edited / MANIFEST_FILE).read_text())
    manifest["block_bytes"] = "x"
    (edited / MANIFEST_FILE).write_text(json.dumps(manifest))
    state = build(5)
    before = snapshot(state)
    with pytest.raises(ProofFailedError, match="its manifest cannot be trusted \\(manifest-invalid\\)") as info:
        ckptverify.load(state, edited, verify="off")
    assert [f.check for f in info.value.report.findings] == ["manifest-invalid"]
    assert_unchanged(before, snapshot(state))


def test_an_item_cut_short_fails_its_proof_and_changes_nothing(good, tmp_path) -> None:
    import os
    import shutil

    from ckptverify.errors import ProofFailedError

    path, _ = good
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    shard = max(cut.glob("*.distcp"), key=os.path.getsize)
    os.truncate(shard, shard.stat().st_size - 10)
    state = build(5)
    before = snapshot(state)
    with pytest.raises(ProofFailedError, match=r"are cut short: \d+ of \d+ bytes could be read \(item-bounds\)"):
        ckptverify.load(state, cut, verify="off")  # a verification would refuse it before reading
    assert_unchanged(before, snapshot(state))


def test_picking_from_a_run_directory_that_is_not_one_is_not_found(tmp_path) -> None:
    from ckptverify.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match="not a directory"):
        ckptverify.load(build(5, stepped=False), tmp_path / "missing", pick="latest-verified")


def test_a_corrupt_checkpoint_is_refused_and_changes_nothing(good, tmp_path) -> None:
    import shutil

    from helpers import faults as inj

    path, _ = good
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    inj.flip_in_tensor_payload(bad)
    state = build(5)
    before = snapshot(state)
    with pytest.raises(CheckpointRefusedError):
        ckptverify.load(state, bad)
    assert_unchanged(before, snapshot(state))


def test_load_parses_each_metadata_file_once(good: tuple[Path, dict[str, Any]], monkeypatch) -> None:
    """The reader proves and parses ``.metadata`` once: the layout the template is made from and what DCP loads."""
    from ckptverify.dcp import metadata as md

    path, _ = good
    parsed: list[str] = []
    real = md.parse_metadata

    def counted(data: bytes, name: str = md.METADATA_FILE) -> md.ParsedMetadata:
        parsed.append(name)
        return real(data, name)

    monkeypatch.setattr(md, "parse_metadata", counted)
    ckptverify.load(build(7), path, verify="off")
    assert parsed == [md.METADATA_FILE]


def test_a_replaced_metadata_fails_its_proof_changes_nothing_and_is_stamped_failed(good, tmp_path) -> None:
    """A ``.metadata`` other than the one the manifest digested (here: another save's of the same state, which
    parses) fails its proof when DCP reads it, though the layout was read first: a ``ProofFailedError`` naming the
    check (DCP folds the reader's failure into a message of its own), nothing applied, and the stamp the copy
    carried replaced by a failed one."""
    import shutil

    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.errors import ProofFailedError
    from ckptverify.runs.stamp import read_stamp, write_stamp

    path, sd = good
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    write_stamp(swapped, verify_checkpoint(str(swapped)))
    assert read_stamp(swapped).passed
    save_sd(sd, tmp_path / "other")
    shutil.copyfile(tmp_path / "other" / ".metadata", swapped / ".metadata")
    state = build(5)
    before = snapshot(state)
    with pytest.raises(ProofFailedError, match=r"\(manifest-digest\).*it is stamped failed") as raised:
        ckptverify.load(state, swapped, verify="off")
    assert [f.check for f in raised.value.report.findings] == ["manifest-digest"]
    assert_unchanged(before, snapshot(state))
    assert not read_stamp(swapped).passed
