"""The Prometheus text exposition format, and the atomic write of a gauges file for a textfile collector.

The file format only, with no knowledge of what the gauges mean: the watcher
(:mod:`ckptverify.verifier.watch`) writes the state of a run with it, and the command line's
``--metrics-file`` writes a report's gauges through :mod:`ckptverify.render.metrics`. It lives below the
core so that the core never imports the front ends (``render/``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from ckptverify.ownfiles.names import METRICS_TEMP_PREFIX, write_atomic

__all__ = ["format_value", "render_gauges", "write_gauges"]


def format_value(value: float | int | bool) -> str:
    """A sample value as the text format wants it: an integer exactly, any other number with every digit
    (``repr``: it reads back as the same float), ``NaN``, ``+Inf`` and ``-Inf``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def _label(value: str) -> str:
    # A path from the file system may hold bytes that are not UTF-8 (decoded as lone surrogates): the text
    # format is UTF-8, so such a byte is written as the four characters \xNN.
    text = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_gauges(command: str, target: str, values: Mapping[str, float | int | bool],
                  help_texts: Mapping[str, str]) -> str:
    """``values`` as gauges ``ckptverify_NAME{command=...,target=...}`` in the Prometheus text exposition
    format, each with its ``# HELP`` (from ``help_texts``) and ``# TYPE`` line."""
    labels = f'command="{_label(command)}",target="{_label(target)}"'
    lines = []
    for name, value in values.items():
        metric = f"ckptverify_{name}"
        lines += [f"# HELP {metric} {help_texts[name]}", f"# TYPE {metric} gauge",
                  f"{metric}{{{labels}}} {format_value(value)}"]
    return "\n".join(lines) + "\n"


def write_gauges(path: str | os.PathLike[str], text: str) -> None:
    """Write rendered gauges to ``path`` atomically; only a regular file there is replaced (``OSError``,
    :class:`~ckptverify.ownfiles.names.NotRegularFileError` for anything else)."""
    write_atomic(path, text.encode("utf-8"), prefix=METRICS_TEMP_PREFIX, durable=False)
