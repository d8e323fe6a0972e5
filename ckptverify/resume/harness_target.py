"""The training function a harness run calls (``FILE.py:FUNC`` or ``package.module:FUNC``): resolved, checked before any
process starts, and loaded in each rank.

Traps: in a rank a ``FILE.py`` runs as spawn runs a script's main module (``__mp_main__``, aliased to ``__main__``,
its folder first on ``sys.path``), so its classes pickle by reference to the main module and DataLoader workers
re-create them; its ``__main__`` block never runs. :func:`check_target` imports the target in the calling process
under a private name, restores ``sys.path``/``argv``/environment afterwards and sends its prints to stderr (stdout
may be a JSON report); failures are :class:`~ckptverify.errors.UsageError` with the user's own traceback."""

from __future__ import annotations

import ast
import builtins
import difflib
import importlib
import inspect
import itertools
import os
import sys
import sysconfig
import textwrap
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any

from ckptverify.errors import UsageError

__all__ = ["check_target", "load_target", "never_restored_message", "resolve_target", "same_file", "usage_text",
           "user_traceback"]

MAIN_NAME = "__mp_main__"
_CHECK_NAME = "_ckptverify_target_check"


def split_target(target: str) -> tuple[str, str, bool]:
    """``(where, function name, is_file)`` of ``FILE.py:FUNC`` or ``package.module:FUNC``."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"target must be FILE.py:FUNC or module:FUNC, got {target!r}")
    return where, name, where.endswith(".py") or os.sep in where or (os.altsep or os.sep) in where


def load_target(target: str) -> Callable[[Any], None]:
    """Resolve the target to the training function in a rank: a file runs as ``__mp_main__`` (not again if it already
    is the main module). :class:`UsageError` when it cannot load or is not a one-argument function."""
    where, name, is_file = split_target(target)
    current = sys.modules.get("__main__")
    path = _existing_file(where) if is_file else None
    if path is not None and current is not None and same_file(getattr(current, "__file__", None), path):
        _path_first(os.path.dirname(path))
        module = current
    else:
        module = _module(where, is_file, target, MAIN_NAME)
        if is_file:
            sys.modules["__main__"] = module
    return _function(module, where, name, target)


def _module(where: str, is_file: bool, target: str, module_name: str) -> types.ModuleType:
    """The target's module: a file run as a script under ``module_name`` with its folder first on ``sys.path`` and
    ``argv`` as under ``python FILE.py`` with no arguments (its workers inherit it); a module imported with the
    working directory first."""
    if not is_file:
        _path_first(os.getcwd())
        return _import(where, target)
    path = _existing_file(where)
    _path_first(os.path.dirname(path))
    sys.argv[:] = [path]
    return _run_file(path, module_name)


def resolve_target(target: str) -> str:
    """``target`` as the harness runs it: the file made absolute (from the working directory, as every rank finds
    it), a module as given. :class:`UsageError` for a missing file or a bad shape; imports nothing."""
    where, name, is_file = split_target(target)
    return f"{_existing_file(where)}:{name}" if is_file else target


def check_target(target: str) -> str | None:
    """Load ``target`` here without its ``__main__`` block and check it can be a training function; :class:`UsageError`
    if not. Returns the module's absolute file (``None`` without one).

    Leaves ``sys.path``, ``sys.argv`` and the environment as they were and forgets modules found only through the
    script's folder (a later script may have same-named siblings). Cached per target while its file is unchanged."""
    from ckptverify.resume.harness_output import stdout_to_stderr

    where, name, is_file = split_target(target)
    key = (target, _stamp(where) if is_file else None)
    with _check_lock:  # launches side by side check at the same time; this changes process-wide state
        if key in _checked:
            return _checked[key]
        saved_path, saved_argv, saved_env = list(sys.path), list(sys.argv), dict(os.environ)
        before = set(sys.modules)
        folder = os.path.dirname(os.path.abspath(where)) if is_file else os.getcwd()
        try:
            with stdout_to_stderr():
                module = _module(where, is_file, target, _CHECK_NAME)
            func = _function(module, where, name, target)
            if _never_restores(func):
                raise UsageError(never_restored_message(target) + "\n" + _def_line(func))
            file = getattr(module, "__file__", None)
            _checked[key] = os.path.abspath(file) if isinstance(file, str) else None
            return _checked[key]
        finally:
            sys.path[:] = saved_path
            sys.argv[:] = saved_argv
            if dict(os.environ) != saved_env:
                os.environ.clear()
                os.environ.update(saved_env)
            sys.modules.pop(_CHECK_NAME, None)
            for mod_name in set(sys.modules) - before:
                file = getattr(sys.modules.get(mod_name), "__file__", None)
                if file and _found_only_in(mod_name, file, folder, saved_path):
                    del sys.modules[mod_name]


def _found_only_in(mod_name: str, file: str, folder: str, path: list[str]) -> bool:
    """Whether ``mod_name`` was found through ``folder`` and not through the earlier ``path``: only such modules are
    forgotten after a check."""

    def name_under(root: str) -> str | None:
        rel = os.path.relpath(os.path.abspath(file), os.path.abspath(root or "."))
        if rel.startswith(os.pardir + os.sep):
            return None
        parts = os.path.splitext(rel)[0].split(os.sep)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)

    if mod_name.partition(".")[0] == __name__.partition(".")[0]:
        return False  # this package's own modules are never forgotten (others hold references to them)
    return name_under(folder) == mod_name and not any(name_under(p) == mod_name for p in path if isinstance(p, str))


_checked: dict[tuple[str, tuple[int, int] | None], str | None] = {}
_check_lock = threading.Lock()


