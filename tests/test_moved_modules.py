"""Modules of the previous layout stay importable by their old names for one release, with a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ckptverify
from ckptverify.errors import CkptVerifyDeprecationWarning


@pytest.mark.parametrize(("old", "new"), sorted(ckptverify._MOVED_MODULES.items()))
def test_an_old_module_name_is_its_new_module_with_a_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(CkptVerifyDeprecationWarning, match=rf"{old} is now {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert old not in {m.name for m in __import__("pkgutil").walk_packages(ckptverify.__path__, "ckptverify.")}


def test_an_old_name_in_a_from_import_reaches_the_same_objects() -> None:
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from ckptverify.runs.background import BackgroundVerifier\n"
            "except DeprecationWarning as exc:\n    print('warned', exc)\n"
            "warnings.simplefilter('ignore')\n"
            "from ckptverify.runs.background import BackgroundVerifier\n"
            "from ckptverify.verifier.background import BackgroundVerifier as New\n"
            "print(BackgroundVerifier is New)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["warned the module ckptverify.runs.background is now ckptverify.verifier.background; "
                                "its old name will be removed in the next release", "True"]


def test_a_name_that_never_existed_is_still_an_import_error() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ckptverify.no_such_module")
