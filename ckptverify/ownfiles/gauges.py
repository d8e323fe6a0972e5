"""The Prometheus text exposition format and the atomic write of a gauges file, knowing nothing of what gauges
mean (used by ``watch`` and ``--metrics-file``); below the core so the core never imports ``render/``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ckptverify.ownfiles.names import METRICS_TEMP_PREFIX, write_atomic

__all__ = ["format_value", "render_gauges", "write_gauges"]


def format_value(value: float | int | bool) -> str:
    """A sample value for the text format: integers exactly, floats by ``repr`` (round-trip). Every gauge is a count,
    a step, a size or a time: never NaN or infinite."""
    if isinstance(value, int):  # bool included: 1 or 0
        return str(int(value))
    value = float(value)
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def _label(value: str) -> str:
    # Non-UTF-8 path bytes (lone surrogates) are written as \xNN: the format is UTF-8.
    text = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_gauges(command: str, target: str, values: Mapping[str, float | int | bool],
                  help_texts: Mapping[str, str]) -> str:
    """``values`` as ``ckptverify_NAME{command=...,target=...}`` gauges with ``# HELP`` and ``# TYPE`` lines."""
    labels = f'command="{_label(command)}",target="{_label(target)}"'
    lines = []
    for name, value in values.items():
        metric = f"ckptverify_{name}"
        lines += [f"# HELP {metric} {help_texts[name]}", f"# TYPE {metric} gauge",
                  f"{metric}{{{labels}}} {format_value(value)}"]
    return "\n".join(lines) + "\n"


def write_gauges(path: str | os.PathLike[str], text: str) -> None:
    """Write rendered gauges to ``path`` atomically; only a regular file is replaced (else ``NotRegularFileError``)."""
    write_atomic(path, text.encode("utf-8"), prefix=METRICS_TEMP_PREFIX, durable=False)
