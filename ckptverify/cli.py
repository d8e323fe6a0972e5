"""The ``ckptverify`` command line: turns options into one library call and renders its report.

Exit codes everywhere: 0 all checks passed, 1 a check failed, 2 the tool could not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from ckptverify._version import __version__
from ckptverify.errors import CkptVerifyError, UsageError
from ckptverify.render.report import fail, printable, safe_text

if TYPE_CHECKING:
    from ckptverify.checks.dcp_pipeline import Executor

F = TypeVar("F", bound=Callable[..., Any])


class _RichProgress:
    """The library's ``ProgressSink`` as a task of a rich ``Progress`` bar."""

    def __init__(self, bar: Any, description: str) -> None:
        self._bar, self._description, self._task = bar, description, None

    def start(self, total_bytes: int) -> None:
        self._task = self._bar.add_task(self._description, total=total_bytes)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)


@dataclasses.dataclass(frozen=True)
class _Progress:
    """The value of ``--progress/--no-progress``: as given, else the command's default (``always``: whenever
    ``--json`` is not given, for the commands that narrate their stages; else on a terminal without ``--json``)."""

    flag: bool | None
    always: bool

    def wanted(self, quiet: bool) -> bool:
        """Whether to show progress; ``quiet``: stdout is for a program (``--json``, ``latest --path-only``)."""
        if self.flag is not None:
            return self.flag
        return not quiet and (self.always or sys.stderr.isatty())


def _say(progress: _Progress, quiet: bool, *, emoji: bool = True, stages: bool = False) -> Any:
    """A ``progress(message)`` callback printing dim ``· message`` lines on stderr, or ``None`` (no progress);
    ``stages``: a numbered stage (``1/4 ...``) stands out and other lines are indented under it."""
    if not progress.wanted(quiet):
        return None
    from rich.console import Console

    err = Console(stderr=True, emoji=emoji)
    return lambda msg: err.print(safe_text(msg, "bold cyan") if stages and msg[:2] in {"1/", "2/", "3/", "4/"}
                                 else safe_text(f"{'  ' if stages else ''}· {msg}", "dim"))


def _decorators(*options: Callable[[F], F]) -> Callable[[F], F]:
    """Several ``click.option`` decorators as one, in the order they are listed (as ``--help`` shows them)."""
    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn
    return apply


# The options that several commands take: one definition, one help text each (docs/cli.md, "Shared options").

def _json_option(note: str = "") -> Callable[[F], F]:
    """``--json`` (``json_out``); ``note``: where this command's own results are in the report."""
    return click.option("--json", "json_out", is_flag=True,
                        help=f"Print the result as JSON (docs/json-schema.md){note}.")


def _metrics_option(when: str = "") -> Callable[[F], F]:
    """``--metrics-file``; ``when``: said when the command writes them other than once, at the end."""
    return click.option("--metrics-file", type=click.Path(path_type=str, dir_okay=False), default=None,
                        help=f"Also write Prometheus gauges of the result (passed, errors, ...) to this file{when}.")


def _progress_option(*, always: bool = False) -> Callable[[F], F]:
    """``--progress/--no-progress``, as a :class:`_Progress`; ``always``: on by default off a terminal too."""
    return click.option("--progress/--no-progress", default=None,
                        callback=lambda ctx, param, flag: _Progress(flag, always),
                        help="Show progress on stderr [default: " + ("on" if always else "on a terminal")
                             + ", without --json].")


_JOBS = click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
                     help="Files read in parallel [default: one per core].")
_DEEP = click.option("--deep", is_flag=True,
                     help="Also rebuild every tensor and compare its logical fingerprint with the manifest's "
                          "(memory -> disk -> memory); count NaN/Inf.")
_DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                       help="cpu: gloo; cuda: NCCL, one GPU per rank.")
_KEEP = click.option("--keep", type=click.Path(path_type=str), default=None,
                     help="Keep the files the runs make (checkpoints, traces, logs) in this directory.")


def _nproc_option(default: int) -> Callable[[F], F]:
    """``--nproc``: the ranks of each training run the command launches (torchrun's ``--nproc-per-node``)."""
    return click.option("--nproc", type=click.IntRange(min=1), default=default, show_default=True,
                        help="Ranks per training run, on this machine (as torchrun's --nproc-per-node).")


