"""The result of verifying one saved checkpoint (:class:`Verification`): the one type every verifier path produces
and consumes, and the fields of the ``checkpoint-*`` events (``docs/json-schema.md``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ckptverify.ownfiles import events
from ckptverify.runs.stamp import stamp_path

if TYPE_CHECKING:
    from ckptverify.findings import Report

__all__ = ["MAX_ERRORS", "NO_VERDICT", "VERDICTS", "Verification", "event_of", "from_report", "from_stamp",
           "unverified"]

#: What a verification concluded: ``passed``, ``failed``, or ``unverified`` (no verdict).
VERDICTS = ("passed", "failed", "unverified")
#: Why there is no verdict: queued (``pending``), removed (``deleted``), files changed while read (``changed``),
#: lock held elsewhere (``busy``), unreadable or stopped (``error``), no longer waited for (``cut-short``).
NO_VERDICT = ("pending", "deleted", "changed", "busy", "error", "cut-short")
#: Errors a verification carries (the first few suffice; the report has all).
MAX_ERRORS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Verification:
    """The result of verifying one saved checkpoint.

    ``verdict``: ``passed`` or ``failed`` (stamped unless ``stamped`` is false, ``reason`` saying why; the verdict
    stands; an unverifiable checkpoint such as a remote one is ``failed``, unstamped), or ``unverified``
    (``no_verdict`` says why in a word, ``reason`` in a sentence; nothing stamped). ``summary``: findings per
    severity; ``first_error``/``errors``: the first errors; ``bytes_checked``, ``coverage``, ``manifest``,
    ``unchecked``, ``warnings``: what was checked; ``throttled_s``: seconds of ``seconds`` spent waiting for an idle
    core; ``stamp``: its path; ``message``: one line (:meth:`describe`); ``report``: the full report, never serialized.
    """

    path: str
    step: int | None
    verdict: str
    summary: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    seconds: float = 0.0
    bytes_checked: int = 0
    deep: bool = False
    stamped: bool = False
    reason: str | None = None
    throttled_s: float = 0.0
    no_verdict: str | None = None
    errors: tuple[dict[str, Any], ...] = ()
    coverage: tuple[dict[str, Any], ...] = ()
    manifest: bool = False
    unchecked: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    stamp: str | None = None
    message: str | None = None
    report: Report | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {self.verdict!r}")
        if self.no_verdict is not None and self.no_verdict not in NO_VERDICT:
            raise ValueError(f"no_verdict must be one of {', '.join(NO_VERDICT)}, got {self.no_verdict!r}")
        if self.verdict == "unverified" and self.no_verdict is None:
            object.__setattr__(self, "no_verdict", "error")
        if self.message is None:
            object.__setattr__(self, "message", self._default_message())

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    @property
    def pending(self) -> bool:
        """Queued for the background verifier, no verdict yet (``passed`` is ``False``: nothing was checked)."""
        return self.no_verdict == "pending"

    @property
    def deleted(self) -> bool:
        """Removed (by retention, most likely) before its verification finished: no verdict, and no failure."""
        return self.no_verdict == "deleted"

    def to_dict(self) -> dict[str, Any]:
        """Every field but ``report`` as JSON values, plus ``passed``, ``pending`` and ``deleted``."""
        data = {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else dict(v) if isinstance(v, dict)
                else v for f in fields(self) if f.name != "report"}
        return {**data, "passed": self.passed, "pending": self.pending, "deleted": self.deleted}

    @classmethod
    def from_dict(cls, data: dict[str, Any], report: Report | None = None) -> Verification:
        """The :class:`Verification` :meth:`to_dict` gave (unknown keys ignored); ``TypeError`` if ``data`` is not one.
        """
        if not isinstance(data, dict):
            raise TypeError(f"not a verification: {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"report"}
        values = {k: v for k, v in data.items() if k in known}
        for name in ("verdict", "path"):
            if name not in values:
                raise TypeError(f"not a verification: no {name}")
        for name in ("errors", "coverage", "unchecked", "warnings"):
            if name in values:
                values[name] = tuple(values[name] or ())
        values.setdefault("step", None)
        try:
            return cls(**values, report=report)
        except ValueError as exc:
            raise TypeError(f"not a verification: {exc}") from None

    def describe(self) -> str:
        """One line for people: what was verified and the verdict (:attr:`message`)."""
        return self.message or self._default_message()

    def _default_message(self) -> str:
        where = f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")
        if self.verdict == "passed":
            return f"{where} passed verification ({self.bytes_checked} bytes checked in {self.seconds:.2f} s)"
        if self.verdict == "failed":
            return (f"{where} failed verification after it was saved: {self.summary.get('error', 0)} error(s); "
                    f"first: {self.first_error}" + ("" if self.stamped else f" ({self.reason})"))
        return f"{where} was not verified: {self.reason}"


def event_of(result: Verification) -> str:
    """The ``events.jsonl`` event name recording ``result`` (:data:`~ckptverify.ownfiles.events.VERIFICATION_EVENTS`).
    """
    if result.verdict == "passed":
        return events.CHECKPOINT_VERIFIED
    if result.verdict == "failed":
        return events.CHECKPOINT_FAILED
    return {"deleted": events.CHECKPOINT_DELETED, "cut-short": events.CHECKPOINT_CUT_SHORT}.get(
        result.no_verdict or "", events.CHECKPOINT_UNVERIFIED)


def from_report(path: str, step: int | None, report: Report, *, seconds: float, stamped: bool,
                stamp: str | None = None, reason: str | None = None, throttled_s: float = 0.0,
                message: str | None = None) -> Verification:
    """The :class:`Verification` of a verification that reached a verdict (``report``)."""
    from ckptverify.checks.dcp_pipeline import UNCHECKABLE

    errors = report.errors
    first = errors[0] if errors else None
    return Verification(
        path=path, step=step, verdict="passed" if report.passed else "failed", summary=report.summary(),
        first_error=None if first is None else f"{first.check}: {first.message}",
        seconds=round(seconds, 6), bytes_checked=int(report.stats.get("bytes") or 0),
        deep=bool(report.stats.get("deep")), stamped=stamped, reason=reason, throttled_s=throttled_s,
        errors=tuple(f.to_dict() for f in errors[:MAX_ERRORS]),
        coverage=tuple(c.to_dict() for c in report.coverage), manifest=bool(report.stats.get("manifest")),
        unchecked=tuple(sorted({f.location.file or "?" for f in report.findings if f.check == UNCHECKABLE})),
        warnings=tuple(sorted({f.check for f in report.warnings if f.check != UNCHECKABLE})),
        stamp=stamp, message=message, report=report)


def unverified(path: str, step: int | None, no_verdict: str, reason: str, *, deep: bool = False,
               seconds: float = 0.0, message: str | None = None) -> Verification:
    """A :class:`Verification` without a verdict: ``no_verdict`` (one of :data:`NO_VERDICT`) says why."""
    return Verification(path=path, step=step, verdict="unverified", no_verdict=no_verdict, reason=reason,
                        deep=deep, seconds=round(seconds, 6), message=message)


def from_stamp(path: str, step: int | None, data: dict[str, Any]) -> Verification:
    """The :class:`Verification` a current stamp records (someone else verified the checkpoint)."""
    errors = [e for e in (data.get("errors") or []) if isinstance(e, dict)]
    first = errors[0] if errors else None
    return Verification(
        path=path, step=step, verdict="passed" if data.get("passed") else "failed",
        summary=dict(data.get("summary") or {}),
        first_error=None if first is None else f"{first.get('check')}: {first.get('message')}",
        seconds=_seconds(data.get("seconds")), bytes_checked=_count(data.get("bytes_checked")),
        deep=bool(data.get("deep")), stamped=True, throttled_s=_seconds(data.get("throttled_s")),
        errors=tuple(errors[:MAX_ERRORS]),
        coverage=tuple(c for c in (data.get("coverage") or []) if isinstance(c, dict)),
        manifest=bool(data.get("manifest")), stamp=stamp_path(path))


def _seconds(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _count(value: object) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0
