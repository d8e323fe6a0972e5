"""``ckptverify demo``: the whole tool on the built-in workload, in about a minute.

1. Train the tiny GPT on 2 ranks (FSDP2 over gloo) and save a checkpoint with its manifest (run A of a
   resume check), then ``verify`` it.
2. Flip one bit in a copy and ``verify`` the copy: the damage is found and localized.
3. The resume-equivalence check of the correct workload: passes.
4. The same check of a planted bug (the LR scheduler left out of the saved state): fails, with its diagnosis.

Every stage's outcome is a finding; the demo fails (exit 1) if any stage does not behave as it should.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

from ckptverify.findings import Finding, Location, Report, error, info


def run_demo(*, nproc: int = 2, steps: int = 8, resume_at: int = 4, keep: str | None = None,
             say: Callable[[str], None] | None = None) -> Report:
    from ckptverify.audit.verify import verify_checkpoint
    from ckptverify.resume.harness import Plan, resume_check
    from ckptverify.resume.launch import scratch
    from ckptverify.resume.run import checkpoint_path

    say = say or (lambda _msg: None)
    findings: list[Finding] = []
    with scratch(keep, "ckptverify-demo-") as workdir:
        say(f"1/4 training the built-in tiny GPT on {nproc} rank(s) and checking resume equivalence")
        good = resume_check(Plan(target="ckptverify.examples.workloads:correct", steps=steps, resume_at=resume_at,
                                 nproc=nproc), keep=os.path.join(workdir, "correct"), progress=say)
        ckpt = checkpoint_path(os.path.join(workdir, "correct", "A", "ckpt"), resume_at)

        say(f"2/4 verifying the checkpoint saved at step {resume_at} (with its manifest)")
        clean = verify_checkpoint(ckpt, deep=True)
        findings.append(_stage("verify clean checkpoint", clean.passed,
                               f"{clean.stats.get('files')} files, {clean.stats.get('items')} items, "
                               f"{clean.stats.get('tensors')} tensors verified against the manifest and "
                               "read back bitwise (--deep)", clean))

        say("3/4 flipping one bit in a copy and verifying the copy")
        damaged = os.path.join(workdir, "damaged")
        shutil.copytree(ckpt, damaged, dirs_exist_ok=True)
        where = _flip_one_bit(damaged)
        bad = verify_checkpoint(damaged)
        hit = next((f for f in bad.errors if f.check in ("manifest-digest", "zip-crc")), None)
        findings.append(_stage("verify damaged copy", hit is not None,
                               f"flipped bit {where}; found: {hit.message if hit else 'nothing'}"
                               + (f" at {hit.location.describe()}" if hit else ""), bad))

        findings.append(_stage("resume-check correct workload", good.verdict.kind == "pass", good.verdict.message,
                               good.report))

        say("4/4 checking a planted bug: the LR scheduler is left out of the saved state")
        planted = resume_check(Plan(target="ckptverify.examples.workloads:scheduler_not_saved", steps=steps,
                                    resume_at=resume_at, nproc=nproc, runs=("A", "B")),
                               keep=os.path.join(workdir, "planted"), progress=say)
        findings.append(_stage("resume-check planted bug", planted.verdict.kind == "scheduler",
                               f"diagnosis: {planted.verdict.message}", planted.report))
    return Report(command="demo", target="built-in workload", findings=tuple(findings),
                  stats={"nproc": nproc, "steps": steps, "resume_at": resume_at, "workdir": workdir if keep else None})


def _stage(name: str, ok: bool, detail: str, report: Report) -> Finding:
    if ok:
        return info("demo", f"{name}: as expected. {detail}", location=Location(fqn=name))
    return error("demo", f"{name}: NOT as expected. {detail}", location=Location(fqn=name),
                 actual=[f.to_dict() for f in report.findings][:5])


def _flip_one_bit(ckpt: str) -> str:
    """Flip a bit in the middle of the largest data file; return where."""
    files = [f for f in os.listdir(ckpt) if f.endswith(".distcp")]
    name = max(files, key=lambda f: os.path.getsize(os.path.join(ckpt, f)))
    path = os.path.join(ckpt, name)
    offset = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x08]))
    return f"3 of byte {offset} of {name}"