@dataclasses.dataclass(frozen=True)
class _Cluster:
    """``--readers``, ``--rank-timeout`` and ``--no-cluster``: whether and how the reading is shared among ranks."""

    readers: int | None
    rank_timeout: float
    off: bool


def _cluster_options(fn: F) -> F:
    """The options of a command that can share its reading among ranks, handed to it as ``cluster``
    (:class:`_Cluster`)."""
    @functools.wraps(fn)
    def command(*args: Any, readers: int | None, rank_timeout: float, no_cluster: bool, **kwargs: Any) -> Any:
        return fn(*args, cluster=_Cluster(readers, rank_timeout, no_cluster), **kwargs)

    return _decorators(
        click.option("--readers", type=click.IntRange(min=1), default=None,
                     help="Share the reading among N processes started on this machine, each reading its share "
                          "of the bytes. Under torchrun or srun the ranks come from the launcher instead: leave "
                          "this out."),
        click.option("--rank-timeout", type=click.FloatRange(min=1), default=120.0, show_default=True,
                     help="Seconds a rank may give no sign of life before the command fails naming it (exit 2)."),
        click.option("--no-cluster", is_flag=True,
                     help="Run in this one process even under torchrun or srun (their variables are ignored)."),
    )(command)  # type: ignore[return-value]


class _Group(click.Group):
    """The command group, with the project's exit codes for every way a command line can go wrong.

    Click's own usage errors exit 2 as ours do, but print plain text: with ``--json`` anywhere on the command
    line they are printed as a JSON error report instead, so a pipe into ``jq`` never sees prose. An unexpected
    exception (a bug, never a property of the input: inputs are judged in findings) exits 2 with one line,
    not a traceback; ``CKPTVERIFY_DEBUG=1`` shows the traceback.
    """

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        json_out = "--json" in argv
        command = next((a for a in argv if not a.startswith("-")), "ckptverify")
        try:
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            if json_out:
                fail(command, " ".join(argv), exc.format_message(), json_out)
            exc.show()
            sys.exit(exc.exit_code)
        except CkptVerifyError as exc:
            fail(command, " ".join(argv), exc, json_out)
        except Exception as exc:  # the last line of defence: no traceback for any input
            if os.environ.get("CKPTVERIFY_DEBUG"):
                raise
            fail(command, " ".join(argv), f"internal error ({type(exc).__name__}: {exc}); set CKPTVERIFY_DEBUG=1 for "
                 "the traceback", json_out, label="")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptverify")
def main() -> None:
    """Prove PyTorch distributed checkpoints intact, and resumption bitwise exact.

    Exit codes: 0 all checks passed, 1 a check failed, 2 the tool could not run.
    """


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@_json_option()
@_JOBS
@_DEEP
@click.option("--no-manifest", is_flag=True, help="Ignore manifests even if present.")
@click.option("--strict", is_flag=True,
              help="Fail closed: content that cannot be checked (no CRC-32 and no manifest) is an error.")
@_metrics_option()
@_progress_option()
@_cluster_options
def verify(path: str, json_out: bool, jobs: int | None, deep: bool, no_manifest: bool, strict: bool,
           metrics_file: str | None, progress: _Progress, cluster: _Cluster) -> None:
    """Verify the checkpoint PATH: a DCP folder, a single torch.save or safetensors file, or a folder of
    such files (Hugging Face, accelerate, transformers).

    Checks structure, metadata safety and every CRC-32 the format carries and, with a manifest
    (ckptverify.manifest.json inside a folder, NAME.ckptverify.manifest.json beside a file), every byte
    against the digests taken when it was saved or fingerprinted. Never writes into PATH and never
    executes anything from it.
    """
    from ckptverify.audit.verify import verify_checkpoint

    def call(bar: Any, jobs: int | None, executor: Executor | None) -> Any:
        return verify_checkpoint(path, jobs=jobs, deep=deep, use_manifest=not no_manifest, strict=strict,
                                 progress=bar, executor=executor)

    _read_shared("verify", path, call, cluster, jobs, progress, json_out, metrics_file)


@main.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--digest", type=click.Choice(["xxh3-128", "sha256"]), default="xxh3-128", show_default=True,
              help="Byte digest: xxh3-128 (fast) or sha256 (tamper evidence).")
@click.option("--block-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Block size of the per-item block digests that localize damage.")
@click.option("--force", is_flag=True, help="Replace an existing manifest.")
@click.option("--trust-uncheckable", is_flag=True,
              help="Adopt content that nothing could check (no CRC-32: stream transforms, safetensors, CRC "
                   "disabled) as it is; without it such a checkpoint is refused.")
