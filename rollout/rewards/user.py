"""The ``python`` reward: a user function, ``pkg.module:function`` or ``path/to/file.py:function``.

The function is called once per sample with keyword arguments. It may take any of ``prompt``,
``response``, ``answer``, ``metadata``, ``finish_reason``, ``num_tokens`` (the fields of
``RewardInput``; a function with ``**kwargs`` gets them all) plus the keys of ``kwargs`` from the
config, and returns a number. ``async def`` functions run on the scorer's event loop, so many
calls to a remote judge can wait at once. Everything is checked when the server starts: the import,
the attribute, and that the signature accepts the arguments it will get.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Annotated, Any, Callable

from msgspec import field

from fleetrl.common.config.base import doc
from fleetrl.rollout.rewards.base import RewardArgs, RewardArgsError, RewardInput, SampleReward, register_reward

FIELDS = ("prompt", "response", "answer", "metadata", "finish_reason", "num_tokens")


def _import_module(name: str) -> Any:
    """Import ``pkg.module``, or load ``path/to/file.py`` as a module."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"fleetrl_user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_function(ref: str) -> Callable[..., Any]:
    """Resolve ``pkg.module:function`` (or ``file.py:function``, or ``module:Class.method``)."""
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardArgsError(f"function {ref!r} must look like 'pkg.module:function' or 'path/to/file.py:function'")
    try:
        obj = _import_module(module_name)
    except Exception as e:  # user code at the boundary: a syntax error or a failing import is a config error
        raise RewardArgsError(
            f"cannot import {module_name!r} for function {ref!r} ({type(e).__name__}: {e}); "
            "check that the module is installed or on PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardArgsError(f"module {module_name!r} has no attribute {attr!r}; check the name after ':' in {ref!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardArgsError(f"{ref!r} is a {type(obj).__name__}, not a function")
    return obj


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@register_reward("python")
class PythonReward(SampleReward):
    """Calls a user reward function per sample; see the module docstring for its signature."""

    class Args(RewardArgs):
        function: Annotated[str, doc("The function: 'pkg.module:function' or 'path/to/file.py:function'.")]
        kwargs: Annotated[dict[str, Any], doc("Extra keyword arguments passed to every call.")] = field(
            default_factory=dict
        )

    def __init__(self, **args: Any):
        super().__init__(**args)
        self.fn = load_function(self.args.function)
        self.is_async = _is_async(self.fn)
        self.passed = self._fields_taken()

    def _fields_taken(self) -> tuple[str, ...]:
        """The ``RewardInput`` fields the function names (all with ``**kwargs``); checks the call binds."""
        clash = sorted(set(self.args.kwargs) & set(FIELDS))
        if clash:
            raise RewardArgsError(f"kwargs {clash} clash with the per-sample arguments {list(FIELDS)}; rename them")
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):  # builtins without a signature get every field
            return FIELDS
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        passed = FIELDS if takes_all else tuple(f for f in FIELDS if f in sig.parameters)
        try:
            sig.bind(**dict.fromkeys(passed), **self.args.kwargs)
        except TypeError as e:
            raise RewardArgsError(
                f"{self.args.function} cannot be called with keyword arguments {[*passed, *self.args.kwargs]} ({e}); "
                f"it may take any of {', '.join(FIELDS)} and the keys of `kwargs`"
            ) from None
        return passed

    def _call(self, x: RewardInput) -> Any:
        return self.fn(**{f: getattr(x, f) for f in self.passed}, **self.args.kwargs)

    def score(self, x: RewardInput) -> Any:
        return super().score(x) if self.is_async else self._call(x)

    async def ascore(self, x: RewardInput) -> Any:
        return await self._call(x)
