"""The ``ckptverify`` command line: turns options into one library call and renders its report.

Exit codes everywhere: 0 all checks passed, 1 a check failed, 2 the tool could not run.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from ckptverify import __version__
from ckptverify.errors import CkptVerifyError


class _RichProgress:
    """Byte progress bar on a terminal (stderr), for the library's ``ProgressSink``."""

    def __init__(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self._description = description
        self._task: Any = None

    def __enter__(self) -> _RichProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)

    def start(self, total_bytes: int) -> None:
        self._task = self._progress.add_task(self._description, total=total_bytes)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)


def _want_progress(flag: bool | None, json_out: bool) -> bool:
    if flag is not None:
        return flag
    return not json_out and sys.stderr.isatty()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptverify")
def main() -> None:
    """Prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

    Exit codes: 0 all checks passed, 1 a check failed, 2 the tool could not run.
    """


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON (schema: docs/json-schema.md).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Files read in parallel [default: one per core].")
@click.option("--deep", is_flag=True,
              help="Also rebuild every tensor and compare its logical fingerprint with the manifest's "
                   "(memory -> disk -> memory); count NaN/Inf.")
@click.option("--no-manifest", is_flag=True, help="Ignore ckptverify.manifest.json even if present.")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar [default: on a terminal, without --json].")
def verify(path: str, json_out: bool, jobs: int | None, deep: bool, no_manifest: bool,
           progress: bool | None) -> None:
    """Verify the DCP checkpoint directory PATH.

    Checks metadata safety, structure, every record's CRC-32 and, when the checkpoint has a manifest,
    every byte against the digests taken at save time. Never writes into PATH and never executes
    anything from it.
    """
    from ckptverify.verify import verify_checkpoint

    def call(bar: Any) -> Any:
        return verify_checkpoint(path, jobs=jobs, deep=deep, use_manifest=not no_manifest, progress=bar)

    _emit(_with_progress(call, progress, json_out, "verify", path), json_out)


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--digest", type=click.Choice(["xxh3-128", "sha256"]), default="xxh3-128", show_default=True,
              help="Byte digest: xxh3-128 (fast) or sha256 (tamper evidence).")
@click.option("--block-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Block size of the per-item block digests that localize damage.")
@click.option("--force", is_flag=True, help="Replace an existing manifest.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel workers [one per core].")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar [on a terminal].")
def fingerprint(path: str, digest: str, block_bytes: int, force: bool, json_out: bool, jobs: int | None,
                progress: bool | None) -> None:
    """Adopt the DCP checkpoint PATH: verify it, then write its manifest (ckptverify.manifest.json).

    A checkpoint that fails verification is refused (exit 1) and nothing is written. Writes nothing
    but the manifest.
    """
    from ckptverify.adopt import fingerprint_checkpoint

    def call(bar: Any) -> Any:
        return fingerprint_checkpoint(path, digest=digest, block_bytes=block_bytes, force=force, jobs=jobs,
                                      progress=bar)[0]

    _emit(_with_progress(call, progress, json_out, "fingerprint", path), json_out)


@main.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None, help="Parallel workers [one per core].")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar [on a terminal].")
def diff(a: str, b: str, json_out: bool, jobs: int | None, progress: bool | None) -> None:
    """Compare checkpoints A and B tensor by tensor, whatever their sharding (exit 1 if they differ).

    Differing tensors are reported with the count of differing elements, max |a-b|, max ULP distance and
    the first differing index.
    """
    from ckptverify.diff import diff_checkpoints

    def call(bar: Any) -> Any:
        return diff_checkpoints(a, b, jobs=jobs, progress=bar)

    _emit(_with_progress(call, progress, json_out, "diff", f"{a} {b}"), json_out)


@main.command("resume-check")
@click.argument("target")
@click.option("--steps", "-T", type=click.IntRange(min=2), required=True, help="Steps of the continuous run.")
@click.option("--resume-at", "-K", type=click.IntRange(min=1), required=True,
              help="Step whose checkpoint run B resumes from.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks per run.")
@click.option("--level", type=click.Choice(["metrics", "state", "module"]), default="state", show_default=True,
              help="Trace detail: exact metrics; plus batch/params/grads/optimizer/scheduler/RNG fingerprints; "
                   "plus every module's outputs and input gradients.")
@click.option("--runs", default="A,A2,B", show_default=True,
              help="Runs to make: A (continuous), A2 (continuous again: determinism), B (resumed).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: gloo; cuda: NCCL, one GPU per rank.")
@click.option("--keep", type=click.Path(path_type=str), default=None,
              help="Keep checkpoints and traces in this directory.")
@click.option("--verbose", is_flag=True, help="List every final-state difference (else folded into one row).")
@click.option("--report", "report_dir", type=click.Path(path_type=str), default=None,
              help="Write an HTML page with figures here (needs matplotlib: pip install 'ckptverify[report]').")
