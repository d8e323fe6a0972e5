"""Loading through DCP safely, and DCP's naming of state dict entries.

DCP's ``load_bytes`` unpickles non-tensor values with ``weights_only=False`` (runs anything);
:class:`SafeLoadPlanner` uses ``weights_only=True``, so a hostile value is refused. :func:`flat_names` gives the
flattened names DCP stores entries under. Touches DCP internals (``set_element``, ``flatten_state_dict``);
``tests/processes/test_train_state.py`` breaks loudly if they change.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from ckptverify.errors import FindingError


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise FindingError(
                f"value {read_item.dest_index.fqn!r} in the checkpoint is not plain data and was not loaded: {exc}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def flat_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``{flattened DCP name: leaf value}`` for a (nested) state dict, as DCP names the stored items."""
    flat, _ = flatten_state_dict(state_dict)
    return flat
