"""The ``Run`` protocol: five lines that make a training function resumable, traceable and checkable.

```python
def train(run: cv.Run) -> None:
    state = cv.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    run.restore(state)                           # resumes here under the harness; no-op on a fresh start
    for batch in run.steps(loader):              # yields until the stop step
        run.record(loss=loss, batch=batch)       # end of step: trace; saves when asked
```

The same function runs under ``python`` (``cv.Run.main``), ``torchrun`` and the harness. Trap: the harness's plan
reaches each rank as a :class:`RunConfig` (:func:`harness_job`), never through the environment, so nothing leaks into
processes the training function starts."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptverify.errors import CkptVerifyWarning, ResumeRefusedError, UsageError
from ckptverify.options import VerifyOptions, verify_options
from ckptverify.ownfiles.names import own_folder, write_atomic
from ckptverify.state.distributed import rank_world

#: ``ckptverify.trace.store.LEVELS``, repeated so importing Run does not import trace (a test keeps them equal).
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
    #: Record steps with ``step % trace_every == 0``.
    trace_every: int = 1
    trace_detail: str = "category"
    #: ``Plan.device`` set by our launcher; ``None`` for a plain or production run.
    device: str | None = None
    #: At level ``op``: ``asdict`` of an :class:`~ckptverify.trace.oplog.OpWindow`; ``None``: everything.
    op_window: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise UsageError(f"trace level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.op_window is not None:
            from ckptverify.trace.oplog import window_from_dict

            window_from_dict(self.op_window)  # refused here, before any rank starts
        if self.trace_every < 1:
            raise UsageError(f"trace_every must be at least 1, got {self.trace_every}")


def checkpoint_path(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step_{step}")


def rank_files(trace_dir: str | None, kind: str, ext: str = ".json") -> dict[int, Any]:
    """Each rank's ``<kind>-rank<r><ext>`` beside a run's trace (``notes``, ``restore``, ``held``; ``.txt``: the
    ``usage``/``error`` text a failed rank left), JSON parsed, in rank order; ``{}`` without the folder."""
    out: dict[int, Any] = {}
    prefix = f"{kind}-rank"
    for name in os.listdir(trace_dir) if trace_dir and os.path.isdir(trace_dir) else ():
        rank = name[len(prefix):-len(ext)]
        if name.startswith(prefix) and name.endswith(ext) and rank.isdigit():
            with open(os.path.join(trace_dir, name)) as f:  # type: ignore[arg-type]
                out[int(rank)] = json.load(f) if ext == ".json" else f.read()
    return dict(sorted(out.items()))


_harness_config: RunConfig | None = None


@contextlib.contextmanager
def harness_job(config: RunConfig) -> Iterator[None]:
    """Within the block, ``Run.main`` runs the harness job ``config``. A process argument, not an
    environment variable, so a process the training function starts does not inherit it."""
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
        self._step = 0
        self._restored_from: str | None = None
        self._saved: list[str] = []
        self._recorder: Any = None
        self._production: Any = None
        self._picked: Any = None
        self._owns_group = False
        self._rank, self._world = rank_world(env_fallback=True)
        #: The frame of the function that called ``restore`` (under the harness), until ``close``.
        self._held_frame: Any = None
        #: Until the first ``record``: that frame and its bindings of registered objects (to spot rebuilds).
        self._bindings: Any = None
        self._notes: dict[str, Any] = {}
        self._pending = False  # a step yielded and not yet recorded
        self._sampler: Any = None

    @classmethod
    def main(cls, train: Callable[[Run], None], *, steps: int | None = None, run_dir: str | None = None,
             save_every: int | None = None, trace: str = "metrics", trace_every: int = 1,
             on_replica_mismatch: str = "warn", fault: str | None = None,
             verify: VerifyOptions | str = "background", resume: str = "auto") -> None:
        """Run ``train`` once: as the harness asks (if it launched this process), as a production job (with ``run_dir``,
        see :mod:`ckptverify.production.mode`), or plainly for ``steps`` steps.

        Production: saves every ``save_every`` steps to ``run_dir/step_N``, traces at ``trace`` every
        ``trace_every``, compares replicas (``on_replica_mismatch``), plants ``fault`` (a BitFlip as JSON), and
        verifies each save per ``verify`` (:mod:`ckptverify.options`; ``background`` so no save stalls),
        waiting for pending verifications at the end. Creates the process group from torchrun's environment if none
        exists. ``resume``: ``auto`` (newest verifying checkpoint; refused if some exist and none verifies),
        ``required`` or ``never``; failing checkpoints are moved aside, never overwritten. A refusal prints why and
        raises ``SystemExit(2)`` before ``train`` runs, having changed nothing."""
        verifying = verify_options("Run.main", verify)
        if _harness_config is not None or run_dir is None:
            run = cls(_harness_config or RunConfig(stop_step=steps))
        else:
            from ckptverify.production.mode import ProductionOptions, target_of

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
        from ckptverify.production.mode import Production, resume_point

        owns = _init_group_from_env()
        rank, world = rank_world(env_fallback=True)
        try:
            picked = resume_point(options, rank=rank, world=world)
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

    @property
    def step(self) -> int:
        """Steps completed so far (restored from the checkpoint when resuming)."""
        return self._step

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> str | None:
        """The device ``resume-check``/``replay --device`` launched this rank for; ``None`` otherwise."""
        return self.config.device

    @property
    def total_steps(self) -> int:
        """The job's length (``Run.main(steps=)``, the production job's, or the harness's ``--steps``), the same in
        every run of one resume check, for schedules such as ``OneCycleLR``. :class:`UsageError` without a count."""
        total = self.config.total_steps if self.config.total_steps is not None else self.config.stop_step
        if total is None:
            raise UsageError("this run has no step count: give Run.main(train, steps=N) (or --steps to the harness)")
        return total

    def restore(self, state: Any) -> None:
        """Register the training state; when resuming, load it (verified, then checked) from the checkpoint. Under
        the harness it also notes stateful locals of the caller held outside ``state``
        (:mod:`ckptverify.resume.unregistered`) and the restored streams and hyperparameters; ``close`` fingerprints
        what the caller then holds outside ``state``, so runs can be compared on it."""
        from ckptverify.state.train_state import TrainState

        if not isinstance(state, TrainState):
            raise UsageError(f"run.restore() takes a TrainState, got {type(state).__name__}")
        self.state = state
        notes: dict[str, Any] = {"unsaved_schedulers": unsaved_schedulers(state)}
        if state.dataloader is not None:
            from torch.utils.data import IterableDataset

            notes["loader"] = {"type": type(state.dataloader).__name__, "iterable": isinstance(
                getattr(state.dataloader, "dataset", None), IterableDataset)}
        from ckptverify.resume.unregistered import find_unregistered, missing_optimizer, registered_bindings

        caller = sys._getframe(1)
        self._bindings = (caller, registered_bindings(caller.f_locals, state))
        if self.config.trace_dir:
            notes["unregistered"] = find_unregistered(caller.f_locals, state)
            if self._production is None:
                # A frame keeps its locals after return: read at close (``held-rank<r>.json``).
                self._held_frame = caller
            del caller
            notes["missing_optimizer"] = missing_optimizer(state)
        if self.config.resume_from:
            from ckptverify.checkpoint.load import load

            # The harness diagnoses a restore mismatch rather than refusing it; production verified its pick.
            if self._picked is None:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="the restore check of ", category=UserWarning)
                    report = load(state, self.config.resume_from, on_restore_mismatch="warn")
            else:
                try:
                    # Never trains on damaged state: a failing pick is moved aside and an older one loaded.
                    report, picked = self._production.restore(state, self._picked)
                except ResumeRefusedError:
                    raise SystemExit(2) from None
                if picked is not self._picked:  # fell back: start, saves and trace segment follow the pick
                    self._picked = picked
                    self.config = _production_config(self._production.options, self.config.workload, picked)
            self._restored_from = self.config.resume_from
            self._write_json(f"restore-rank{self._rank}.json", report.to_dict())
            notes["restored"] = _start_values(state)
        self._step = state.counters.step
        self._notes = notes
        self._write_json(f"notes-rank{self._rank}.json", self._notes)
        if self._production is not None:
            # Before the trace hooks: a planted fault must precede the trace's view, as a real one would.
            self._production.began(state, self._restored_from)
        if self.config.trace_dir and self._recorder is None:
            from ckptverify.trace import TraceHeader, TraceRecorder
            from ckptverify.trace.oplog import window_from_dict

            header = TraceHeader(run=self.config.name, level=self.config.level, workload=self.config.workload,
                                 detail=self.config.trace_detail)
            window = window_from_dict(self.config.op_window) if self.config.op_window is not None else None
            self._recorder = TraceRecorder(self.config.trace_dir, header=header, overwrite=True, window=window)
            if self._production is not None:
                self._production.traced_by(self._recorder)
            if self.config.level != "metrics" and state.model is not None:
                self._recorder.attach(state.model, optimizer=state.optimizers or None)

    def steps(self, loader: Iterable[Any] | None = None, *, micro_batches: int = 1) -> Iterator[Any]:
        """Yield batches from ``loader`` (or step numbers) until the stop step. ``micro_batches=K``: each item is the
        list of ``K`` batches one optimizer step uses, so steps and saves fall on optimizer-step boundaries; a loader
        ending mid-step ends the run. After resuming, random streams are put back once the loader's iterator exists
        (creating it draws a base seed)."""
        from ckptverify.state.dataloader import find_resumable_sampler

        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise UsageError(f"run.steps(micro_batches=...) takes a whole number of at least 1, got {micro_batches!r}")
        if micro_batches > 1 and loader is None:
            raise UsageError("run.steps(micro_batches=...) needs the loader whose batches it groups: "
                             "run.steps(loader, micro_batches=K)")
        stop = self.config.stop_step
        registered = self.state.dataloader if self.state is not None else None
        own = find_resumable_sampler(loader) if loader is not None else None
        # The sampler behind ``data.indices``: the iterated loader's, else the registered one's.
        self._sampler = own if own is not None or registered is None else find_resumable_sampler(registered)
        if loader is None:
            it: Iterator[Any] = itertools.count(self._step + 1)
        else:
            from ckptverify.state.rng import capture_rng, restore_rng

            # Creating the iterator draws a base seed; the uninterrupted run drew it before the checkpoint, so
            # a resumed run (restored from, with the state) must not draw it again.
            before = capture_rng(self.state.rng.generators) if self._restored_from is not None else None
            it = _epochs(loader, own, self.state)
            if before is not None:
                restore_rng(before, self.state.rng.generators)
        self._pending = False
        while stop is None or self._step < stop:
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
                if (self._step + 1) % self.config.trace_every == 0:
                    # Before the step draws anything: a random stream that differs here is a cause.
                    self._recorder.record_step_start(self.state, step=self._step + 1)
                else:
                    self._recorder.begin_skipped_step()
            yield item

    def record(self, *, loss: Any = None, batch: Any = None, **metrics: Any) -> None:
        """End of a step: record the trace row, advance the step counter, save if this step is planned."""
        if not self._pending:
            raise UsageError("run.record() must be called once per step yielded by run.steps()")
        self._pending = False
        if self._bindings is not None:
            from ckptverify.resume.unregistered import replaced_objects

            # After the first step: warn about, and note for the harness, registered objects rebuilt after
            # ``run.restore`` (the loop steps the new one; checkpoints hold the old one).
            (frame, bindings), self._bindings = self._bindings, None
            try:
                replaced = replaced_objects(bindings, frame.f_locals, self.state)
            finally:
                del frame
            for r in replaced:
                warnings.warn(f"ckptverify: {r['name']} ({r['type']}) was rebuilt after run.restore(): the "
                              f"TrainState saves and restores the {r['registered_type']} it was given as {r['field']}, "
                              "not the one the loop uses; build it before run.restore(state), or register the new one",
                              CkptVerifyWarning, stacklevel=2)
            if replaced:
                self._notes["replaced"] = [{**r, "step": self._step + 1} for r in replaced]
                self._write_json(f"notes-rank{self._rank}.json", self._notes)
        self._step += 1
        if self.state is not None:
            self.state.counters.step = self._step
        values = {**metrics, "loss": loss} if loss is not None else dict(metrics)
        traced = self._step % self.config.trace_every == 0
        if self._recorder is not None:
            if traced:
                # ``[epoch, indices]`` of the last batch the tracked ``ResumableSampler`` handed out.
                last = self._sampler.last_batch() if self._sampler is not None else None
                self._recorder.record_step(self._step, metrics=values, batch=batch,
                                           state=self.state if self.config.level != "metrics" else None,
                                           batch_indices=None if last is None else [last[0], last[1]])
            else:
                self._recorder.skip_step()
        if self._production is not None:
            self._production.stepped(self._step, traced=traced)
        if self._step in self.config.save_at:
            self._save()

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        frame, self._held_frame = self._held_frame, None
        if frame is not None:
            from ckptverify.resume.unregistered import held_state

            # Fingerprints of what the ``restore`` caller holds outside the ``TrainState`` at the end. A failure is
            # written there, never raised: the run itself succeeded.
            try:
                data = held_state(frame.f_locals, self.state)
            except Exception as exc:
                data = {"error": f"{type(exc).__name__}: {exc}"}
            del frame  # its locals (model, loader, workers) go as the function's own would
            self._write_json(f"held-rank{self._rank}.json", data)
        if self.config.trace_dir and self._rank == 0:
            self._write_json("run.json", {"name": self.config.name, "steps": self._step,
                                          "saved": self._saved, "world_size": self._world})
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # no rank tears down while another is still in a collective
                dist.destroy_process_group()
            self._owns_group = False
        if self._production is not None:
            # After the group is gone: rank 0 may wait for verifications longer than a collective would.
            self._production.close(self._step)
            self._production = None

    def _save(self) -> None:
        from ckptverify.checkpoint.save import save

        if self.state is None:
            raise UsageError("the harness asked for a checkpoint but run.restore(state) was never called")
        assert self.config.checkpoint_dir is not None
        if self._world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise UsageError(f"the harness runs {self._world} ranks, but the process group was destroyed before "
                                 f"the checkpoint of step {self._step}: leave destroy_process_group() to the "
                                 "harness (or call it only after the last run.record)")
        path = checkpoint_path(self.config.checkpoint_dir, self._step)
        if self.state.model is not None and self.config.trace_dir:
            from ckptverify.state.train_state import pending_gradients

            # `save` warns about them; the harness is told too, to name them as the cause of a divergence.
            names, count = pending_gradients(self.state.model)
            if count:
                self._notes.setdefault("pending_gradients", []).append(
                    {"step": self._step, "count": count, "names": names})
                self._write_json(f"notes-rank{self._rank}.json", self._notes)
        if self._recorder is not None:
            self._recorder.flush()
        if self._production is not None:
            self._production.before_save(self._step, path)  # never over a checkpoint; notes a suspect one
        save(self.state, path, **(self._production.save_options() if self._production is not None else {}))
        self._saved.append(path)
        if self._production is not None:
            self._production.saved(self._step, path)

    def _write_json(self, name: str, data: Any) -> None:
        if not self.config.trace_dir:
            return
        trace_dir = own_folder(self.config.trace_dir)  # never through a link at its name
        write_atomic(os.path.join(trace_dir, name), json.dumps(data, indent=1, default=str),
                     prefix=f".{name}.", durable=False)


_END = object()


def _epochs(loader: Iterable[Any], sampler: Any, state: Any) -> Iterator[Any]:
    """Batches over epochs, the first epoch's iterator made now (drawing the base seed), each later one when the
    previous epoch ends, after ``sampler`` (the loader's ``ResumableSampler``, if any) and the epoch counter
    advance; a plain loader makes one pass."""
    stateful = type(loader).__name__.startswith("Stateful")

    def epoch() -> Iterator[Any]:
        inner = iter(loader)  # draws the base seed now
        return inner if sampler is None or stateful else \
            sampler.track(inner, batch_size=getattr(loader, "batch_size", None))

    def batches(first: Iterator[Any]) -> Iterator[Any]:
        yield from first
        while sampler is not None:
            sampler.set_epoch(sampler.epoch + 1)
            if state is not None:
                state.counters.epoch = sampler.epoch
            yield from epoch()

    return batches(epoch())


def _start_values(state: Any) -> dict[str, Any]:
    """The step-start sites as ``state`` holds them now, decoded as a trace reads them."""
    from ckptverify.state.digest import state_digest
    from ckptverify.state.rng import capture_rng
    from ckptverify.trace.hyperparams import hparam_cells
    from ckptverify.trace.store import decode

    out: dict[str, Any] = {f"start.rng.{kind}": state_digest(value)
                           for kind, value in capture_rng(state.rng.generators).items()
                           if kind != "cuda_device"}  # which device, not a stream: the trace has no such site
    return out | {c.site: decode(c.lanes, c.encoding) for c in hparam_cells("start.hparam.", state.optimizers)}


def _init_group_from_env() -> bool:
    """Create the default group from torchrun's environment (``WORLD_SIZE`` > 1) if none exists; ``True`` when
    created here (the run must destroy it)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    import torch

    available = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if available and local < torch.cuda.device_count():
        # Lazily (at once if CUDA is initialised), so a CPU-only job on a GPU host never creates a CUDA context.
        torch.cuda._lazy_call(lambda: torch.cuda.set_device(local))
    # Training device unknown here: NCCL connects only at the first CUDA collective, so a CPU model never uses it.
    dist.init_process_group(_group_backend(None, available))
    return True


def _production_config(options: Any, target: str, picked: Any) -> RunConfig:
    """A production job's run resuming from ``picked`` (``None``: step 0), with its own trace segment."""
    from ckptverify.production.mode import segment_dir

    resume_from, start = (picked.path, picked.step) if picked is not None else (None, 0)
    every = options.save_every
    return RunConfig(
        name="production", stop_step=options.steps, checkpoint_dir=options.run_dir, resume_from=resume_from,
        save_at=tuple(range(start + every, options.steps + 1, every)) if every else (),
        trace_dir=segment_dir(options.run_dir, start), level=options.trace, workload=target,
        trace_every=options.trace_every)


def unsaved_schedulers(state: Any) -> list[str]:
    """Optimizers of ``state`` wrapped by an LR scheduler (``_wrapped_by_lr_sched``) that ``state`` does not hold, so
    it will not be saved."""
    if state.schedulers:
        return []
    return [f"optimizer {i} ({type(opt).__name__})" for i, opt in enumerate(state.optimizers)
            if hasattr(getattr(opt, "step", None), "_wrapped_by_lr_sched")]


def _group_backend(device: str | None, cuda_available: bool) -> str:
    """Backend for ranks launched for ``device``: ``cpu`` gloo (NCCL cannot carry CPU tensors); ``cuda`` NCCL plus
    gloo for host exchanges; ``None`` both with CUDA, else gloo. :class:`UsageError` for ``cuda`` without CUDA or an
    unknown device."""
    if device == "cpu" or (device is None and not cuda_available):
        return "gloo"
    if device not in ("cuda", None):
        raise UsageError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not cuda_available:
        raise UsageError("device 'cuda': no CUDA device is visible to this process")
    return "cpu:gloo,cuda:nccl"
