"""The ``Run`` protocol: five lines that make a training function resumable, traceable and checkable.

```python
import ckptverify as cv

def train(run: cv.Run) -> None:
    ...                                          # build model, optimizer, scheduler, loader as usual
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    run.restore(state)                           # resumes here under the harness; no-op on a fresh start
    for batch in run.steps(loader):              # yields until the stop step
        loss = ...
        run.record(loss=loss, batch=batch)       # end of step: trace; saves when asked
```

The same function runs unchanged under plain ``python`` (``cv.Run.main(train, steps=100)``), under
``torchrun`` on N ranks, and under the harness (``ckptverify resume-check``), which hands its plan (stop
step, save steps, resume checkpoint, trace level and directory) to each rank's process as a
:class:`RunConfig` (:func:`harness_job`), never through the environment: nothing of it leaks into a process
the training function starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptverify.errors import UsageError
from ckptverify.options import VerifyOptions, verify_options
from ckptverify.ownfiles.names import own_folder, write_atomic
from ckptverify.state.distributed import rank_world

#: The trace levels (``ckptverify.trace.store.LEVELS``, repeated here so that importing the Run protocol does not
#: import the trace package; a test checks that the two agree).
LEVELS = ("metrics", "state", "comm", "module", "op")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What the harness asks of one run. Defaults describe a plain run: no saves, no trace."""

    name: str = "plain"
    stop_step: int | None = None
    #: The job's length, when it differs from ``stop_step`` (a replay stops early; its schedules do not).
    total_steps: int | None = None
    save_at: tuple[int, ...] = ()
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    trace_dir: str | None = None
    level: str = "state"
    workload: str = ""
    log_dir: str | None = None
    #: Record every ``trace_every``-th step (those with ``step % trace_every == 0``); 1 records every step.
    trace_every: int = 1
    #: ``category``: one trace cell per tensor category (production); ``tensor``: one per tensor as well.
    trace_detail: str = "category"
    #: The device the ranks were launched for (``Plan.device``: ``"cpu"`` with gloo, ``"cuda"`` with NCCL, one GPU
    #: per rank), set by the launcher; ``None`` when no launcher of ours said (a plain or production run).
    device: str | None = None
    #: At level ``op``: the op window (``dataclasses.asdict`` of a :class:`ckptverify.trace.oplog.OpWindow`,
    #: JSON values): the steps, ranks and modules whose every op is logged; ``None``: all of them.
    op_window: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise UsageError(f"trace level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.op_window is not None:
            from ckptverify.trace.oplog import window_from_dict

            window_from_dict(self.op_window)  # refused here, before any rank starts
        if self.trace_every < 1:
            raise UsageError(f"trace_every must be at least 1, got {self.trace_every}")
        if self.save_at and not self.checkpoint_dir:
            raise UsageError("save_at needs checkpoint_dir")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        data = json.loads(text)
        data["save_at"] = tuple(data.get("save_at", ()))
        return cls(**data)


def checkpoint_path(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step_{step}")


@dataclass
class _Progress:
    step: int = 0
    restored_from: str | None = None
    restore_report: Any = None
    records: int = 0
    saved: list[str] = field(default_factory=list)


#: The harness's run of this process while it runs one of its jobs (see :func:`harness_job`), else ``None``.
_harness_config: RunConfig | None = None


@contextlib.contextmanager
def harness_job(config: RunConfig) -> Iterator[None]:
    """Within the block, this process runs the harness job ``config``: ``Run.main`` and ``Run.from_env`` give
    its run. Set by the harness in each rank's process around the training function (an argument of the
    process, not an environment variable, so a process the training function starts does not inherit it)."""
    global _harness_config
    previous, _harness_config = _harness_config, config
    try:
        yield
    finally:
        _harness_config = previous


class Run:
    """One run of a training function: where to stop, when to save, what to trace, where to resume from."""

    def __init__(self, config: RunConfig | None = None) -> None:
        self.config = config or RunConfig()
        self.state: Any = None
        self._p = _Progress()
        self._recorder: Any = None
        self._production: Any = None
        #: Production mode: the checkpoint picked to resume from (see ``_resume_point``).
        self._picked: Any = None
        self._owns_group = False
        self._rank, self._world = rank_world(env_fallback=True)
        #: The frame of the function that called ``restore`` (under the harness), until ``close``.
        self._held_frame: Any = None
        #: Until the first ``record``: that frame and its variables naming registered objects at the restore
        #: (to tell whether one was rebuilt after it), and the notes written at the restore.
        self._bindings: Any = None
        self._notes: dict[str, Any] = {}

    @classmethod
    def from_env(cls, *, steps: int | None = None) -> Run:
        """The harness's run when this process runs one of its jobs (:func:`harness_job`), else a plain run of
        ``steps`` steps."""
        if _harness_config is not None:
            return cls(_harness_config)
        return cls(RunConfig(stop_step=steps))

    @classmethod
    def main(cls, train: Callable[[Run], None], *, steps: int | None = None, run_dir: str | None = None,
             save_every: int | None = None, trace: str = "metrics", trace_every: int = 1,
             on_replica_mismatch: str = "warn", fault: str | None = None,
             verify: VerifyOptions | str = "background", resume: str = "auto") -> None:
        """Run ``train`` once: as the harness asks (if it launched this process), as a production job (with
        ``run_dir``: see :mod:`ckptverify.production.mode`), or plainly for ``steps`` steps.

        Production mode: ``steps`` total steps; the full state saved every ``save_every`` steps to
        ``run_dir/step_N``; a trace at level ``trace`` every ``trace_every`` steps; replicas compared on more
        than one rank (``on_replica_mismatch``: ``"warn"`` or ``"raise"``); ``fault``: a
        :class:`~ckptverify.hardware.inject.BitFlip` as JSON, for fire drills; ``verify``: how each saved
        checkpoint is verified and stamped once committed, a :class:`~ckptverify.options.VerifyOptions` or its
        ``when`` (``"background"``, the default here so that no save stalls the job, ``"inline"`` or ``"off"``),
        with its ``deep`` and ``on_failure``; the job waits for the pending verifications before it ends. The
        options and failure policies: :mod:`ckptverify.options.verify`.
        Started by ``python`` or ``torchrun``: the process group is created from torchrun's environment when none
        exists.

        ``resume``: ``"auto"`` (the newest checkpoint that verifies; step 0 in an empty run directory; refused
        when checkpoints exist and none verifies), ``"required"`` (refused when there is nothing to resume
        from) or ``"never"`` (step 0; refused when a checkpoint verifies). Every checkpoint skipped is said on
        stderr and in ``events.jsonl``, and one that fails is moved aside, never overwritten (see
        :mod:`ckptverify.production.mode`). A refusal prints why on stderr and exits with status 2 (raises
        ``SystemExit(2)``) before ``train`` runs, having changed nothing.
        """
        verifying = verify_options("Run.main", verify)
        if _harness_config is not None or run_dir is None:
            run = cls.from_env(steps=steps)
        else:
            from ckptverify.production.mode import ProductionOptions, ResumeRefusedError, target_of

            if steps is None:
                raise UsageError("production mode needs steps=")
            local = run_dir if "://" in os.fspath(run_dir) else os.path.abspath(run_dir)  # a URL is refused there
            options = ProductionOptions(run_dir=local, steps=steps, save_every=save_every,
                                        trace=trace, trace_every=trace_every,
                                        on_replica_mismatch=on_replica_mismatch, fault=fault, verify=verifying,
                                        resume=resume)
            try:
                run = cls._for_production(options, target_of(train))
            except ResumeRefusedError:
                # Said on stderr by rank 0 already (and recorded): a refusal is an answer, not a crash.
                raise SystemExit(2) from None
        try:
            train(run)
        finally:
            run.close()

    @classmethod
    def _for_production(cls, options: Any, target: str) -> Run:
        from ckptverify.production.mode import Production

        owns = _init_group_from_env()
        rank, world = rank_world(env_fallback=True)
        try:
            picked = _resume_point(options, rank=rank, world=world)
        except BaseException:
            if owns:
                import torch.distributed as dist

                dist.destroy_process_group()  # every rank refuses alike: none is left in a collective
            raise
        start = picked.step if picked is not None else 0
        run = cls(_production_config(options, target, picked))
        run._owns_group = owns
        run._picked = picked
        run._production = Production(options, rank=rank, world=world, target=target, start=start)
        return run

    # ------------------------------------------------------------------ the protocol

    @property
    def step(self) -> int:
        """Steps completed so far (restored from the checkpoint when resuming)."""
        return self._p.step

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> str | None:
        """The device ``resume-check --device`` or ``replay --device`` launched this rank for (``"cpu"`` or
        ``"cuda"``), for a workload that places its model by it; ``None`` when it was not launched by them."""
        return self.config.device

    @property
    def total_steps(self) -> int:
        """The job's length in steps: ``Run.main(steps=)``, the production job's ``steps`` (also in a replay of
        part of it), or the harness's ``--steps``; for a schedule that needs it, such as
        ``OneCycleLR(total_steps=run.total_steps)``.

        Every run of one resume check (A, A2 and B) gets the same value, so a schedule built from it is the same
        in all of them. Raises :class:`~ckptverify.errors.UsageError` for a run started without a step count."""
        total = self.config.total_steps if self.config.total_steps is not None else self.config.stop_step
        if total is None:
            raise UsageError("this run has no step count: give Run.main(train, steps=N) (or --steps to the harness)")
        return total

    def restore(self, state: Any) -> None:
        """Register the training state; when resuming, load it (verified, then checked) from the checkpoint.

        Under the harness it also notes what the calling function holds outside ``state`` (stateful local
        variables, see :mod:`ckptverify.resume.unregistered`) and, when resuming, the random streams and
        hyperparameters as restored (to tell later which run moved them). At the end of the run (``close``) it
        fingerprints the values that function then holds outside ``state``, so runs can be compared on them."""
        from ckptverify.state.train_state import TrainState

        if not isinstance(state, TrainState):
            raise UsageError(f"run.restore() takes a TrainState, got {type(state).__name__}")
        self.state = state
        notes: dict[str, Any] = {"unsaved_schedulers": unsaved_schedulers(state)}
        if state.dataloader is not None:
            from torch.utils.data import IterableDataset

            # What a data verdict can say about the loader's position (an iterable dataset has no indices).
            notes["loader"] = {"type": type(state.dataloader).__name__, "iterable": isinstance(
                getattr(state.dataloader, "dataset", None), IterableDataset)}
        import sys

        from ckptverify.resume.unregistered import registered_bindings

        caller = sys._getframe(1)
        self._bindings = (caller, registered_bindings(caller.f_locals, state))
        if self.config.trace_dir:
            from ckptverify.resume.unregistered import find_unregistered, missing_optimizer

            notes["unregistered"] = [u.to_dict() for u in find_unregistered(caller.f_locals, state)]
            if self._production is None:
                # Kept to the end of the run (a frame keeps its locals after the function returns): what the
                # function then holds outside `state` is compared across runs (see `_write_held`).
                self._held_frame = caller
            del caller
            notes["missing_optimizer"] = missing_optimizer(state)
        if self.config.resume_from:
            from ckptverify.checkpoint.load import load

            # Production: the checkpoint was picked (and so verified) when the job started; the harness names one
            # and diagnoses a restore mismatch rather than refusing it.
            if self._picked is None:
                with warnings.catch_warnings():
                    # The harness judges the difference itself (restore-rankN.json, then its verdict).
                    warnings.filterwarnings("ignore", message="the restore check of ", category=UserWarning)
                    report = load(state, self.config.resume_from, on_restore_mismatch="warn")
            else:
                from ckptverify.production.mode import ResumeRefusedError

                try:
                    # Never trains on damaged state: a pick that fails its proof is moved aside and the next
                    # older one loaded; what cannot be resumed is refused (said on stderr and recorded).
                    report, picked = self._production.restore(state, self._picked)
                except ResumeRefusedError:
                    raise SystemExit(2) from None
                if picked is not self._picked:  # fell back: start, saves and trace segment follow the pick
                    self._picked = picked
                    self.config = _production_config(self._production.options, self.config.workload, picked)
            self._p.restored_from = self.config.resume_from
            self._p.restore_report = report
            self._write_json(f"restore-rank{self._rank}.json", report.to_dict())
            notes["restored"] = _start_values(state)
        self._p.step = state.counters.step
        self._notes = notes
        self._write_json(f"notes-rank{self._rank}.json", notes)
        if self._production is not None:
            # Before the trace attaches its hooks: a planted fault must precede the trace's view of the step,
            # as a real one in the computation would.
            self._production.began(state, self._p.restored_from)
        self._open_trace()

    def steps(self, loader: Iterable[Any] | None = None, *, micro_batches: int = 1) -> Iterator[Any]:
        """Yield batches from ``loader`` (or step numbers without one) until the stop step.

        ``micro_batches=K`` (gradient accumulation): each item is a list of the ``K`` batches one optimizer
        step trains on, so a step (and a save) always falls on an optimizer-step boundary; pass the list to
        ``run.record(batch=...)``. A loader that ends within a step ends the run before that step.
        With a built-in ``ResumableSampler`` the consumed position is tracked; after resuming, the random
        streams are put back once the loader's iterator exists (creating it draws a base seed).
        """
        from ckptverify.state.dataloader import find_resumable_sampler

        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise UsageError(f"run.steps(micro_batches=...) takes a whole number of at least 1, got {micro_batches!r}")
        if micro_batches > 1 and loader is None:
            raise UsageError("run.steps(micro_batches=...) needs the loader whose batches it groups: "
                             "run.steps(loader, micro_batches=K)")
        stop = self.config.stop_step
        registered = self.state.dataloader if self.state is not None else None
        # The sampler whose last handed-out batch the trace records (``data.indices``): the iterated loader's,
        # else the registered one's (a loop that fetches its batches itself through ``sampler.track``).
        self._sampler = find_resumable_sampler(loader) if loader is not None else None
        if self._sampler is None and registered is not None:
            self._sampler = find_resumable_sampler(registered)
        if loader is None:
            it: Iterator[Any] = _count(self._p.step + 1)
        else:
            it = _epochs(loader, self.state)
            # Creating the loader's iterator draws a base seed from a random stream; an uninterrupted run
            # drew it when the epoch began, before the checkpoint. A resumed run must not draw it again.
            resumed = self._p.restored_from is not None and self.state is not None
            if resumed:
                from ckptverify.state.rng import capture_rng, restore_rng

                before = capture_rng(self.state.rng.generators)
            marker = next(it, _END)
            assert marker is _ITER_READY
            if resumed:
                restore_rng(before, self.state.rng.generators)
        self._pending = False
        while stop is None or self._p.step < stop:
            if self._pending:
                raise UsageError("call run.record(...) once at the end of every step")
            if micro_batches == 1:
                item = next(it, _END)
            else:
                group = [b for b in (next(it, _END) for _ in range(micro_batches)) if b is not _END]
                item = group if len(group) == micro_batches else _END
            if item is _END:
                return
            self._pending = True
            if self._recorder is not None:
                if self._traced(self._p.step + 1):
                    # Before the step draws anything: a random stream that differs here is a cause.
                    self._recorder.record_step_start(self.state, step=self._p.step + 1)
                else:
                    self._recorder.begin_skipped_step()
            yield item

    def record(self, *, loss: Any = None, batch: Any = None, **metrics: Any) -> None:
        """End of a step: record the trace row, advance the step counter, save if this step is planned."""
        if not getattr(self, "_pending", False):
            raise UsageError("run.record() must be called once per step yielded by run.steps()")
        self._pending = False
        if self._bindings is not None:
            self._check_replaced()
        self._p.step += 1
        if self.state is not None:
            self.state.counters.step = self._p.step
        values = dict(metrics)
        if loss is not None:
            values["loss"] = loss
        traced = self._traced(self._p.step)
        if self._recorder is not None:
            if traced:
                self._recorder.record_step(self._p.step, metrics=values, batch=batch,
                                           state=self.state if self.config.level != "metrics" else None,
                                           batch_indices=self._batch_indices())
            else:
                self._recorder.skip_step()
        self._p.records += 1
        if self._production is not None:
            self._production.stepped(self._p.step, traced=traced)
        if self._p.step in self.config.save_at:
            self._save()

    def _batch_indices(self) -> list[Any] | None:
        """``[epoch, indices]`` of the last batch the tracked ``ResumableSampler`` handed to the loop (with
        ``run.steps(loader)``: this step's batch), or ``None`` when no tracked sampler is known."""
        sampler = getattr(self, "_sampler", None)
        last = sampler.last_batch() if sampler is not None else None
        return None if last is None else [last[0], last[1]]

    def _traced(self, step: int) -> bool:
        return step % self.config.trace_every == 0

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        frame, self._held_frame = self._held_frame, None
        if frame is not None:
            self._write_held(frame)
            del frame  # its locals (model, loader, workers) go as the function's own would
        if self.config.trace_dir and self._rank == 0:
            self._write_json("run.json", {"name": self.config.name, "steps": self._p.step,
                                          "saved": self._p.saved, "world_size": self._world})
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # no rank tears down while another is still in a collective
                dist.destroy_process_group()
            self._owns_group = False
        if self._production is not None:
            # After the group is gone: rank 0 may wait here for its pending verifications, longer than a
            # collective would wait for it.
            self._production.close(self._p.step)
            self._production = None

    # ------------------------------------------------------------------ internals

    def _check_replaced(self) -> None:
        """At the end of the first step: a registered object that the training function rebuilt after
        ``run.restore`` (the loop steps the new one; checkpoints save and restore the old one) is warned about,
        and noted for the harness (``replaced`` in ``notes-rank<r>.json``)."""
        import warnings

        from ckptverify.errors import CkptVerifyWarning
        from ckptverify.resume.unregistered import replaced_objects

        (frame, bindings), self._bindings = self._bindings, None
        try:
            replaced = replaced_objects(bindings, frame.f_locals, self.state)
        finally:
            del frame
        if not replaced:
            return
        for r in replaced:
            warnings.warn(f"ckptverify: {r['name']} ({r['type']}) was rebuilt after run.restore(): the TrainState "
                          f"saves and restores the {r['registered_type']} it was given as {r['field']}, not the "
                          f"one the loop uses; build it before run.restore(state), or register the new one",
                          CkptVerifyWarning, stacklevel=3)
        self._notes["replaced"] = [{**r, "step": self._p.step + 1} for r in replaced]
        self._write_json(f"notes-rank{self._rank}.json", self._notes)

    def _write_held(self, frame: Any) -> None:
        """``held-rank<r>.json``: fingerprints of what the function that called ``restore`` holds at the end of
        the run outside the ``TrainState`` (:func:`~ckptverify.resume.unregistered.held_state`). A failure to
        take them is written there too (the harness then says it could not compare), never raised: the run
        itself succeeded."""
        from ckptverify.resume.unregistered import held_state

        try:
            data = held_state(frame.f_locals, self.state)
        except Exception as exc:
            data = {"error": f"{type(exc).__name__}: {exc}"}
        self._write_json(f"held-rank{self._rank}.json", data)

    def _save(self) -> None:
        from ckptverify.checkpoint.save import save

        if self.state is None:
            raise UsageError("the harness asked for a checkpoint but run.restore(state) was never called")
        assert self.config.checkpoint_dir is not None
        if self._world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise UsageError(f"the harness runs {self._world} ranks, but the process group was destroyed before "
                                 f"the checkpoint of step {self._p.step}: leave destroy_process_group() to the "
                                 "harness (or call it only after the last run.record)")
        path = checkpoint_path(self.config.checkpoint_dir, self._p.step)
        if self.state.model is not None and self.config.trace_dir:
            from ckptverify.state.train_state import pending_gradients

            # `save` warns about them; the harness is told too, to name them as the cause of a divergence.
            names, count = pending_gradients(self.state.model)
            if count:
                self._notes.setdefault("pending_gradients", []).append(
                    {"step": self._p.step, "count": count, "names": names})
                self._write_json(f"notes-rank{self._rank}.json", self._notes)
        if self._recorder is not None:
            self._recorder.flush()
        if self._production is not None:
            self._production.before_save(self._p.step, path)  # never over a checkpoint; notes a suspect one
        save(self.state, path, **(self._production.save_options() if self._production is not None else {}))
        self._p.saved.append(path)
        if self._production is not None:
            self._production.saved(self._p.step, path)

    def _open_trace(self) -> None:
        if not self.config.trace_dir or self._recorder is not None:
            return
        from ckptverify.trace import TraceHeader, TraceRecorder

        header = TraceHeader(run=self.config.name, level=self.config.level, workload=self.config.workload,
                             detail=self.config.trace_detail)
        window = None
        if self.config.op_window is not None:
            from ckptverify.trace.oplog import window_from_dict

            window = window_from_dict(self.config.op_window)
        self._recorder = TraceRecorder(self.config.trace_dir, header=header, overwrite=True, window=window)
        if self._production is not None:
            self._production.traced_by(self._recorder)
        if self.config.level != "metrics" and self.state is not None and self.state.model is not None:
            # Gradients are captured right before each optimizer step (wherever the loop zeroes them);
            # at level "module" (and "op") every module's output and input gradient too.
            self._recorder.attach(self.state.model, optimizer=self.state.optimizers or None)

    def _write_json(self, name: str, data: Any) -> None:
        if not self.config.trace_dir:
            return
        trace_dir = own_folder(self.config.trace_dir)  # never through a link at its name
        write_atomic(os.path.join(trace_dir, name), json.dumps(data, indent=1, default=str),
                     prefix=f".{name}.", durable=False)


_END = object()


def _epochs(loader: Iterable[Any], state: Any) -> Iterator[Any]:
    """Batches over epochs. The first item yielded is a marker once the epoch's iterator exists (so the
    caller can act right after the base-seed draw), then batches; at the end of an epoch the sampler moves
    to the next epoch and the epoch counter advances."""
    from ckptverify.state.dataloader import find_resumable_sampler

    sampler = find_resumable_sampler(loader)
    stateful = type(loader).__name__.startswith("Stateful")
    first_epoch = True
    while True:
        inner = iter(loader)  # draws the base seed now
        batches = sampler.track(inner, batch_size=getattr(loader, "batch_size", None)) if (
            sampler is not None and not stateful) else inner
        if first_epoch:
            yield _ITER_READY
            first_epoch = False
        got = False
        for batch in batches:
            got = True
            yield batch
        if not got and sampler is None:
            return
        if sampler is None:
            return  # a plain loader: one pass
        sampler.set_epoch(sampler.epoch + 1)
        if state is not None:
            state.counters.epoch = sampler.epoch


_ITER_READY = object()


def _start_values(state: Any) -> dict[str, Any]:
    """The step-start sites (see ``TraceRecorder.record_step_start``) as ``state`` holds them now, decoded
    as a trace reads them: what a resumed run restored, before any step."""
    from ckptverify.state.digest import state_digest
    from ckptverify.state.rng import capture_rng
    from ckptverify.trace.recorder import hparam_cells
    from ckptverify.trace.store import decode

    out: dict[str, Any] = {f"start.rng.{kind}": state_digest(value)
                           for kind, value in capture_rng(state.rng.generators).items()
                           if kind != "cuda_device"}  # which device, not a stream: the trace has no such site
    for cell in hparam_cells("start.hparam.", state.optimizers):
        out[cell.site] = decode(cell.lanes, cell.encoding)
    return out


def _init_group_from_env() -> bool:
    """Create the default process group from torchrun's environment (``WORLD_SIZE`` > 1) when none exists;
    ``True`` when this call created it (and the run must destroy it)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    import torch

    available = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if available and local < torch.cuda.device_count():
        # The rank's device under torchrun, without creating a CUDA context: torch applies it when this process
        # first initialises CUDA, and a CPU-only job on a GPU host never does.
        if torch.cuda.is_initialized():
            torch.cuda.set_device(local)
        else:
            torch.cuda._lazy_call(lambda: torch.cuda.set_device(local))
    # The device the job trains on is not known here: gloo for host tensors, NCCL for CUDA ones (it connects at
    # the first CUDA collective, so a CPU model never uses it).
    dist.init_process_group(_group_backend(None, available))
    return True


def _production_config(options: Any, target: str, picked: Any) -> RunConfig:
    """A production job's run, resuming from ``picked`` (``None``: from step 0): saves after its step, a trace
    segment of its own."""
    from ckptverify.production.mode import segment_dir

    resume_from, start = (picked.path, picked.step) if picked is not None else (None, 0)
    every = options.save_every
    return RunConfig(
        name="production", stop_step=options.steps, checkpoint_dir=options.run_dir, resume_from=resume_from,
        save_at=tuple(range(start + every, options.steps + 1, every)) if every else (),
        trace_dir=segment_dir(options.run_dir, start), level=options.trace, workload=target,
        trace_every=options.trace_every)


def _resume_point(options: Any, *, rank: int, world: int) -> Any:
    """The checkpoint a production job resumes from (a :class:`~ckptverify.runs.latest.Latest`, the same on
    every rank), or ``None`` for a start from step 0, as ``options.resume`` allows; raises
    :class:`~ckptverify.production.mode.ResumeRefusedError` on every rank when it refuses. See
    :func:`ckptverify.production.mode.resume_point`."""
    from ckptverify.production.mode import resume_point

    return resume_point(options, rank=rank, world=world)


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for a training function that may run under the harness.

    The harness owns the process group when it runs several ranks (it creates it before ``train(run)`` and
    destroys it after) and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    even on one rank. This creates the group only when none exists, so the same script runs plainly, under
    ``torchrun`` and under the harness.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(backend, **kwargs)


def unsaved_schedulers(state: Any) -> list[str]:
    """Optimizers of ``state`` driven by an LR scheduler that ``state`` does not hold.

    torch's LR schedulers wrap their optimizer's ``step`` (marking it ``_wrapped_by_lr_sched``); a scheduler
    that wraps a registered optimizer but is not registered itself will not be saved.
    """
    if state.schedulers:
        return []
    return [f"optimizer {i} ({type(opt).__name__})" for i, opt in enumerate(state.optimizers)
            if hasattr(getattr(opt, "step", None), "_wrapped_by_lr_sched")]


def _count(start: int) -> Iterator[int]:
    n = start
    while True:
        yield n
        n += 1


def _group_backend(device: str | None, cuda_available: bool) -> str:
    """The ``torch.distributed`` backend for ranks launched for ``device`` (``RunConfig.device``, ``Plan.device``).

    ``"cpu"``: gloo, even on a GPU host (NCCL cannot carry CPU tensors). ``"cuda"``: NCCL for CUDA tensors and
    gloo beside it for what the harness and the checks exchange in host memory. ``None`` (not said, e.g. a
    torchrun job): both where CUDA is available, gloo otherwise. Raises
    :class:`~ckptverify.errors.UsageError` for ``"cuda"`` without CUDA, or an unknown device.
    """
    if device == "cpu" or (device is None and not cuda_available):
        return "gloo"
    if device not in ("cuda", None):
        raise UsageError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not cuda_available:
        raise UsageError("device 'cuda': no CUDA device is visible to this process")
    return "cpu:gloo,cuda:nccl"