@_json_option()
@_JOBS
@_progress_option()
@_metrics_option()
@_cluster_options
def fingerprint(path: str, digest: str, block_bytes: int, force: bool, trust_uncheckable: bool, json_out: bool,
                jobs: int | None, progress: _Progress, metrics_file: str | None, cluster: _Cluster) -> None:
    """Adopt the checkpoint PATH: verify it, then write its manifest (ckptverify.manifest.json).

    PATH is a DCP folder, a folder of checkpoint files (Hugging Face, accelerate, transformers; DCP parts
    inside get their own manifest), or a single file (its manifest is written beside it as
    NAME.ckptverify.manifest.json). A checkpoint that fails verification is refused (exit 1) and nothing is
    written; so is one holding content that nothing could check (safetensors, no CRC-32), unless
    --trust-uncheckable. Writes nothing but the manifest.
    """
    from ckptverify.audit.adopt import fingerprint_checkpoint

    def call(bar: Any, jobs: int | None, executor: Executor | None) -> Any:
        return fingerprint_checkpoint(path, digest=digest, block_bytes=block_bytes, force=force, jobs=jobs,
                                      trust_uncheckable=trust_uncheckable, progress=bar, executor=executor)[0]

    _read_shared("fingerprint", path, call, cluster, jobs, progress, json_out, metrics_file)


@main.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@_json_option()
@_JOBS
@_progress_option()
@click.option("--ignore", "ignore", multiple=True, metavar="PATTERN",
              help="Leave out tensors and values whose name matches this glob (repeatable), e.g. per-rank "
                   "entries that legitimately differ: --ignore '*_extra_state/shard_*'.")
@click.option("--map-prefix", "map_prefix", multiple=True, metavar="A_PREFIX=B_PREFIX",
              help="Compare A's names starting with A_PREFIX with B's names starting with B_PREFIX instead "
                   "(repeatable; the longest matching prefix wins; either side may be empty), e.g. "
                   "--map-prefix net.=model.net. or --map-prefix =model.")
@_metrics_option()
def diff(a: str, b: str, json_out: bool, jobs: int | None, progress: _Progress, ignore: tuple[str, ...],
         map_prefix: tuple[str, ...], metrics_file: str | None) -> None:
    """Compare checkpoints A and B tensor by tensor and value by value, whatever their sharding or format
    (DCP folders, single torch.save/safetensors files, Hugging Face/accelerate/transformers folders).

    Exit 1 if they differ, or if nothing could be compared. Differing tensors are reported with the count
    of differing elements, max |a-b|, max ULP distance and the first differing index.
    """
    from ckptverify.audit.diff import diff_checkpoints

    def call(bar: Any) -> Any:
        return diff_checkpoints(a, b, jobs=jobs, progress=bar, ignore=ignore, map_prefix=map_prefix)

    _emit(_with_progress(call, progress, json_out, "diff", f"{a} {b}"), json_out, metrics_file=metrics_file)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=str))
@_json_option()
@_JOBS
@_metrics_option()
@_DEEP
@_progress_option()
@_cluster_options
def scan(run_dir: str, json_out: bool, jobs: int | None, metrics_file: str | None, deep: bool,
         progress: _Progress, cluster: _Cluster) -> None:
    """Verify every checkpoint under the training run directory RUN_DIR and name the newest good one.

    Finds checkpoints by what they hold (torchtitan step-N/, Lightning checkpoints/, transformers
    checkpoint-N/, Megatron iter_N/, ckptverify step_N/, .pt/.ckpt/.safetensors files) and gives each a
    state: verified, intact, suspect, uncheckable, incomplete, deleted or corrupt. Exit 1 if any is corrupt,
    none is good, or part of RUN_DIR could not be seen (a folder it cannot list, more entries than it reads).
    """
    from ckptverify.render.scan import render_scan
    from ckptverify.runs.scan import scan_run_dir

    def call(bar: Any, jobs: int | None, executor: Executor | None) -> Any:
        return scan_run_dir(run_dir, jobs=jobs, progress=_say(progress, json_out), deep=deep, executor=executor)

    # Progress is the stages' lines (above), not a byte bar.
    _read_shared("scan", run_dir, call, cluster, jobs, _Progress(False, False), json_out, metrics_file,
                 render=render_scan)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=str))
