"""NaN and Inf counts of a tensor: one definition for every path that keeps them.

A save's manifest (:mod:`ckptverify.dcp.writer`), the manifest ``fingerprint`` writes for a checkpoint already on
disk (:mod:`ckptverify.audit.adopt`, :mod:`ckptverify.checks.described`) and the deep check's ``nonfinite``
warning (:mod:`ckptverify.checks.deep`) all count with :func:`nonfinite_counts`, so the same tensor has the same
counts whichever path read it. Counts are kept for the dtypes named in :data:`COUNTED_DTYPES` (floating formats,
float8 ones included, and complex ones); for any other dtype they are ``None`` (not zero: nothing was counted).
Importing this module imports no torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COUNTED_DTYPES", "NO_INFINITY_DTYPES", "counts_kept", "nonfinite_counts"]

#: Floating formats with no encoding for an infinity (an Inf converts to NaN): every non-finite value is a NaN.
NO_INFINITY_DTYPES = frozenset({"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"})
#: Dtypes (by the name a manifest gives them) whose NaN and Inf counts are kept. Packed float4 has no NaN or Inf
#: encoding and torch tests none of its elements: it is not counted.
COUNTED_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                            "float8_e5m2"}) | NO_INFINITY_DTYPES


def counts_kept(dtype: str) -> bool:
    """Whether tensors of ``dtype`` (a manifest's dtype name, e.g. ``"bfloat16"``) have NaN/Inf counts."""
    return dtype in COUNTED_DTYPES


def nonfinite_counts(t: Any) -> tuple[int | None, int | None]:
    """``(NaN count, Inf count)`` of tensor ``t``; ``(None, None)`` for a dtype not in :data:`COUNTED_DTYPES`, or
    one torch cannot test element-wise.

    A sum is a fast screen: NaN and Inf propagate through it (Inf - Inf gives NaN), so a finite sum means no NaN
    and no Inf. Only a non-finite sum (a NaN, an Inf, or an overflow of finite values), or a format torch cannot
    sum (complex32), pays for the element-wise count. A complex element is a NaN if either part is, else an Inf if
    either part is.
    """
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
