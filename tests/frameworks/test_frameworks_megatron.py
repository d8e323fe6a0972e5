"""Megatron Core 0.19 ``dist_checkpointing`` (``torch_dist``) checkpoints judged by ckptverify.

Megatron attaches DCP's own planner dataclasses to ``.metadata`` (``all_local_plans``: ``SavePlan``,
``WriteItem``, ``TensorWriteData``, ...), which the metadata reader accepts as inert data and checks. The last
tests build the same kind of metadata with DCP alone (a save planner that attaches ``all_local_plans`` exactly
where Megatron's saver does), so they run wherever megatron-core does not install.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import faults as inj

from frameworks import harness as h

pytestmark = pytest.mark.slow  # each framework's producer runs once per session: 15-60 s

megatron = h.fixture("megatron")


@pytest.mark.parametrize("name", ["tp2-step2", "tp2-step4", "tp1-step4"])
def test_iteration_folder_verifies_clean(megatron: h.Built, name: str) -> None:
    h.assert_clean(h.verify(megatron.path(name)), uncheckable=("metadata.json",))


def test_real_metadata_carries_dcp_planner_dataclasses(megatron: h.Built) -> None:
    """What makes these checkpoints different: if Megatron stops attaching plans, these tests lose meaning."""
    (md,) = inj.load_metadata(megatron.path("tp2-step4"))
    plans = md.all_local_plans
    assert len(plans) == 2 and all(type(p).__name__ == "SavePlan" and p.items for p in plans)
    assert (megatron.path("tp2-step4") / "metadata.json").is_file()


def test_flipped_payload_bit_is_caught_and_localized(megatron: h.Built, tmp_path: Path) -> None:
    ckpt = megatron.copy("tp2-step4", tmp_path / "iter_0000004")
    fault = inj.flip_in_tensor_payload(ckpt)
    h.assert_flip_localized(h.verify(ckpt), fault)


def test_diff_of_two_steps_names_every_trained_tensor(megatron: h.Built) -> None:
    report = h.diff(megatron.path("tp2-step2"), megatron.path("tp2-step4"))
    assert report["exit_code"] == 1, h.describe(report)
    assert h.named(report, "diff-tensor") == h.tensor_fqns(megatron.path("tp2-step4"))


def test_diff_of_tp1_and_tp2_saves_of_the_same_state_passes(megatron: h.Built) -> None:
    # Each TP rank writes its own `_extra_state/shard_<rank>_<tp>` entry: they legitimately differ in name.
    report = h.cli("diff", megatron.path("tp2-step4"), megatron.path("tp1-step4"), "--no-progress",
                   "--ignore", "*_extra_state/shard_*")
    assert report["exit_code"] == 0, h.describe(report)
    assert h.covered(report, "diff-tensor") == len(h.tensor_fqns(megatron.path("tp1-step4")))


# ---- Megatron-style metadata made with DCP alone ---------------------------------------------------------


def save_with_plans_in_metadata(path: Path) -> Path:
    """A real DCP save whose ``.metadata`` carries ``all_local_plans``, set where Megatron's saver sets it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class PlansInMetadata(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            metadata.all_local_plans = all_plans
            return plans, metadata

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
    state = {"model": model.state_dict(), "iteration": 4, "checkpoint_version": 3.0}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), planner=PlansInMetadata(), no_dist=True)
    return path


def test_megatron_style_metadata_is_built_as_megatron_writes_it(tmp_path: Path) -> None:
    (md,) = inj.load_metadata(save_with_plans_in_metadata(tmp_path / "ckpt"))
    (plan,) = md.all_local_plans
    kinds = {type(item).__name__ for item in plan.items} | {type(item.tensor_data).__name__ for item in plan.items}
    assert {"WriteItem", "TensorWriteData"} <= kinds


def test_megatron_style_metadata_verifies_clean(tmp_path: Path) -> None:
    h.assert_clean(h.verify(save_with_plans_in_metadata(tmp_path / "ckpt")))


def test_megatron_style_metadata_flipped_payload_bit_is_caught_and_localized(tmp_path: Path) -> None:
    ckpt = save_with_plans_in_metadata(tmp_path / "ckpt")
    fault = inj.flip_in_tensor_payload(ckpt)
    h.assert_flip_localized(h.verify(ckpt), fault)
