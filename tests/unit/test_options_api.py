"""One name per concept in the Python API: ``VerifyOptions`` (``when``, ``deep``, ``on_failure``) taken as ``verify=``
by ``save``, ``async_save``, ``load``, ``Run.main`` and the integrations, validated when built; one value set
(``FAILURE_POLICIES``) for every failure knob (``on_failure``, ``on_replica_mismatch``, ``on_restore_mismatch``).
And one tree of errors and warnings: every class under ``CkptVerifyError`` or ``CkptVerifyWarning``, every
warning issued with a category of that tree.
"""

from __future__ import annotations

import ast
import inspect
import json
import pickle
import pkgutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import faults as inj

import ckptverify as cv
from ckptverify import errors
from ckptverify.errors import (
    CheckpointRefusedError,
    CkptVerifyError,
    CkptVerifyWarning,
    UsageError,
    VerifyFailedError,
    VerifyFailedWarning,
)
from ckptverify.integrations import Verifier
from ckptverify.options import FAILURE_POLICIES, VerifyOptions
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.ownfiles.names import VERIFYING_LOCK
from ckptverify.runs.stamp import read_stamp
from ckptverify.verifier import background
from ckptverify.verifier.background import BackgroundVerifier

PACKAGE = Path(cv.__file__).resolve().parent


@pytest.fixture
def verifier(monkeypatch: pytest.MonkeyPatch) -> Iterator[BackgroundVerifier]:
    fresh = BackgroundVerifier(settle=0.05)
    monkeypatch.setattr(background, "_default", fresh)
    yield fresh
    fresh.before_verify = None
    fresh.close(timeout=60)


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((64, 32), value), "b": torch.arange(32.0) + value}


# ------------------------------------------------------------------ VerifyOptions


@pytest.mark.parametrize(("field", "value"), [("when", "later"), ("when", True), ("deep", "yes"), ("deep", 1),
                                              ("on_failure", "ignore"), ("on_failure", None)])
def test_an_invalid_option_is_a_usage_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(UsageError, match=rf"VerifyOptions\.{field} must be"):
        VerifyOptions(**{field: value})


def test_the_options_and_their_defaults() -> None:
    assert VerifyOptions() == VerifyOptions(when="inline", deep=False, on_failure="warn")
    assert cv.VerifyOptions is VerifyOptions


