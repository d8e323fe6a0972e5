"""diff: tensor-by-tensor comparison of two checkpoints, independent of sharding."""

from __future__ import annotations

import json

import inject_fault as inj
import torch
from click.testing import CliRunner

from ckptverify.cli import main
from ckptverify.diff import diff_checkpoints, tensor_difference


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
