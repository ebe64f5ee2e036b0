"""User code named in a config: ``pkg.module:function`` or ``path/to/file.py:function`` (also ``module:Class.method``).

Reward functions (``rollout.rewards[i].args.function``) and the data hook (``data.map``) are both
found this way. Importing the module runs user code, so every failure (a missing file, a syntax
error, an import inside it that fails) comes back as one ``FunctionRefError`` that says what to
fix; the caller prefixes the config key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class FunctionRefError(ValueError):
    """A ``module:function`` reference that cannot be resolved; the message says why and what to change."""


def on_path(folder: str | Path) -> None:
    """Put ``folder`` at the end of ``sys.path`` unless it is there: user code imports what lies beside it."""
    folder = str(Path(folder).resolve())
    if folder not in (str(Path(p or ".").resolve()) for p in sys.path):
        sys.path.append(folder)


def import_module(name: str) -> Any:
    """Import ``pkg.module`` (also from the working directory, as ``python -m`` would), or load
    ``path/to/file.py`` as a module (once per path) with its folder on ``sys.path``, so that it imports its
    sibling modules (``from helper import norm``), as TRL users expect."""
    if not name.endswith(".py"):
        on_path(Path.cwd())
        return importlib.import_module(name)
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no file {str(path)!r}")
    on_path(path.parent)
    module_name = f"fleetrl_user_{path.stem}_{abs(hash(str(path))) % 10**8}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{str(path)!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_function(ref: str) -> Callable[..., Any]:
    """Resolve ``ref``; raises FunctionRefError naming what is wrong."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise FunctionRefError(f"function {ref!r} must look like 'pkg.module:function' or 'path/to/file.py:function'")
    try:
        obj = import_module(module_name)
    except Exception as e:  # user code at the boundary: a syntax error or a failing import is a config error
        raise FunctionRefError(
            f"cannot import {module_name!r} for function {ref!r} ({type(e).__name__}: {e}); "
            "check that the module is installed or on PYTHONPATH (a file path must end in .py)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FunctionRefError(
                f"module {module_name!r} has no attribute {attr!r}; check the name after ':' in {ref!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise FunctionRefError(f"{ref!r} is a {type(obj).__name__}, not a function")
    return obj