@pytest.mark.parametrize("bad", ["later", 3, None, {"when": "inline"}])
def test_save_refuses_a_bad_verify_naming_it_and_writes_nothing(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(UsageError, match=r"save: verify"):
        cv.save(_state(1.0), tmp_path / "step_1", verify=bad)
    assert not (tmp_path / "step_1").exists()


# ------------------------------------------------------------------ save / async_save


def test_save_takes_verify_options(tmp_path: Path, verifier: BackgroundVerifier) -> None:
    seen: list[cv.Verification] = []
    cv.save(_state(1.0), tmp_path / "step_1", verify=VerifyOptions(deep=True), on_verified=seen.append)
    (result,) = seen
    assert result.passed and result.deep and read_stamp(tmp_path / "step_1").passed
    cv.save(_state(2.0), tmp_path / "step_2", verify="inline", on_verified=seen.append)
    assert seen[-1].passed and not seen[-1].deep


@pytest.mark.parametrize("fn", ["save", "async_save"])
def test_on_failure_raise_raises_on_a_failed_verification(tmp_path: Path, verifier: BackgroundVerifier,
                                                          fn: str) -> None:
    verifier.before_verify = lambda p: inj.flip_in_tensor_payload(p, "w") and None
    raising = VerifyOptions(on_failure="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VerifyFailedWarning)
        with pytest.raises(VerifyFailedError, match="step_1"):
            if fn == "save":
                cv.save(_state(1.0), tmp_path / "step_1", verify=raising)
            else:  # verified before the future completes; raised by the next save
                cv.async_save(_state(1.0), tmp_path / "step_1", verify=raising).result(timeout=120)
                cv.save(_state(2.0), tmp_path / "step_2", verify=raising)
    assert read_stamp(tmp_path / "step_1").passed is False
    verifier.before_verify = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cv.save(_state(3.0), tmp_path / "step_3", verify=raising)  # a clean save: no warning at all


# ------------------------------------------------------------------ load


def _train_state() -> cv.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return cv.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def _fingerprint_edited(path: Path) -> None:
    """The manifest's fingerprint of one tensor changed consistently: every byte still matches its digest, so only
    a deep verification (which rebuilds the tensor) sees it."""
    from ckptverify.ownfiles.manifest import _self_digest

    data = json.loads((path / MANIFEST_FILE).read_text())
    name = sorted(k for k, t in data["tensors"].items() if t["fingerprint"])[0]
    data["tensors"][name]["fingerprint"] = "f" * 32
    data["self_digest"] = _self_digest({k: v for k, v in data.items() if k != "self_digest"})
    (path / MANIFEST_FILE).write_text(json.dumps(data))


DEEP = VerifyOptions(deep=True)


def test_load_takes_verify_options(tmp_path: Path) -> None:
    path = tmp_path / "step_1"
    cv.save(_train_state(), path)
    _fingerprint_edited(path)
    cv.load(_train_state(), path, check=False)  # not deep: the bytes pass, nothing rebuilds the tensor
    with pytest.raises(CheckpointRefusedError, match="fingerprint"):
        cv.load(_train_state(), path, check=False, verify=DEEP)
    # A failed verification is never loaded, whatever on_failure says: it is the policy of a saved checkpoint.
    with pytest.raises(CheckpointRefusedError, match="fingerprint"):
        cv.load(_train_state(), path, check=False, verify=VerifyOptions(deep=True, on_failure="warn"))


def test_picking_loads_take_deep(tmp_path: Path) -> None:
    from ckptverify.checkpoint.load import load_newest_proven

    cv.save(_train_state(), tmp_path / "step_1")
    _fingerprint_edited(tmp_path / "step_1")
    report = cv.load(_train_state(), tmp_path, pick="latest-verified", check=False)
    assert report.stats["step"] == 1  # the pick verifies its bytes only
    with pytest.raises(CheckpointRefusedError, match="fingerprint"):
        cv.load(_train_state(), tmp_path, pick="latest-verified", check=False, verify=DEEP)
    with pytest.raises(CheckpointRefusedError, match="fingerprint"):
        load_newest_proven(_train_state(), tmp_path, check=False, deep=True)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"verify": True}, r"load: verify must be a VerifyOptions"),
    ({"verify": "background"}, r"load: verify\.when must be one of 'inline', 'off'"),
    ({"verify": VerifyOptions(when="off", deep=True)}, r"verify\.deep needs verify\.when='inline'"),
    ({"on_restore_mismatch": "refuse"}, r"on_restore_mismatch must be one of 'warn', 'raise'"),
])
def test_load_refuses_a_bad_option_before_reading(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        cv.load(_train_state(), tmp_path / "none", **kwargs)
    with pytest.raises(TypeError, match="deep"):
        cv.load(_train_state(), tmp_path, deep=True)  # type: ignore[call-arg]


def test_every_failure_knob_takes_the_one_value_set() -> None:
    from ckptverify.checkpoint.load import load
    from ckptverify.hardware.replica import ReplicaCheck

    assert FAILURE_POLICIES == ("warn", "raise")
    defaults = [inspect.signature(fn).parameters[name].default for fn, name in (
        (load, "on_restore_mismatch"), (ReplicaCheck.__init__, "on_replica_mismatch"),
        (cv.Run.main, "on_replica_mismatch"))]
    assert defaults == ["raise", "warn", "warn"]
    assert VerifyOptions().on_failure == "warn"
    with pytest.raises(UsageError, match="on_replica_mismatch must be one of 'warn', 'raise'"):
        ReplicaCheck(torch.nn.Linear(2, 2), on_replica_mismatch="stop")


# ------------------------------------------------------------------ Run.main


def _production_train(seen: list[Any]) -> Any:
    def train(run: cv.Run) -> None:
        seen.append(run._production.options.verify)
        run.restore(_train_state())  # the job's start: run.json is written

    return train


def test_run_main_takes_verify_options(tmp_path: Path) -> None:
    seen: list[Any] = []
    cv.Run.main(_production_train(seen), steps=1, run_dir=str(tmp_path / "a"),
                verify=VerifyOptions(when="inline", deep=True, on_failure="raise"))
    cv.Run.main(_production_train(seen), steps=1, run_dir=str(tmp_path / "b"))
    cv.Run.main(_production_train(seen), steps=1, run_dir=str(tmp_path / "c"), verify="off")
    assert seen == [VerifyOptions(when="inline", deep=True, on_failure="raise"), VerifyOptions(when="background"),
                    VerifyOptions(when="off")]
    # run.json records the options as one object, the same fields as the API's.
    recorded = json.loads((tmp_path / "a" / "run.json").read_text())["options"]
    assert recorded["verify"] == {"when": "inline", "deep": True, "on_failure": "raise"}
    assert "on_verify_failure" not in recorded


def test_run_main_refuses_a_bad_verify_before_the_job_starts(tmp_path: Path) -> None:
    seen: list[Any] = []
    with pytest.raises(UsageError, match=r"Run\.main: verify"):
        cv.Run.main(_production_train(seen), steps=1, run_dir=str(tmp_path), verify="sometimes")
    with pytest.raises(TypeError, match="on_verify_failure"):
        cv.Run.main(_production_train(seen), steps=1, run_dir=str(tmp_path), on_verify_failure="raise")
    assert seen == [] and not tmp_path.joinpath("run.json").exists()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, "steps must be at least 1, got 0"),
    ({"save_every": 0}, "save_every must be at least 1, got 0"),
    ({"trace_every": -1}, "trace_every must be at least 1, got -1"),
    ({"resume": "maybe"}, "resume must be one of 'auto', 'required', 'never', got 'maybe'"),
])
def test_production_options_refuse_a_bad_count_or_resume_mode(tmp_path: Path, kwargs: dict[str, Any],
                                                               match: str) -> None:
    from ckptverify.production.mode import ProductionOptions

    with pytest.raises(UsageError, match=match):
        ProductionOptions(run_dir=str(tmp_path), **{"steps": 2, **kwargs})


