"""A loader whose position cannot be saved is refused with the way that works for it: torchdata's
StatefulDataLoader (installed by the ``data`` extra the message names) with the dataset's own state for an
IterableDataset, which no sampler drives; and every extra the documentation names exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import ckptverify as cv
from ckptverify.errors import UsageError
from ckptverify.state.dataloader import loader_state, restore_loader

ROOT = Path(__file__).resolve().parents[2]


class _Stream(IterableDataset):
    def __iter__(self):
        yield from torch.arange(8)


def test_a_plain_loader_over_an_iterable_dataset_is_told_the_stateful_loader_and_the_datasets_own_state() -> None:
    loader = DataLoader(_Stream(), batch_size=2)
    for refuse in (lambda: cv.TrainState(dataloader=loader), lambda: loader_state(loader),
                   lambda: restore_loader(loader, {"kind": "x", "state": {}})):
        with pytest.raises(UsageError) as caught:
            refuse()
        message = str(caught.value)
        assert "IterableDataset" in message and "a ResumableSampler cannot apply" in message, message
        assert "StatefulDataLoader" in message and "state_dict() and load_state_dict()" in message
        assert "pip install 'ckptverify[data]'" in message


def test_a_plain_map_style_loader_is_told_both_ways_and_how_to_install_the_stateful_one() -> None:
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(UsageError) as caught:
        cv.TrainState(dataloader=loader)
    message = str(caught.value)
    assert "supported loaders are torchdata's StatefulDataLoader (pip install 'ckptverify[data]')" in message
    assert "ResumableSampler" in message and "IterableDataset" not in message


def test_the_data_extra_installs_torchdata_and_every_extra_the_docs_name_exists() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["data"] == ["torchdata>=0.11"]
    named = {m for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for m in re.findall(r"ckptverify\[([a-z0-9_,-]+)\]", doc.read_text())}
    assert "data" in named
    assert {e for group in named for e in group.split(",")} <= set(extras), named
