"""The recorder's modules import one way; the resume verdict reads typed evidence and shares its cause sentences
with replay; the core harness draws no figures itself."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

import ckptverify

PACKAGE = Path(ckptverify.__file__).parent

#: The recorder's modules, each importing (at any depth of the file) only the ones before it.
RECORDER_ORDER = ["sites", "readback", "cells", "hyperparams", "members", "flatten", "recorder"]


def _trace_imports(name: str) -> set[str]:
    tree = ast.parse((PACKAGE / "trace" / f"{name}.py").read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptverify.trace."):
            out.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("ckptverify.trace."))
    return out


@pytest.mark.parametrize("name", RECORDER_ORDER)
def test_each_recorder_module_imports_only_the_ones_before_it(name: str) -> None:
    later = set(RECORDER_ORDER[RECORDER_ORDER.index(name):])
    assert not _trace_imports(name) & later, name


def _plan(steps: int = 6, resume_at: int = 3):
    from ckptverify.resume.harness import Plan

    return Plan(target="x:y", steps=steps, resume_at=resume_at)


def _divergence(step: int, site: str, category: str):
    from ckptverify.trace.compare import FirstDivergence

    fields = {f.name for f in dataclasses.fields(FirstDivergence)}
    values = {"step": step, "rank": 0, "site": site, "category": category}
    return FirstDivergence(**{k: values.get(k) for k in fields})


def test_the_verdict_reads_frozen_typed_evidence() -> None:
    from ckptverify.resume.compare import Evidence, SiteDiff, StepEvidence
    from ckptverify.resume.verdict import decide

    ev = Evidence(resume=_divergence(4, "batch", "data"),
                  step=StepEvidence(rng=(SiteDiff("rng.torch_cpu", "a", "b", b_moved=True),)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.final = ()  # type: ignore[misc]
    v = decide(_plan(), ev)
    assert v.kind == "rng" and v.site == "rng.torch_cpu" and v.step == 4
    assert "B re-seeded or drew from rng.torch_cpu after run.restore()" in v.message
    assert v.advice.startswith("seed before run.restore(state)")
    # Nothing found: a pass, and a stream that moved is not confused with one that did not.
    assert decide(_plan(), Evidence()).kind == "pass"
    still = decide(_plan(), Evidence(resume=_divergence(4, "start.rng.torch_cpu", "rng"),
                                     step=StepEvidence(rng=(SiteDiff("rng.torch_cpu", "a", "b"),))))
    assert still.kind == "rng" and "not restored from the checkpoint" in still.message
    assert "re-seeded" not in still.message


@pytest.mark.parametrize(("a_moved", "b_moved", "kind"), [(False, True, "changed-after-restore"),
                                                           (True, False, "changed-after-save"),
                                                           (None, None, "scheduler")])
def test_resume_check_and_replay_say_the_same_hyperparameter_cause(a_moved, b_moved, kind) -> None:
    from ckptverify.resume import causes
    from ckptverify.resume.compare import Evidence, SiteDiff, StepEvidence
    from ckptverify.resume.verdict import decide

    h = SiteDiff("0.lr", 0.1, 0.2, a_moved=a_moved, b_moved=b_moved)
    v = decide(_plan(), Evidence(resume=_divergence(4, "start.hparam.0.lr", "hyperparameters"),
                                 step=StepEvidence(hparams_start=(h,))))
    want_kind, text, advice, site = causes.hparam_start_cause(causes.At(causes.RESUME, step=4, saved_at=3), h)
    assert v.kind == want_kind == kind and v.message.startswith(text) and v.advice == advice + "."
    assert v.site == site == "optim.param_groups[0].lr"
    replay_kind, replay_text, replay_advice, _ = causes.hparam_start_cause(causes.At(causes.REPLAY, step=4,
                                                                                     saved_at=3), h)
    assert replay_kind == kind and replay_advice == advice  # one cause, one piece of advice, two namings
    assert "production" in replay_text and "the replay" in replay_text and "in B" not in replay_text


#: Phrases of the shared cause sentences: written once, in resume/causes.py.
SHARED_PHRASES = ["re-seeded or drew from", "was restored exactly from", "drew from {",
                  "after its save point (between run.record()",
                  "registered with persistent=False", "reads a step counter or schedule",
                  "restore exactly what its state_dict saved", "register every generator",
                  "the LR scheduler or the step counter it", "do not re-apply configuration values"]


@pytest.mark.parametrize("phrase", SHARED_PHRASES)
def test_a_cause_sentence_is_written_once(phrase: str) -> None:
    holders = [p.relative_to(PACKAGE).as_posix() for p in [PACKAGE / "resume" / "verdict.py",
                                                          PACKAGE / "replay" / "causes.py",
                                                          PACKAGE / "resume" / "causes.py"]
               if phrase in p.read_text()]
    assert holders == ["resume/causes.py"], (phrase, holders)


def test_the_core_harness_refuses_a_report_page_it_has_no_writer_for(tmp_path: Path) -> None:
    from ckptverify.errors import UsageError
    from ckptverify.resume.harness import resume_check

    with pytest.raises(UsageError, match="figures="):
        resume_check(_plan(), report_dir=str(tmp_path / "page"), keep=str(tmp_path / "work"))
    assert not (tmp_path / "work").exists() and not (tmp_path / "page").exists()  # refused before anything ran


def test_the_package_resume_check_is_the_one_that_draws_the_page() -> None:
    from ckptverify.render import resume as front

    assert ckptverify.resume_check is front.resume_check
    assert "report_dir" in front.resume_check.__doc__ and "write_report" in front.resume_check.__doc__


def test_the_core_layers_import_no_renderer() -> None:
    for folder in ("resume", "replay", "trace"):
        for path in (PACKAGE / folder).glob("*.py"):
            tree = ast.parse(path.read_text())
            names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [n for n in names if n.startswith(("ckptverify.render", "ckptverify.cli"))], path
    importlib.import_module("ckptverify.resume.harness")