@_json_option(": the pick is stats.path and stats.step")
@click.option("--path-only", is_flag=True,
              help="Print only the path, as raw bytes, one line (nothing when none is good): for scripts. A path "
                   "holding a newline is refused (exit 2): use --null.")
@click.option("--null", "-0", "null", is_flag=True,
              help="With --path-only (implied): end the path with a NUL byte instead of a newline, so any name "
                   "reads back exactly (xargs -0, read -d '').")
@click.option("--no-stamps", is_flag=True, help="Verify every candidate now, even those with a current stamp.")
@click.option("--trust-stamps", is_flag=True,
              help="Take a current stamp that says passed at its word: the pick is not read again (fast; a bit "
                   "flipped in place since its stamp goes unseen). Default: the pick is verified afresh.")
@_JOBS
@_metrics_option()
@_progress_option()
def latest(run_dir: str, json_out: bool, path_only: bool, null: bool, no_stamps: bool, trust_stamps: bool,
           jobs: int | None, metrics_file: str | None, progress: _Progress) -> None:
    """Print the newest checkpoint under RUN_DIR that verifies (exit 1 when none does).

    Newest first: a current stamp that says failed, uncheckable or suspect skips its checkpoint; the one about
    to be printed is verified afresh (unless --trust-stamps), and when it fails the next older one is tried;
    corrupt, torn, incomplete and uncheckable ones are skipped, each with a line saying why.
    """
    from ckptverify.runs.latest import latest_verified

    path_only = path_only or null
    json_out = json_out and not path_only  # with --path-only, stdout holds the path alone
    try:
        found = latest_verified(run_dir, jobs=jobs, use_stamps=not no_stamps, trust_stamps=trust_stamps,
                                progress=_say(progress, json_out or path_only))
    except CkptVerifyError as exc:
        fail("latest", run_dir, exc, json_out)
    if not path_only:
        _emit(found.report, json_out, metrics_file=metrics_file)
    _write_metrics(metrics_file, found.report, False)
    if found.path is not None:
        raw = os.fsencode(found.path)  # the name's own bytes, whatever their encoding
        if not null and b"\n" in raw:
            fail("latest", run_dir, f"the path {found.path} holds a newline, which one line cannot carry; use --null",
                 False)
        sys.stdout.flush()
        sys.stdout.buffer.write(raw + (b"\0" if null else b"\n"))
        sys.stdout.buffer.flush()
    sys.exit(found.report.exit_code)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--once", is_flag=True,
              help="One pass, then exit: 0 all judged passed, 1 a checkpoint failed or none was finished, 2 no "
                   "checkpoint to verify, one could not be verified or a result not recorded. For cron.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between passes.")
@click.option("--exit-on-failure", is_flag=True, help="Exit 1 at the first checkpoint that fails.")
@click.option("--log", "log_path", type=click.Path(path_type=str, dir_okay=False), default=None,
              help="Append one JSON line per result here [default: RUN_DIR/ckptverify-watch.jsonl].")
@_DEEP
@_metrics_option(", after every pass (the run's state: docs/runs.md)")
@_JOBS
@click.option("--poll", is_flag=True, help="Poll only: no inotify wake-ups (e.g. on network file systems).")
@_json_option(": one object per line, each result and each problem")
def watch(run_dir: str, once: bool, interval: float, exit_on_failure: bool, log_path: str | None, deep: bool,
          metrics_file: str | None, jobs: int | None, poll: bool, json_out: bool) -> None:
    """Verify and stamp every checkpoint under RUN_DIR as it commits; one line per result.

    Lists RUN_DIR every --interval seconds, and at once on a change where inotify is available; a committed
    checkpoint without a current stamp is verified and stamped (ckptverify.verified.json). A verdict stands
    even when its stamp cannot be written. Runs until interrupted, or one pass with --once.
    """
    from ckptverify.verifier.watch import watch as run_watch

    def show(item: dict) -> None:
        click.echo(json.dumps(item, default=str) if json_out else _watch_line(item))

    def problem(message: str) -> None:
        if json_out:
            show({"event": "problem", "reason": message})
        else:
            click.echo(f"ckptverify watch: error: {printable(message)}", err=True)

    try:
        result = run_watch(run_dir, once=once, interval=interval, exit_on_failure=exit_on_failure, log=log_path,
                           jobs=jobs, deep=deep, on_result=show, notify=not poll, metrics_file=metrics_file,
                           on_problem=problem)
    except CkptVerifyError as exc:
        if not json_out:
            fail("watch", run_dir, exc, False)
        show({"event": "error", "path": None, "reason": str(exc), "exit_code": exc.exit_code})
        sys.exit(exc.exit_code)
    if result.nothing is not None and not result.failed:
        message = f"nothing to verify under {run_dir}: {result.nothing}"
        if json_out:
            show({"event": "nothing", "path": None, "reason": message, "exit_code": result.exit_code})
        else:
            label = "error: " if result.exit_code == 2 else ""  # nothing there to watch: a usage error
            click.echo(f"ckptverify watch: {label}{printable(message)}", err=True)
    sys.exit(result.exit_code)