@click.option("--json", "json_out", is_flag=True,
              help="Print the report as JSON (the workload's output goes to per-rank log files it names).")
def resume_check_cmd(target: str, steps: int, resume_at: int, nproc: int, level: str, runs: str, device: str,
                     keep: str | None, verbose: bool, report_dir: str | None, json_out: bool) -> None:
    """Prove that resuming TARGET from a checkpoint is bitwise identical to never stopping.

    TARGET is FILE.py:FUNC or package.module:FUNC, a function train(run) following the Run protocol
    (docs/resume.md). Runs A (1..T, saving at K), A2 (1..T again) and B (resumed from A's step K, to T), each
    in fresh processes, then compares restored state, traces and final states, and names the first
    divergence. Exit 0: equivalent; 1: not; 2: could not run (a crashing workload shows its traceback).
    """
    import os

    from ckptverify.resume.harness import Plan, resume_check
    from ckptverify.resume.render import emit_resume, log_dir_for

    if device == "cuda":
        os.environ["CKPTVERIFY_DEVICE"] = "cuda"
    try:
        plan = Plan(target=target, steps=steps, resume_at=resume_at, nproc=nproc, level=level,
                    runs=tuple(r.strip() for r in runs.split(",") if r.strip()), device=device)
        say = None
        if not json_out:
            from rich.console import Console
            from rich.markup import escape

            err = Console(stderr=True, emoji=False)
            say = lambda msg: err.print(f"[dim]· {escape(msg)}[/]")  # noqa: E731
        outcome = resume_check(plan, keep=keep, progress=say, verbose=verbose,
                               log_dir=log_dir_for(keep) if json_out else None, report_dir=report_dir)
    except CkptVerifyError as exc:
        _fail(exc, json_out, "resume-check", target)
    sys.exit(emit_resume(outcome, json_out))


@main.command()
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True, help="Ranks (gloo, CPU).")
@click.option("--keep", type=click.Path(path_type=str), default=None, help="Keep everything in this directory.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
def demo(nproc: int, keep: str | None, json_out: bool) -> None:
    """Show the whole tool on the built-in workload (about a minute): save and verify a checkpoint, find a
    flipped bit, prove a resume bitwise exact, and diagnose a planted bug."""
    from ckptverify.demo import run_demo

    say = None
    if not json_out:
        from rich.console import Console

        err = Console(stderr=True)
        say = lambda msg: err.print(f"[bold cyan]{msg}[/]" if msg[:2] in {"1/", "2/", "3/", "4/"}  # noqa: E731
                                    else f"[dim]  · {msg}[/]")
    try:
        report = run_demo(nproc=nproc, keep=keep, say=say)
    except CkptVerifyError as exc:
        _fail(exc, json_out, "demo", "built-in workload")
    _emit(report, json_out)


@main.group()
def trace() -> None:
    """Work with stored per-step traces."""


@trace.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--force", is_flag=True, help="Compare even if the trace headers differ.")
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON.")
def trace_diff(a: str, b: str, force: bool, json_out: bool) -> None:
    """Compare two stored traces (a run directory with rank*/ stores, or one rank's store) and name the first
    divergence: step, rank, site, category, and the originating module at module level."""
    from ckptverify.findings import Report
    from ckptverify.trace.compare import compare_runs

    try:
        findings = compare_runs(a, b, force=force)
    except CkptVerifyError as exc:
        _fail(exc, json_out, "trace diff", f"{a} {b}")
    _emit(Report(command="trace diff", target=f"{a} {b}", findings=tuple(findings)), json_out)


def _with_progress(call: Any, progress: bool | None, json_out: bool, command: str, target: str) -> Any:
    try:
        if _want_progress(progress, json_out):
            with _RichProgress(command) as bar:
                return call(bar)
        return call(None)
    except CkptVerifyError as exc:
        _fail(exc, json_out, command, target)


def _emit(report: Any, json_out: bool) -> None:
    from ckptverify.report import render_text, to_json

    if json_out:
        click.echo(to_json(report))
    else:
        from rich.console import Console

        render_text(report, Console(highlight=False))
    sys.exit(report.exit_code)


def _fail(exc: CkptVerifyError, json_out: bool, command: str, target: str) -> None:
    if json_out:
        import json

        from ckptverify.findings import REPORT_SCHEMA, REPORT_SCHEMA_VERSION

        click.echo(json.dumps({
            "schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION, "command": command,
            "target": target, "passed": False, "exit_code": exc.exit_code, "error": str(exc),
            "findings": [],
        }, indent=2))
    else:
        click.echo(f"ckptverify {command}: error: {exc}", err=True)
    sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
