"""The package surface: lazy exports, light imports, the command line's help."""

from __future__ import annotations

import subprocess
import sys

import ckptverify


def test_every_export_resolves():
    for name in ckptverify.__all__:
        assert getattr(ckptverify, name) is not None, name


def test_importing_the_package_and_the_cli_does_not_import_torch():
    code = "import sys, ckptverify, ckptverify.cli, ckptverify.verify; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_the_integrations_package_imports_no_framework_and_no_torch():
    frameworks = ("torch", "pytorch_lightning", "transformers", "accelerate", "torchtitan")
    code = f"import sys, ckptverify.integrations; print([m for m in {frameworks!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "ckptverify", "--help"], capture_output=True, text=True, check=True)
    for command in ("verify", "fingerprint", "diff"):
        assert command in out.stdout


def test_all_lists_exactly_the_lazy_exports():
    assert set(ckptverify.__all__) - {"__version__"} == set(ckptverify._EXPORTS)


def test_exports_stay_callable_after_their_modules_are_imported():
    import importlib

    for name, module in ckptverify._EXPORTS.items():
        importlib.import_module(module)
        assert getattr(ckptverify, name) is getattr(importlib.import_module(module), name), name


def test_each_integration_extra_admits_the_framework_versions_the_tests_pin():
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    extras = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    pinned = {(r := Requirement(line)).name: next(iter(r.specifier)).version for line in extras["frameworks"]}
    for extra in ("lightning", "transformers", "accelerate", "torchtitan"):
        for line in extras[extra]:
            req = Requirement(line)
            assert req.name in pinned and req.specifier.contains(pinned[req.name]), (extra, line, pinned)