def _watch_line(item: dict) -> str:
    """One result of ``watch`` as a line of text (names escaped: a name cannot forge a line)."""
    event, where = item["event"], printable(item["path"])
    if item.get("step") is not None:
        where += f" (step {item['step']})"
    if event in ("verified", "failed"):
        text = f"{event.upper() if event == 'failed' else event}: {where}: "
        if item.get("checked_at"):
            text += f"its stamp of {item['checked_at']} says it failed verification"
        else:
            text += f"{item.get('state')}, {item.get('errors', 0)} error(s), {item.get('warnings', 0)} warning(s)"
            if item.get("first_error"):
                first = item["first_error"]
                text += f"; first: [{printable(first['check'])}] {printable(first['message'])}"
        if item.get("stamped") is False:
            text += f" (NOT STAMPED: {printable(item.get('stamp_error'))})"
        return text
    return f"{event}: {where}: {printable(item.get('reason'))}"


#: The options of the commands that launch training runs and judge them (resume-check, replay, compare).
_RUNS = _decorators(
    _DEVICE, _KEEP,
    click.option("--locate/--no-locate", default=True, show_default=True,
                 help="When the check fails, re-run the first divergent step at trace level op and name the op "
                      "where the difference is born, the ranks that receive it, and whether its kernel is "
                      "nondeterministic alone (docs/locate.md)."),
    click.option("--locate-repeats", type=click.IntRange(min=1), default=2, show_default=True,
                 help="Re-runs per side of the divergent step at level op (more repeats tell how often it "
                      "differs)."),
    _json_option(": the workload's output goes to per-rank log files named in stats.logs"),
    _metrics_option(), _progress_option(always=True),
)


@main.command("resume-check")
@click.argument("target")
@click.option("--steps", "-T", type=click.IntRange(min=2), required=True, help="Steps of the continuous run.")
@click.option("--resume-at", "-K", type=click.IntRange(min=1), required=True,
              help="Step whose checkpoint run B resumes from.")
@_nproc_option(1)
@click.option("--level", type=click.Choice(["metrics", "state", "comm", "module", "op"]), default="state",
              show_default=True,
              help="Trace detail: exact metrics; plus batch/params/grads/optimizer/scheduler/RNG fingerprints; "
                   "plus every collective's input and output; plus every module's outputs and input gradients; "
                   "plus every op (the op log).")
@click.option("--runs", default="A,A2,B", show_default=True,
              help="Runs to make: A (continuous), A2 (continuous again: determinism), B (resumed).")
@click.option("--verbose", is_flag=True, help="List every final-state difference (else folded into one row).")
@click.option("--report", "report_dir", type=click.Path(path_type=str), default=None,
              help="Write an HTML page with figures here (needs matplotlib: pip install 'ckptverify[report]').")
@_RUNS
def resume_check_cmd(target: str, steps: int, resume_at: int, nproc: int, level: str, runs: str, verbose: bool,
                     report_dir: str | None, device: str, keep: str | None, locate: bool, locate_repeats: int,
                     json_out: bool, metrics_file: str | None, progress: _Progress) -> None:
    """Prove that resuming TARGET from a checkpoint is bitwise identical to never stopping.

    TARGET is FILE.py:FUNC or package.module:FUNC, a function train(run) following the Run protocol
    (docs/resume.md). Runs A (1..T, saving at K), A2 (1..T again) and B (resumed from A's step K, to T), each
    in fresh processes, then compares restored state, traces and final states, and names the first
    divergence. Exit 0: equivalent; 1: not; 2: could not run (a crashing workload shows its traceback).
    """
    from ckptverify.render.resume import render_verdict, resume_check
    from ckptverify.resume.harness import Plan

    def run() -> Any:
        # The device travels to the workload's processes in the plan (Plan.device -> RunConfig.device -> run.device).
        plan = Plan(target=target, steps=steps, resume_at=resume_at, nproc=nproc, level=level,
                    runs=tuple(r.strip() for r in runs.split(",") if r.strip()), device=device, locate=locate,
                    locate_repeats=locate_repeats)
        return resume_check(plan, keep=keep, progress=_say(progress, json_out, emoji=False), verbose=verbose,
                            report_dir=report_dir)

    outcome = _launch("resume-check", target, keep, json_out, run)
    _emit(outcome.report, json_out, metrics_file=metrics_file, render=lambda report, console: render_verdict(
        report, console, outcome.verdict.headline(), outcome.verdict.passed))