def test_a_run_directory_without_a_readable_run_file_is_refused_naming_it(tmp_path: Path) -> None:
    from ckptverify.production.mode import RUN_FILE, read_run_file

    with pytest.raises(UsageError, match=r"run\.json cannot be read .*the run directory of a production job"):
        read_run_file(str(tmp_path))
    for text, said in (("{not json", "cannot be read"), ("[1]", "does not describe a production job"),
                       ('{"target": 3}', "does not describe a production job")):
        (tmp_path / RUN_FILE).write_text(text)
        with pytest.raises(UsageError, match=said):
            read_run_file(str(tmp_path))
    (tmp_path / RUN_FILE).write_text('{"target": "train.py:main"}')
    assert read_run_file(str(tmp_path))["target"] == "train.py:main"


def test_a_training_function_with_no_source_file_is_refused() -> None:
    from ckptverify.production.mode import target_of

    assert target_of(_production_train).endswith("test_options_api.py:_production_train")
    scope: dict[str, Any] = {}
    exec(compile("def train(run):\n    pass\n", "<typed in>", "exec"), scope)
    with pytest.raises(UsageError, match="production mode needs a function in a file"):
        target_of(scope["train"])


def test_the_background_verifier_refuses_an_unknown_priority_or_isolation_and_a_submit_once_closed(
        tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="priority must be one of idle, low, normal, got 'lowest'"):
        BackgroundVerifier(priority="lowest")
    with pytest.raises(UsageError, match="isolation must be one of process, thread, got 'fork'"):
        BackgroundVerifier(isolation="fork")
    closed = BackgroundVerifier(isolation="thread")
    assert closed.close(timeout=5)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"x")
    with pytest.raises(UsageError, match="this BackgroundVerifier was closed"):
        closed.submit(ckpt, step=1)
    assert not (ckpt / VERIFYING_LOCK).exists()  # the lock taken for the refused submission was let go


# ------------------------------------------------------------------ integrations


def test_the_verifier_takes_verify_options_and_refuses_off_and_unknown_keywords() -> None:
    verifier = Verifier(verify=VerifyOptions(when="background", on_failure="raise", deep=True))
    assert (verifier.on_failure, verifier.background, verifier.deep) == ("raise", True, True)
    assert Verifier(verify="background").background and not Verifier().background
    with pytest.raises(UsageError, match=r"verify\.when must be one of 'inline', 'background'"):
        Verifier(verify="off")
    with pytest.raises(UsageError, match="verify"):
        Verifier(verify="sometimes")
    with pytest.raises(TypeError, match="background"):
        Verifier(background=True)


def test_deep_from_the_verifier_reaches_the_check(tmp_path: Path) -> None:
    path = tmp_path / "step_1"
    cv.save(_state(1.0), path)
    _fingerprint_edited(path)
    assert Verifier().after_save(path, fingerprint=False).passed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CkptVerifyWarning)  # the failure's own warning
        deep = Verifier(verify=VerifyOptions(deep=True)).after_save(path, fingerprint=False)
    assert not deep.passed and "fingerprint" in deep.message


def test_lightning_callback_keywords() -> None:
    lightning = pytest.importorskip("ckptverify.integrations.lightning")
    callback = lightning.VerifyCheckpointsCallback(verify="background")
    assert callback.verifier.verify == VerifyOptions(when="background")
    callback = lightning.VerifyCheckpointsCallback(verify=VerifyOptions(on_failure="raise"), verify_resume=False)
    assert callback.verifier.on_failure == "raise" and not callback.verify_resume
    with pytest.raises(UsageError, match=r"VerifyCheckpointsCallback: verify"):
        lightning.VerifyCheckpointsCallback(verify="never")


