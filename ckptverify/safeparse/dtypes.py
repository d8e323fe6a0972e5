"""The torch dtypes a checkpoint may name, the bytes per element of each, and the element layout of a view.

Readers accept ``torch.<dtype>`` globals only for these names and size storages by them.
"""

from __future__ import annotations

__all__ = ["DTYPE_ITEMSIZE", "contiguous_strides", "is_row_major", "view_extent"]

#: Bytes per element for every dtype torch can save, by the name torch gives the dtype.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "bool": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}  # fmt: skip


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) that lay ``shape`` out row after row."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``stride`` lays ``shape`` out row after row (a dimension of size 1 may have any stride)."""
    return len(shape) == len(stride) and all(
        s == e or n == 1 for s, e, n in zip(stride, contiguous_strides(shape), shape, strict=True))


def view_extent(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements of its storage a view reaches, from the storage's start (0 when the view is empty)."""
    if any(n == 0 for n in shape):
        return 0
    return offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1