@main.command()
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--from", "start", type=click.IntRange(min=0), default=None,
              help="Step of the production checkpoint to replay from [default: the second newest verified].")
@click.option("--to", "end", type=click.IntRange(min=1), default=None,
              help="Step of the production checkpoint to replay to [default: the newest verified].")
@click.option("--target", default=None, metavar="FILE.py:FUNC",
              help="The training function to replay (required: the one RUN_DIR/run.json records, which the error "
                   "without it names; a run directory is data, so nothing it names runs unless you name it). "
                   "FILE.py is found from the working directory, as resume-check finds it; a function other "
                   "than the one run.json records is refused before anything runs.")
@click.option("--max-procs", type=click.IntRange(min=1), default=64, show_default=True,
              help="The most ranks a replay may start (run.json's world size above it is refused).")
@_RUNS
def replay(run_dir: str, start: int | None, end: int | None, target: str | None, max_procs: int, device: str,
           keep: str | None, locate: bool, locate_repeats: int, json_out: bool, metrics_file: str | None,
           progress: _Progress) -> None:
    """Replay production steps FROM+1..TO of the job in RUN_DIR twice and judge the hardware.

    Verdicts: reproduced (exit 0); nondeterministic, hardware-fault-suspected, undetermined, checkpoint-corrupt,
    or the input cause that differs first: restore-mismatch, rng, scheduler, data, ... (exit 1).
    RUN_DIR is the run directory of a job run with cv.Run.main(..., run_dir=...); --target names the training
    function to run (the one RUN_DIR/run.json records: a run directory is data, nothing it names runs on its own).
    """
    from ckptverify.replay.replay import replay as run_replay

    # What runs is what the command line names (never what the run directory says on its own): the replay
    # checks it is the function run.json records before anything is verified or launched.
    report = _launch("replay", run_dir, keep, json_out, lambda: run_replay(
        run_dir, target=target, start=start, end=end, device=device, keep=keep,
        progress=_say(progress, json_out, emoji=False), max_procs=max_procs, locate=locate,
        locate_repeats=locate_repeats))
    _emit(report, json_out, metrics_file=metrics_file)


@main.command("compare")
@click.argument("base")
@click.argument("changed")
@click.option("--steps", "-T", type=click.IntRange(min=1), required=True, help="Steps each run makes.")
@_nproc_option(1)
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Control runs of BASE that measure its natural variation.")
@click.option("--level", type=click.Choice(["state", "module"]), default="state", show_default=True,
              help="Trace detail of the runs compared.")
@_RUNS
def compare_cmd(base: str, changed: str, steps: int, nproc: int, repeats: int, level: str, device: str,
                keep: str | None, locate: bool, locate_repeats: int, json_out: bool, metrics_file: str | None,
                progress: _Progress) -> None:
    """Tell whether CHANGED computes anything different from BASE, beyond BASE's natural variation.

    BASE and CHANGED are FILE.py:FUNC training functions following the Run protocol (as resume-check's TARGET).
    Runs BASE, REPEATS control runs of BASE and CHANGED, each from scratch in fresh processes, traced, and
    judges: no-effect (exit 0), effect (the controls agree, CHANGED differs: the op where the change enters;
    exit 1), within-variation (exit 0) or beyond-variation (exit 1) for a nondeterministic BASE. Exit 2: could not run.
    """
    from ckptverify.render.resume import render_compare
    from ckptverify.resume.change import ChangePlan, compare_change

    def run() -> Any:
        plan = ChangePlan(base=base, changed=changed, steps=steps, nproc=nproc, repeats=repeats, device=device,
                          level=level, locate=locate, locate_repeats=locate_repeats)
        return compare_change(plan, keep=keep, progress=_say(progress, json_out, emoji=False))

    report = _launch("compare", f"{base} vs {changed}", keep, json_out, run)
    _emit(report, json_out, render=render_compare, metrics_file=metrics_file)


