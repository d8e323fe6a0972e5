"""Run ``resume-check`` on the language-model trainer of ``tests/user_scripts/llm_stream_train.py`` with one bug
planted (on rank 1, or on every rank), and read each job's JSON report (the document ``resume-check --json``
prints).

Several jobs are checked together (:func:`ckptverify.resume.harness.resume_check_many`): one launch per run
(A, A2, B) for all jobs of one rank count, in this process's fork server, instead of a ``python -m ckptverify``
and a fork server per job. Each job keeps its own runs, checkpoints, traces, comparison and verdict; only process
start-up is shared. The bug is chosen per job by the training function of ``tests/helpers/llm_plants.py`` (the
trainer's ``PLANT``/``PLANT_RANKS``/``PARALLEL``), as the environment chose it for a command of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptverify.render.report import to_json
from ckptverify.resume.harness import Plan, resume_check_many
from helpers import llm_plants

PLANTS_FILE = Path(llm_plants.__file__).resolve()


@dataclass(frozen=True)
class Job:
    """``PLANT=plant PLANT_RANKS=ranks PARALLEL=parallel ckptverify resume-check llm_stream_train.py:train
    --nproc nproc --steps steps --resume-at resume_at --runs runs --no-locate --json``."""

    plant: str = ""
    ranks: str = "all"
    parallel: str = "ddp"
    nproc: int = 2
    steps: int = 4
    resume_at: int = 2
    runs: str = "A,B"

    def plan(self) -> Plan:
        target = f"{PLANTS_FILE}:{llm_plants.name(self.plant, self.ranks, self.parallel)}"
        return Plan(target=target, steps=self.steps, resume_at=self.resume_at, nproc=self.nproc,
                    runs=tuple(self.runs.split(",")), locate=False)


def resume_checks(jobs: dict[str, Job]) -> dict[str, dict[str, Any]]:
    """The JSON report of each job, by its key; the jobs of each rank count share one launch per run. Each must
    end with a verdict (exit code 0 or 1)."""
    reports: dict[str, dict[str, Any]] = {}
    for nproc in sorted({job.nproc for job in jobs.values()}):
        keys = [key for key, job in jobs.items() if job.nproc == nproc]
        outcomes = resume_check_many([jobs[key].plan() for key in keys])
        for key, outcome in zip(keys, outcomes, strict=True):
            assert outcome.report.exit_code in (0, 1), (key, outcome.report.exit_code)
            reports[key] = json.loads(to_json(outcome.report))
    return reports


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    return report["stats"]["verdict"]


def receiver_ranks(report: dict[str, Any]) -> list[int]:
    return sorted(r["rank"] for r in verdict(report)["receivers"])


def checks(report: dict[str, Any], severity: str | None = None) -> list[str]:
    return [f["check"] for f in report["findings"] if severity is None or f["severity"] == severity]
