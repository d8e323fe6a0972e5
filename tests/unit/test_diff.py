"""diff: tensor-by-tensor comparison of two checkpoints, independent of sharding."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import faults as inj
from helpers.dcp_encodings import dcp_checkpoint as _dcp
from helpers.dcp_encodings import safetensors_ckpt, zstd_ckpt

from ckptverify.audit.diff import diff_checkpoints, tensor_difference
from ckptverify.cli import main
from ckptverify.errors import TransformError


def test_a_checkpoint_equals_its_copy(fresh_ckpt):
    a, b = fresh_ckpt("single"), fresh_ckpt("single")
    report = diff_checkpoints(a, b)
    assert report.passed, [f.message for f in report.findings]
    assert report.coverage[0].count > 10


def test_one_process_and_two_rank_fsdp2_checkpoints_of_the_same_state_are_equal(fresh_ckpt):
    # Same model, seed and batch: FSDP2 averages identical per-rank gradients, so the values are equal; only
    # the sharding (and the rank-local state, which only the 2-rank job has) differs.
    single, sharded = fresh_ckpt("single"), fresh_ckpt("fsdp2")
    report = diff_checkpoints(single, sharded)
    tensor_diffs = [f for f in report.errors if f.check == "diff-tensor"]
    assert tensor_diffs == [], [f.message for f in tensor_diffs]
    missing = {f.location.fqn for f in report.errors if f.check == "diff-missing"}
    assert missing and all(name.startswith("rank_state.") for name in missing)


def test_diff_finds_exactly_the_changed_tensors(fresh_ckpt):
    a, b = fresh_ckpt("single"), fresh_ckpt("single")
    changed = {inj.rewrite_payload_valid_crc(b, fqn="model.0.weight", element=5).fqn,
               inj.rewrite_payload_valid_crc(b, fqn="extra.i64", element=7, value=(12345).to_bytes(8, "little")).fqn}
    inj.rewrite_payload_valid_crc(b, fqn="model.0.weight", element=9)
    report = diff_checkpoints(a, b)
    hits = {f.location.fqn: f for f in report.errors if f.check == "diff-tensor"}
    assert set(hits) == changed
    w = hits["model.0.weight"].actual
    assert w["differing"] == 2 and w["first_index"] == [0, 5] and w["max_ulp"] > 0
    i = hits["extra.i64"].actual
    assert i["differing"] == 1 and i["first_index"] == [7] and i["max_abs_diff"] == 12345 - 7


def test_diff_reports_changed_values_and_cli_exit_codes(fresh_ckpt):
    a, b = fresh_ckpt("single"), fresh_ckpt("single")
    inj.flip_in_bytes_item(b)  # the pickled "step" value now differs (and its CRC fails)
    result = CliRunner().invoke(main, ["diff", "--json", str(a), str(b)])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["command"] == "diff" and not data["passed"]
    assert CliRunner().invoke(main, ["diff", str(a), str(a)]).exit_code == 0
    assert CliRunner().invoke(main, ["diff", str(a), "/nonexistent"]).exit_code == 2


def test_tensor_difference_measures_ulps_and_magnitudes():
    a = torch.tensor([1.0, 2.0, -0.0, 3.0])
    b = a.clone()
    b[1] = torch.nextafter(torch.tensor(2.0), torch.tensor(3.0))
    b[2] = 0.0  # -0.0 vs +0.0: different bits, zero ULPs apart
    d = tensor_difference(a, b)
    assert d["differing"] == 2 and d["first_index"] == [1] and d["max_ulp"] == 1
    assert d["max_abs_diff"] > 0
    bf = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    d = tensor_difference(bf, torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16))
    assert d["differing"] == 1 and d["max_ulp"] == 1
    assert tensor_difference(torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool))["differing"] == 0

    # float64: a negative pair one step apart, and the two ends of the line (more than int64 apart).
    d = tensor_difference(torch.tensor([-1.0], dtype=torch.float64),
                          torch.tensor([-1.0], dtype=torch.float64).nextafter(torch.tensor(-2.0, dtype=torch.float64)))
    assert d["differing"] == 1 and d["max_ulp"] == 1
    top = torch.finfo(torch.float64).max
    d = tensor_difference(torch.tensor([top], dtype=torch.float64), torch.tensor([-top], dtype=torch.float64))
    assert d["max_ulp"] == 2 * 0x7FEFFFFFFFFFFFFF
    # complex: an element whose real and imaginary parts both differ counts once
    d = tensor_difference(torch.tensor([1 + 1j, 2 + 2j]), torch.tensor([1 + 1j, 3 + 3j]))
    assert d["differing"] == 1 and d["first_index"] == [1] and d["max_ulp"] is None


# ---- every format, and never passing on nothing -------------------------------------------------------------



def _changed(report):
    return {f.location.fqn for f in report.errors if f.check == "diff-tensor"}


def _count(report, check="diff-tensor"):
    return sum(c.count for c in report.coverage if c.check == check)


@pytest.mark.parametrize("build", [zstd_ckpt, safetensors_ckpt], ids=["zstd", "safetensors"])
def test_two_different_encoded_checkpoints_differ_and_equal_ones_compare_every_tensor(tmp_path, build):
    a, a2, b = build(tmp_path / "a"), build(tmp_path / "a2"), build(tmp_path / "b", seed=1)
    same = diff_checkpoints(a, a2)
    assert same.passed and _count(same) == 21, [f.message for f in same.findings]
    other = diff_checkpoints(a, b)
    assert not other.passed and _count(other) == 21
    assert {"model.0.weight", "optim.state.0.weight.exp_avg"} <= _changed(other)


def test_a_comparison_that_could_read_no_tensor_fails(tmp_path, monkeypatch):
    from ckptverify.dcp import transforms

    a, b = zstd_ckpt(tmp_path / "a"), zstd_ckpt(tmp_path / "b", seed=1)

    def unavailable(raw, limit):
        raise TransformError("no zstd decoder", unavailable=True)

    monkeypatch.setattr(transforms, "_zstd", unavailable)
    report = diff_checkpoints(a, b)
    checks = {f.check for f in report.errors}
    assert not report.passed and {"diff-uncompared", "diff-nothing-compared"} <= checks
    assert _count(report) == 0


def test_two_folders_holding_nothing_comparable_do_not_compare_equal(tmp_path):
    for side in "ab":
        (tmp_path / side).mkdir()
        (tmp_path / side / "notes.txt").write_text("hello")
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert "diff-nothing-compared" in {f.check for f in report.errors}


def test_ignore_leaves_out_names_and_counts_them(fresh_ckpt):
    single, sharded = fresh_ckpt("single"), fresh_ckpt("fsdp2")
    report = diff_checkpoints(single, sharded, ignore=["rank_state.*"])
    assert report.passed, [f.message for f in report.errors]
    note = next(f for f in report.findings if f.check == "diff-ignored")
    assert note.actual["ignored"] > 0 and _count(report) == 21
    result = CliRunner().invoke(main, ["diff", "--json", str(single), str(sharded), "--ignore", "rank_state.*"])
    assert result.exit_code == 0 and json.loads(result.output)["stats"]["ignored"] == note.actual["ignored"]


def test_a_dcp_checkpoint_its_torch_save_file_and_its_hugging_face_export_compare_by_name(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from helpers.ckpt_factory import single_process_state_dict
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = _dcp(tmp_path / "dcp")
    dcp_to_torch_save(str(ckpt), str(tmp_path / "full.pt"))
    report = diff_checkpoints(ckpt, tmp_path / "full.pt")
    assert report.passed and _count(report) == 21 and _count(report, "diff-value") > 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": single_process_state_dict()["model"]},
                 storage_writer=HuggingFaceStorageWriter(str(tmp_path / "hf")))
    rest = ["optim.*", "extra.*", "step", "run_name", "blob", "config.*"]
    report = diff_checkpoints(ckpt, tmp_path / "hf", ignore=rest)
    assert report.passed and _count(report) == 4, [f.message for f in report.findings]
    other = _dcp(tmp_path / "other", seed=1)
    assert _changed(diff_checkpoints(other, tmp_path / "hf", ignore=rest)) == {
        "model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}


def test_two_single_files_compare_tensors_and_values(tmp_path):
    torch.save({"w": torch.arange(6.0), "step": 3, "cfg": {"lr": 0.1}}, tmp_path / "a.pt")
    torch.save({"w": torch.arange(6.0), "step": 3, "cfg": {"lr": 0.1}}, tmp_path / "b.pt")
    torch.save({"w": torch.arange(6.0) * 2, "step": 4, "cfg": {"lr": 0.1}}, tmp_path / "c.pt")
    same = diff_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt")
    assert same.passed and _count(same) == 1 and _count(same, "diff-value") == 2
    other = diff_checkpoints(tmp_path / "a.pt", tmp_path / "c.pt")
    assert _changed(other) == {"w"} and {f.location.fqn for f in other.errors if f.check == "diff-value"} == {"step"}
    torch.save({"w": torch.arange(4.0), "step": 3, "cfg": {"lr": 0.1}}, tmp_path / "d.pt")
    shorter = diff_checkpoints(tmp_path / "a.pt", tmp_path / "d.pt")
    assert [f.message for f in shorter.errors if f.check == "diff-tensor"] == [
        "'w' is float32[6] in A and float32[4] in B"]


def test_a_prefix_mapping_of_another_type_is_a_usage_error():
    from ckptverify.audit.diff import parse_prefix_map
    from ckptverify.errors import UsageError

    assert parse_prefix_map(["a.=b.", ("c.", "")]) == [("a.", "b."), ("c.", "")]
    for spec in (5, ("a.",), ("a.", 5)):
        with pytest.raises(UsageError, match="expected 'A_PREFIX=B_PREFIX' or a pair of strings"):
            parse_prefix_map([spec])


def test_every_tensor_subclass_the_reader_accepts_has_a_decoder():
    from ckptverify.audit import diff
    from ckptverify.safeparse.torchsave import SUBCLASSES

    assert set(diff._DECODERS) == set(SUBCLASSES)