@main.command()
@_nproc_option(2)
@_KEEP
@_json_option()
@_progress_option(always=True)
def demo(nproc: int, keep: str | None, json_out: bool, progress: _Progress) -> None:
    """Show the whole tool on the built-in workload (about a minute): save and verify a checkpoint, find a
    flipped bit, prove a resume bitwise exact, and diagnose a planted bug."""
    from ckptverify.examples.demo import run_demo

    try:
        report = run_demo(nproc=nproc, keep=keep, say=_say(progress, json_out, stages=True))
    except CkptVerifyError as exc:
        fail("demo", "built-in workload", exc, json_out)
    _emit(report, json_out)


@main.group()
def trace() -> None:
    """Work with stored per-step traces."""


@trace.command("diff")
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--allow-header-mismatch", is_flag=True,
              help="Compare even if the trace headers differ (over the sites both record).")
@click.option("--ignore", "ignore", multiple=True, metavar="PATTERN",
              help="Leave out sites whose name matches this glob (repeatable), e.g. --ignore 'module.*'.")
@_json_option()
@_metrics_option()
def trace_diff(a: str, b: str, allow_header_mismatch: bool, ignore: tuple[str, ...], json_out: bool,
               metrics_file: str | None) -> None:
    """Compare two stored traces (a run directory with rank*/ stores, or one rank's store) and name the first
    divergence: step, rank, site, category, and the originating module at module level."""
    from ckptverify.errors import TraceHeaderMismatchError
    from ckptverify.findings import Report
    from ckptverify.trace.compare import compare_traces

    try:
        findings = compare_traces(a, b, force=allow_header_mismatch, ignore_sites=ignore)
    except TraceHeaderMismatchError as exc:
        fail("trace diff", f"{a} {b}", UsageError(f"{exc}; pass --allow-header-mismatch to compare anyway"), json_out)
    except CkptVerifyError as exc:
        fail("trace diff", f"{a} {b}", exc, json_out)
    _emit(Report(command="trace diff", target=f"{a} {b}", findings=tuple(findings)), json_out,
          metrics_file=metrics_file)


def _launch(command: str, target: str, keep: str | None, json_out: bool, run: Callable[[], Any]) -> Any:
    """``run()``: the training runs ``command`` launches; returns what it returns, or exits 2 when they could not
    run. With ``--json`` every run writes each rank's output to a log file in a log folder (``KEEP/logs``, else a
    temporary folder, removed if nothing was launched), the locate walk's re-runs included, so stdout holds the one
    JSON document (what the user's code prints when its target is checked in this process goes to stderr:
    ``check_target``), and the report's ``stats.logs`` names the files. Without ``--json`` the runs' output is
    labelled on the terminal."""
    import tempfile

    from ckptverify.findings import Report
    from ckptverify.resume.launch import log_files, workload_logs

    log_dir = None
    if json_out:
        log_dir = os.path.join(os.path.abspath(keep), "logs") if keep else tempfile.mkdtemp(prefix="ckptverify-logs-")
    try:
        with workload_logs(log_dir) if log_dir else contextlib.nullcontext():
            result = run()
            if log_dir and isinstance(result, Report):  # resume-check's outcome names its logs itself
                result.stats["logs"] = log_files()
    except CkptVerifyError as exc:
        fail(command, target, exc, json_out, lines=True)
    finally:
        if log_dir and not keep and os.path.isdir(log_dir) and not os.listdir(log_dir):
            os.rmdir(log_dir)
    return result


def _with_progress(call: Any, progress: _Progress, json_out: bool, command: str, target: str) -> Any:
    """``call(bar)`` with a byte progress bar on stderr when progress is wanted (else ``None``), or exit 2."""
    try:
        if not progress.wanted(json_out):
            return call(None)
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
            return call(_RichProgress(bar, command))
    except CkptVerifyError as exc:
        fail(command, target, exc, json_out)


