"""What a step started from, as the verdicts of resume-check and replay read it: a hyperparameter is named by its
field, whether both traces record the fields or only the restored run does (production's trace, against a replay's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptverify.resume.compare import SiteDiff, step_evidence
from ckptverify.trace.compare import rank_comparisons


def _run(path: Path, detail: str, lrs: list[float], momenta: list[float] | None = None) -> str:
    """A trace of one SGD optimizer's start hyperparameters: per step its ``lr`` (and ``momentum``)."""
    import torch

    from ckptverify.trace.hyperparams import _HparamCells
    from ckptverify.trace.store import Cell, TraceHeader, TraceWriter

    start = _HparamCells("start.hparam.", detail)
    header = TraceHeader(run=path.name, level="state", detail=detail, rank=0, world_size=1)
    with TraceWriter(path / "rank0", header=header) as w:
        for step, lr in enumerate(lrs, 1):
            momentum = {} if momenta is None else {"momentum": momenta[step - 1]}
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, **momentum)
            w.append(step, [*start([opt]), Cell.from_float("metric.loss", "metric", 1.0)])
    return str(path)


@pytest.mark.parametrize("saved_detail", ["tensor", "category"])
def test_a_hyperparameter_changed_after_the_restore_is_named_by_its_field(tmp_path: Path, saved_detail: str) -> None:
    a = _run(tmp_path / "a", saved_detail, [0.1, 0.1, 0.1])
    b = _run(tmp_path / "b", "tensor", [0.1, 0.1, 0.3])
    (comparison,) = rank_comparisons(a, b, steps=range(3, 4))
    ev = step_evidence(comparison, first_resumed=True, restored={"start.hparam.0.lr": 0.1})
    # Only the category cell in A: its value there is unknown, and A moved it exactly when B did not.
    want_a = 0.1 if saved_detail == "tensor" else None
    assert ev.hparams_start == (SiteDiff("0.lr", want_a, 0.3, a_moved=False, b_moved=True),)
    # A later step compares with no restore: who moved it is not known.
    ev = step_evidence(comparison, first_resumed=False, restored={"start.hparam.0.lr": 0.1})
    assert ev.hparams_start == (SiteDiff("0.lr", want_a, 0.3),)


def test_a_category_cell_of_several_changed_hyperparameters_names_the_field_that_moved(tmp_path: Path) -> None:
    """Production's category cell against a replay's fields, two fields changed at once: the cell's bits name
    neither, so B's field that moved since the restore stands for it, else B's first field."""
    a = _run(tmp_path / "a", "category", [0.1, 0.1, 0.1], [0.9, 0.9, 0.9])
    b = _run(tmp_path / "b", "tensor", [0.1, 0.1, 0.3], [0.9, 0.9, 0.5])
    (comparison,) = rank_comparisons(a, b, steps=range(3, 4))
    assert comparison.first_differing == ("start.hparam.*",)
    restored = {"start.hparam.0.lr": 0.3, "start.hparam.0.momentum": 0.9}
    ev = step_evidence(comparison, first_resumed=True, restored=restored)
    assert ev.hparams_start == (SiteDiff("0.momentum", None, 0.5, a_moved=False, b_moved=True),)
    ev = step_evidence(comparison, first_resumed=False, restored=restored)
    assert ev.hparams_start == (SiteDiff("0.lr", None, 0.3),)