def _stamp(where: str) -> tuple[int, int] | None:
    try:
        st = os.stat(where)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def never_restored_message(target: str) -> str:
    return (f"{target} never calls run.restore(state): the harness can neither save, resume nor check a state "
            "it was never given. Build a cv.TrainState of the model, optimizer, scheduler and data loader and "
            "call run.restore(state) once, before the training loop (docs/resume.md, The Run protocol).")


def _existing_file(where: str) -> str:
    path = os.path.abspath(where)
    if not os.path.isfile(path):
        hint = " (it is a folder)" if os.path.isdir(path) else ""
        raise UsageError(f"workload file not found: {where}{hint}")
    return path


def same_file(a: str | None, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file, however spelled; when one is not here, only the same spelling
    is."""
    if a is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def _path_first(folder: str) -> None:
    """Put ``folder`` first on ``sys.path``, as ``python FILE.py`` and ``python -m`` do."""
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _run_file(path: str, module_name: str) -> types.ModuleType:
    """Run the file as a script (``__spec__``/``__package__`` None) under ``module_name``, registered in
    ``sys.modules`` while it runs (dataclasses and pickling look classes up there)."""
    module = types.ModuleType(module_name)
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __package__=None, __spec__=None,
                           __builtins__=builtins)
    previous = sys.modules.get(module_name)
    sys.modules[module_name] = module
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException as exc:
        if previous is not None:
            sys.modules[module_name] = previous
        else:
            sys.modules.pop(module_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise UsageError(f"{path} failed to import:\n{user_traceback(exc)}") from None
    return module


def _import(where: str, target: str) -> types.ModuleType:
    try:
        return importlib.import_module(where)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if name is not None and (where == name or where.startswith(name + ".")):
            raise UsageError(f"no module named {name!r} (from target {target}): run from the folder that holds the "
                             "package, or install it, or give FILE.py:FUNC") from None
        raise UsageError(f"{where} failed to import:\n{user_traceback(exc)}") from None


def _function(module: types.ModuleType, where: str, name: str, target: str) -> Callable[[Any], None]:
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            break
    if obj is None:
        functions = sorted(n for n, v in vars(module).items() if not n.startswith("_")
                           and inspect.isfunction(v) and getattr(v, "__module__", None) == module.__name__)
        close = difflib.get_close_matches(name, functions, n=1)
        listed = f" (functions defined there: {', '.join(functions)})" if functions else ""
        if close:
            raise UsageError(f"{where} has no function {name!r}; did you mean {close[0]!r}?{listed}\n"
                             + _def_line(getattr(module, close[0])))
        raise UsageError(f"{where} has no function {name!r}{listed}")
    if not callable(obj):
        raise UsageError(f"{target} is a {type(obj).__name__}, not a function: give the training function "
                         "train(run)")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return obj  # a builtin or extension callable: nothing to check here
    try:
        signature.bind(object())
    except TypeError:
        raise UsageError(f"{target} must take one argument, the Run (train(run)); it is {name}{signature}\n"
                         + _def_line(obj)) from None
    return obj


def _def_line(func: Any) -> str:
    """The ``File "...", line N, in name`` line of where ``func`` is defined, with its source line."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    if code is None:
        return ""
    frame = traceback.FrameSummary(code.co_filename, code.co_firstlineno, code.co_name)
    return "".join(traceback.StackSummary.from_list([frame]).format()).rstrip("\n")


#: Names whose use in the training function may reach ``run`` without naming ``run.restore``.
_OPAQUE = frozenset({"locals", "vars", "globals", "eval", "exec", "getattr", "__import__"})


def _never_restores(func: Any) -> bool:
    """Whether ``func``'s code shows it uses the protocol but cannot call ``run.restore``: no ``.restore`` anywhere
    and its parameter only used as ``run.<attribute>``. Anything less certain is left to the run."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return False
    if not tree.body or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    fn = tree.body[0]
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    if fn.decorator_list or args.vararg or args.kwarg or not positional:
        return False
    param = positional[0].arg
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    used = False
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and node.attr == "restore":
            return False
        if isinstance(node, ast.Name):
            if node.id in _OPAQUE:
                return False
            if node.id == param:
                parent = parents.get(node)
                if not (isinstance(node.ctx, ast.Load) and isinstance(parent, ast.Attribute) and parent.value is node):
                    return False
                used = True
    # One that never touches ``run`` is not written for the protocol: its own crash says more.
    return used


_HARNESS_FILES = frozenset({"harness.py", "harness_target.py", "harness_output.py", "launch.py"})


def _ours(filename: str) -> bool:
    """Whether a frame is machinery between the harness and the user's code (hidden from the user)."""
    if filename.startswith("<frozen importlib") or os.path.basename(os.path.dirname(filename)) == "importlib":
        return True
    return (os.path.dirname(os.path.abspath(filename)) == os.path.dirname(os.path.abspath(__file__))
            and os.path.basename(filename) in _HARNESS_FILES)


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback without the leading harness and import frames, chained exceptions included."""
    te = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list(list(itertools.dropwhile(lambda f: _ours(f.filename), t.stack)))
        todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
    return "".join(te.format()).rstrip("\n")


_LIBRARY_DIRS = tuple(os.path.abspath(p) + os.sep for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # this package
    *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))} if p)


def usage_text(exc: BaseException) -> str:
    """A usage error raised in the user's code: its message, then the user's own frames leading to it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<") and not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    where = "".join(traceback.StackSummary.from_list(frames).format()).rstrip("\n")
    return f"{exc}\n{where}" if where else str(exc)
