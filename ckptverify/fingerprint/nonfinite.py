"""NaN and Inf counts of a tensor: one definition (:func:`nonfinite_counts`) for every path that keeps them (save,
``fingerprint``, deep check), so a tensor gets the same counts whichever path read it. Counted only for
:data:`COUNTED_DTYPES`; otherwise ``None`` (not zero). No torch import."""

from __future__ import annotations

from typing import Any

__all__ = ["COUNTED_DTYPES", "NO_INFINITY_DTYPES", "counts_kept", "nonfinite_counts"]

#: Floating formats with no encoding for an infinity (an Inf converts to NaN): every non-finite value is a NaN.
NO_INFINITY_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})
#: Dtypes whose NaN/Inf counts are kept (not packed float4: no such encoding, and torch tests none).
COUNTED_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                            "float8_e5m2"}) | NO_INFINITY_DTYPES


def counts_kept(dtype: str) -> bool:
    """Whether tensors of ``dtype`` (a manifest's dtype name, e.g. ``"bfloat16"``) have NaN/Inf counts."""
    return dtype in COUNTED_DTYPES


def nonfinite_counts(t: Any) -> tuple[int | None, int | None]:
    """``(NaN count, Inf count)`` of ``t``; ``(None, None)`` for a dtype not counted or not testable element-wise. A
    finite sum proves no NaN/Inf; only a non-finite sum (or an unsummable format) pays for the element-wise count.
    A complex element is NaN if either part is, else Inf if either part is."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in COUNTED_DTYPES:
        return None, None
    try:
        if t.dtype in (torch.float32, torch.float64) or t.dtype.is_complex:
            total = t.sum()
        else:
            total = t.sum(dtype=torch.float32)
        if bool(torch.isfinite(total).all()):
            return 0, 0
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # no sum for this format: count element by element
    try:
        nan = int(torch.isnan(t).sum())
        if name in NO_INFINITY_DTYPES:
            # torch's isinf/isfinite of these either is not implemented or calls their NaN finite.
            return nan, 0
        return nan, t.numel() - int(torch.isfinite(t).sum()) - nan
    except (RuntimeError, NotImplementedError, TypeError):
        return None, None
