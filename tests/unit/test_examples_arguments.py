"""The example model and corpus refuse sizes they cannot honour, with a message naming the argument."""

from __future__ import annotations

import pytest
import torch

from ckptverify.examples.corpus import TokenDataset
from ckptverify.examples.tinygpt import TinyGPT, TinyGPTConfig


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"d_model": 30, "n_heads": 4}, "divisible by n_heads"),
    ({"n_layers": 0}, "all sizes must be positive"),
    ({"n_heads": 0}, "all sizes must be positive"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
])
def test_tinygpt_config_refuses(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyGPTConfig(**kwargs)


def test_tinygpt_refuses_a_sequence_longer_than_its_positions() -> None:
    model = TinyGPT(TinyGPTConfig(seq_len=4))
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)
    with pytest.raises(ValueError, match="5 tokens is longer than seq_len=4"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((0, 8), {}, "num_sequences and seq_len must be positive"),
    ((4, 0), {}, "num_sequences and seq_len must be positive"),
    ((4, 8, 1), {}, "vocab_size must be at least 2"),
    ((4, 8, 16), {"branching": 17}, "branching must be between 1 and vocab_size"),
    ((4, 8, 16), {"smoothing": 1.0}, r"smoothing must be in \[0, 1\)"),
])
def test_token_dataset_refuses(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenDataset(*args, **kwargs)