def _read_shared(command: str, target: str, call: Any, cluster: _Cluster, jobs: int | None, progress: _Progress,
                 json_out: bool, metrics_file: str | None, *, render: Any = None) -> None:
    """Run ``call(bar, jobs, executor)`` in this process, or as rank 0 of the ranks that share its reading
    (:mod:`ckptverify.cluster`; every other rank serves its share here and exits), and print the one report:
    with ranks, followed by the bytes each read. ``progress``: of the byte bar."""
    from ckptverify.render.report import render_text

    render = render or render_text
    session = _session(command, target, cluster, jobs, json_out)
    if session is None:
        _emit(_with_progress(lambda b: call(b, jobs, None), progress, json_out, command, target), json_out,
              render=render, metrics_file=metrics_file)
    try:
        report = session.finish(_with_progress(lambda b: call(b, session.jobs, session.executor), progress,
                                               json_out, command, target))
    except BaseException:
        session.close(failed=True)
        raise
    session.close()
    _emit(report, json_out, render=lambda r, c: (render(r, c), _render_ranks(r, c)), metrics_file=metrics_file)


def _session(command: str, path: str, cluster: _Cluster, jobs: int | None, json_out: bool) -> Any:
    """This process's part in a command run across ranks (:mod:`ckptverify.cluster`), or ``None`` to run alone.
    A rank other than 0 serves its share here and exits: rank 0 prints the one report."""
    readers = cluster.readers or 1
    if cluster.off and readers > 1:
        fail(command, path, UsageError(f"--readers {readers} and --no-cluster contradict each other: --no-cluster "
                                       "runs one process"), json_out)
    if cluster.off:
        return None
    from ckptverify.cluster.env import detect  # cheap: the environment alone

    try:
        if readers < 2 and detect() is None:
            return None
        from ckptverify.cluster.session import open_session

        session = open_session(command, path, readers=cluster.readers, rank_timeout=cluster.rank_timeout,
                               jobs=jobs, child_options={})
    except CkptVerifyError as exc:
        fail(command, path, exc, json_out)
    if session is None or session.is_root:
        return session
    failure: CkptVerifyError | None = None
    try:
        code = session.serve()
    except CkptVerifyError as exc:
        failure = exc
    finally:
        session.close()
    if failure is not None:
        fail(command, path, failure, False)  # as text: only rank 0 prints the report
    sys.exit(code)


def _render_ranks(report: Any, console: Any) -> None:
    """One line per rank (the three that read most and a summary past eight) with the bytes it read, and the balance."""
    from ckptverify.render.report import human_bytes

    def say(text: str) -> None:
        console.print(safe_text(text, "dim"))

    stats = report.stats
    ranks = stats.get("ranks") or []
    total = int(stats.get("bytes") or 0)
    say(f"read by {len(ranks)} ranks ({stats.get('launcher')}):")
    for r in ranks if len(ranks) <= 8 else sorted(ranks, key=lambda r: -r["bytes_read"])[:3]:
        share = f" ({r['bytes_read'] / total:.1%})" if total else ""
        say(f"  rank {r['rank']} on {r['host']}: read {human_bytes(r['bytes_read'])}{share} in {r['units']} unit(s)")
    if len(ranks) > 8:
        sizes = sorted(r["bytes_read"] for r in ranks)
        say(f"  ... and {len(ranks) - 3} more ranks: least {human_bytes(sizes[0])}, median "
            f"{human_bytes(sizes[len(sizes) // 2])}")
    bal = stats.get("balance") or {}
    if bal:
        say(f"  largest share {bal['largest_fraction']:.1%} of the bytes (limit {bal['limit_fraction']:.1%}): "
            + ("balanced" if bal["met"] else f"not balanced: {bal['why_not']}"))
    if stats.get("ranks_note"):
        say(f"  {stats['ranks_note']}")


def _emit(report: Any, json_out: bool, render: Any = None, metrics_file: str | None = None) -> NoReturn:
    from ckptverify.render.report import render_text, to_json

    _write_metrics(metrics_file, report, json_out)
    if json_out:
        click.echo(to_json(report))
    else:
        from rich.console import Console

        (render or render_text)(report, Console(highlight=False))
    sys.exit(report.exit_code)


def _write_metrics(metrics_file: str | None, report: Any, json_out: bool) -> None:
    """Write ``--metrics-file`` gauges for ``report`` (nothing without the option); exit 2 when it cannot be."""
    if metrics_file is None:
        return
    from ckptverify.render.metrics import write_metrics

    try:
        write_metrics(metrics_file, report)
    except OSError as exc:
        fail(report.command, report.target, UsageError(f"cannot write --metrics-file {metrics_file}: {exc}"), json_out)
