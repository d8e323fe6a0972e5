"""The digest of a non-tensor state field: subclasses of built-in types digest as their values, opaque objects as
their type, and a state nested past the recursion limit is refused."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest

from ckptverify.errors import UsageError
from ckptverify.state.digest import state_digest


class _Name(str):
    def __str__(self) -> str:
        return "something else"


class _Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def test_subclasses_of_builtins_digest_as_their_values() -> None:
    pair = namedtuple("pair", "a b")
    assert state_digest(pair(1, "x")) == state_digest([1, "x"]) == state_digest((1, "x"))
    assert state_digest(_Name("lr")) == state_digest("lr")  # the characters, not what __str__ says
    assert state_digest(OrderedDict(b=2, a=1)) == state_digest({"a": 1, "b": 2})


def test_an_opaque_object_digests_as_its_type() -> None:
    assert state_digest(_Opaque(1)) == state_digest(_Opaque(2)) != state_digest(object())


def test_a_state_nested_too_deeply_is_refused() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UsageError, match="nested too deeply"):
        state_digest(deep)
