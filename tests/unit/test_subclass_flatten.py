"""A wrapper subclass's flatten context in canonical form: nested lists and dicts, no context, a non-dict context,
and an attribute with no canonical form."""

from __future__ import annotations

import pytest
import torch

from ckptverify.errors import UsageError
from ckptverify.fingerprint import tensor_fingerprint
from ckptverify.fingerprint.subclass import canonical, flatten
from ckptverify.trace.category import tensor_digests


class _Wrapped(torch.Tensor):
    """A minimal wrapper subclass (one inner tensor) whose flatten context is whatever it was given."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, ctx: object):
        self = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        self.inner, self.ctx = inner, ctx
        return self

    def __tensor_flatten__(self):
        return ["inner"], self.ctx

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_canonical_lists_and_string_keyed_dicts() -> None:
    assert canonical((1, [torch.float16, "a"], {"k": (None, 2.5)})) == [1, ["torch.float16", "a"], {"k": [None, 2.5]}]
    with pytest.raises(UsageError, match="no canonical form"):
        canonical({1: "int key"})


def test_flatten_takes_no_context_as_empty_and_another_kind_under_one_key() -> None:
    inner = torch.arange(3.0)
    assert flatten(_Wrapped(inner, None)).context == {}
    assert flatten(_Wrapped(inner, ("block", 32))).context == {"context": ["block", 32]}
    assert flatten(_Wrapped(inner, {"scale": None, "n": 2})).context == {"n": 2}  # None left out
    assert flatten(_Wrapped(inner, None)).parts[0][0] == "inner"


class _Opaque:
    """An attribute of a kind the canonical form does not know."""


def test_an_attribute_without_canonical_form_refuses_the_fingerprint_not_the_trace() -> None:
    a = _Wrapped(torch.arange(4.0), {"extra": _Opaque()})
    b = _Wrapped(torch.arange(4.0) + 1, {"extra": _Opaque()})
    with pytest.raises(UsageError, match="no canonical form"):
        tensor_fingerprint(a)
    da, db, da2 = tensor_digests([a, b, _Wrapped(torch.arange(4.0), {"extra": _Opaque()})])
    assert da == da2 and da != db  # its parts are still covered
