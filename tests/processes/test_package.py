"""The package surface: lazy exports, light imports, the command line's help."""

from __future__ import annotations

import subprocess
import sys

import ckptverify


def test_every_export_resolves():
    for name in ckptverify.__all__:
        assert getattr(ckptverify, name) is not None, name


def test_importing_the_package_and_the_cli_does_not_import_torch():
    code = "import sys, ckptverify, ckptverify.cli, ckptverify.audit.verify; print('torch' in sys.modules)"
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

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    pinned = {(r := Requirement(line)).name: next(iter(r.specifier)).version for line in extras["frameworks"]}
    for extra in ("lightning", "transformers", "accelerate", "torchtitan"):
        for line in extras[extra]:
            req = Requirement(line)
            assert req.name in pinned and req.specifier.contains(pinned[req.name]), (extra, line, pinned)


def test_dir_shows_the_public_names_before_they_are_used():
    code = "import ckptverify; print(sorted(set(ckptverify.__all__) - set(dir(ckptverify))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_resumable_sampler_is_at_the_package_top():
    from ckptverify.state.sampler import ResumableSampler

    assert ckptverify.ResumableSampler is ResumableSampler and "ResumableSampler" in ckptverify.__all__


def test_run_total_steps_is_the_job_length_in_every_kind_of_run():
    import pytest

    from ckptverify.errors import UsageError
    from ckptverify.resume.run import Run, RunConfig

    assert Run(RunConfig(stop_step=40)).total_steps == 40
    # A replay stops at its last checkpoint; schedules built from the job's length must not change.
    assert Run(RunConfig(stop_step=12, total_steps=40)).total_steps == 40
    with pytest.raises(UsageError, match="no step count"):
        _ = Run(RunConfig()).total_steps


def test_only_ckptverify_s_own_warnings_count_even_in_a_folder_named_ckptverify(tmp_path):
    import os
    import warnings

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/, whose frameworks package holds it
    try:
        from frameworks.harness import ckptverify_warnings
    finally:
        sys.path.pop(0)
    from ckptverify.errors import VerifyFailedWarning

    def caught(category, filename):
        return warnings.WarningMessage("m", category, filename, 1)

    library = str(tmp_path / "ckptverify" / ".venv" / "lib" / "site-packages" / "pytorch_lightning" / "_pytree.py")
    own = os.path.join(os.path.dirname(ckptverify.__file__), "saving.py")
    assert ckptverify_warnings([caught(DeprecationWarning, library)]) == []
    assert ckptverify_warnings([caught(UserWarning, own)]) == ["m"]
    assert ckptverify_warnings([caught(VerifyFailedWarning, library)]) == ["m"]