def test_transformers_callback_keywords() -> None:
    transformers = pytest.importorskip("ckptverify.integrations.transformers")
    callback = transformers.VerifyCheckpointsCallback(verify=VerifyOptions(on_failure="raise"))
    assert callback.verifier.verify == VerifyOptions(on_failure="raise")
    assert transformers.VerifyCheckpointsCallback(verify="background").verifier.background


def test_accelerate_save_state_keywords(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    accelerate = pytest.importorskip("accelerate")
    from ckptverify.integrations import accelerate as ckv

    monkeypatch.chdir(tmp_path)
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 2))
    verdict = ckv.save_state(accelerator, tmp_path / "state-step1")
    assert verdict.passed and verdict.step == 1
    verdict = ckv.save_state(accelerator, tmp_path / "state-step2", verify=VerifyOptions(on_failure="raise"))
    assert verdict.passed and read_stamp(tmp_path / "state-step2").passed
    with pytest.raises(UsageError, match="save_state: verify"):
        ckv.save_state(accelerator, tmp_path / "state-step3", verify="never")
    assert not (tmp_path / "state-step3").exists()  # refused before the accelerator wrote anything


def test_torchtitan_config_fields() -> None:
    pytest.importorskip("torchtitan")
    from ckptverify.integrations.torchtitan import VerifiedCheckpointManager

    config = VerifiedCheckpointManager.Config(verify_when="background", verify_deep=True, verify_on_failure="raise")
    assert config.verify_options() == VerifyOptions(when="background", deep=True, on_failure="raise")
    with pytest.raises(UsageError, match="verify_when"):
        VerifiedCheckpointManager.Config(verify_when="off")
    with pytest.raises(ValueError, match="verify_on_failure"):
        VerifiedCheckpointManager.Config(verify_on_failure="ignore")


# ------------------------------------------------------------------ one tree of errors and warnings


def _package_classes() -> list[type]:
    """Every exception or warning class defined anywhere in the package (modules whose optional framework is
    missing are passed over)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="ckptverify."):
        if info.name == "ckptverify.__main__":  # runs the command line
            continue
        try:
            module = __import__(info.name, fromlist=["_"])
        except ImportError:
            continue
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("ckptverify"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_exception_and_warning_class_is_in_errors_and_under_its_root() -> None:
    classes = _package_classes()
    assert len(classes) >= 20  # the walk saw the package, not an empty list
    for cls in classes:
        assert cls.__module__ == "ckptverify.errors", f"{cls.__qualname__} is defined in {cls.__module__}"
        if issubclass(cls, Warning):
            assert issubclass(cls, CkptVerifyWarning), cls
        else:
            assert issubclass(cls, CkptVerifyError), cls
    assert issubclass(errors.ManifestError, CkptVerifyError)


def test_error_classes_are_also_the_standard_exceptions_callers_catch() -> None:
    assert issubclass(errors.JSONError, ValueError) and issubclass(errors.UnsafeGlobal, pickle.UnpicklingError)
    assert issubclass(errors.NotRegularFileError, OSError) and issubclass(errors.VerifyFailedWarning, UserWarning)


def _warn_categories() -> list[tuple[str, int, str]]:
    """``(file, line, category source)`` of every ``warnings.warn(...)`` call in the package."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings"):
                category = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                calls.append((str(path.relative_to(PACKAGE)), node.lineno,
                              "UserWarning" if category is None else ast.unparse(category)))
    return calls


def test_every_warning_the_package_issues_is_under_the_root_warning() -> None:
    calls = _warn_categories()
    assert len(calls) >= 15
    for file, line, category in calls:
        cls = getattr(errors, category, None)
        assert isinstance(cls, type) and issubclass(cls, CkptVerifyWarning), f"{file}:{line}: {category}"


# ------------------------------------------------------------------ bytes_checked


def test_a_verdict_says_bytes_checked(tmp_path: Path) -> None:
    from ckptverify.ownfiles.events import read_events

    path = tmp_path / "step_1"
    cv.save(_state(1.0), path)
    verdict = Verifier(events_dir=tmp_path).after_save(path, step=1, fingerprint=False)
    data = verdict.to_dict()
    assert data["bytes_checked"] == verdict.bytes_checked > 64 * 32 * 4 and "checked_bytes" not in data
    (event,) = read_events(tmp_path, "checkpoint-verified")
    assert event["bytes_checked"] == verdict.bytes_checked and "checked_bytes" not in event
    assert cv.Verification.from_dict(data) == verdict
