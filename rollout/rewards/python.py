"""The ``python`` reward: a user function, ``pkg.module:function`` or ``path/to/file.py:function``, in one of two forms.

**Per sample** (fleetrl's own): called once per sample with keyword arguments. It may take any of
``prompt``, ``response``, ``answer``, ``metadata``, ``finish_reason``, ``num_tokens`` (the fields of
``RewardInput``; a function with ``**kwargs`` gets them all) plus the keys of ``kwargs`` from the
config, and returns a number (or None: no score).

**Batched** (TRL's ``GRPOTrainer`` form, used as written, no adapter): called once per batch as
``fn(prompts=[...], completions=[...], **columns)`` and returns one ``float | None`` per completion.
``completions`` are strings, or ``[{"role": "assistant", "content": ...}]`` when the prompt is a list
of chat messages (TRL's conversational format); ``columns`` are the data set's other columns by
name (``solution``, ``ground_truth``, ... — lists, one entry per completion), plus ``answer``,
``finish_reasons``, ``num_tokens`` and the config's ``kwargs``. A function whose signature names
``completions`` is batched (``batched: auto``); ``batched: true|false`` says so explicitly.

In both forms None means "no score": the scorer counts it and skips it, never scores it 0.
``async def`` functions run on the scorer's event loop. Everything is checked when the server
starts (and by `fleetrl config validate`): the import, the attribute, and that the signature accepts
the arguments it will get.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from msgspec import field

from fleetrl.common.config.base import doc
from fleetrl.common.plugins.userfn import FunctionRefError
from fleetrl.common.plugins.userfn import load_function as _load
from fleetrl.rollout.rewards.base import RewardArgs, RewardArgsError, RewardInput, SampleReward, register_reward

FIELDS = ("prompt", "response", "answer", "metadata", "finish_reason", "num_tokens")
BATCH_FIELDS = ("prompts", "completions", "answer", "finish_reasons", "num_tokens")  # besides the data columns


def load_function(ref: str) -> Callable[..., Any]:
    """Resolve ``pkg.module:function`` (or ``file.py:function``, or ``module:Class.method``)."""
    try:
        return _load(ref)
    except FunctionRefError as e:
        raise RewardArgsError(str(e)) from None


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def completion_of(x: RewardInput) -> str | list[dict[str, str]]:
    """A completion in TRL's format: the text, or one assistant message when the prompt is chat messages."""
    return [{"role": "assistant", "content": x.response}] if isinstance(x.prompt, list) else x.response


def batch_columns(batch: list[RewardInput]) -> dict[str, list[Any]]:
    """The keyword arguments of a batched call: TRL's prompts / completions, every data column by name."""
    names = dict.fromkeys(k for x in batch for k in x.metadata)
    out: dict[str, list[Any]] = {name: [x.metadata.get(name) for x in batch] for name in names}
    out.update(
        prompts=[x.prompt for x in batch],
        completions=[completion_of(x) for x in batch],
        answer=[x.answer for x in batch],
        finish_reasons=[x.finish_reason for x in batch],
        num_tokens=[x.num_tokens for x in batch],
    )
    return out


@register_reward("python")
class PythonReward(SampleReward):
    """Calls a user reward function per sample or per batch; see the module docstring."""

    time_limited: ClassVar[bool] = True  # a batched call also runs under rollout.reward_timeout_s

    class Args(RewardArgs):
        function: Annotated[str, doc("The function: 'pkg.module:function' or 'path/to/file.py:function'.")]
        kwargs: Annotated[dict[str, Any], doc("Extra keyword arguments passed to every call.")] = field(
            default_factory=dict
        )
        batched: Annotated[
            Literal["auto"] | bool,
            doc(
                "Batched TRL form `(prompts, completions, **columns) -> list[float | None]`; auto = when the "
                "function's signature names `completions`."
            ),
        ] = "auto"

    def __init__(self, **args: Any):
        super().__init__(**args)
        self.fn = load_function(self.args.function)
        self.is_async = _is_async(self.fn)
        self.label = getattr(self.fn, "__name__", "python")
        sig = _signature(self.fn)
        wanted = self.args.batched
        self.per_sample = not (
            wanted is True or (wanted == "auto" and sig is not None and "completions" in sig.parameters)
        )
        self.passed = self._fields_taken(sig) if self.per_sample else ()
        if not self.per_sample:
            self._check_batched(sig)

    def _fields_taken(self, sig: inspect.Signature | None) -> tuple[str, ...]:
        """The ``RewardInput`` fields the function names (all with ``**kwargs``); checks the call binds."""
        clash = sorted(set(self.args.kwargs) & set(FIELDS))
        if clash:
            raise RewardArgsError(f"kwargs {clash} clash with the per-sample arguments {list(FIELDS)}; rename them")
        if sig is None:
            return FIELDS
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        passed = FIELDS if takes_all else tuple(f for f in FIELDS if f in sig.parameters)
        try:
            sig.bind(**dict.fromkeys(passed), **self.args.kwargs)
        except TypeError as e:
            raise RewardArgsError(
                f"{self.args.function} cannot be called with keyword arguments {[*passed, *self.args.kwargs]} ({e}); "
                f"it may take any of {', '.join(FIELDS)} and the keys of `kwargs` (or `completions` for the batched "
                "TRL form)"
            ) from None
        return passed

    def _check_batched(self, sig: inspect.Signature | None) -> None:
        """A batched function must accept completions; other required parameters must be data columns."""
        if sig is None:
            return
        params = sig.parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if not takes_all and "completions" not in params:
            raise RewardArgsError(
                f"{self.args.function} is batched but takes no `completions` argument; batched "
                "reward functions are called as fn(prompts=..., completions=..., **columns)"
            )
        self.required_columns = [
            name
            for name, p in params.items()
            if p.default is inspect.Parameter.empty
            and name not in BATCH_FIELDS
            and name not in self.args.kwargs
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        self.takes_all = takes_all
        self.params = set(params)

    @classmethod
    def check(cls, **args: Any) -> None:
        cls(**args)  # cheap: imports the function and checks its signature

    # ----------------------------------------------------------------------------- per sample

    def _call(self, x: RewardInput) -> Any:
        return self.fn(**{f: getattr(x, f) for f in self.passed}, **self.args.kwargs)

    def score(self, x: RewardInput) -> Any:
        return super().score(x) if self.is_async else self._call(x)

    async def ascore(self, x: RewardInput) -> Any:
        return await self._call(x)

    # -------------------------------------------------------------------------------- batched

    def _batch_kwargs(self, batch: list[RewardInput]) -> dict[str, Any]:
        cols = batch_columns(batch)
        missing = [c for c in self.required_columns if c not in cols]
        if missing:
            data = sorted(dict.fromkeys(k for x in batch for k in x.metadata))  # the rows' own columns, answer too
            raise ValueError(
                f"{self.args.function} needs the data column(s) {missing}, which the rows do not have "
                f"(columns: {data}); add them, or give defaults"
            )
        if not self.takes_all:
            cols = {k: v for k, v in cols.items() if k in self.params}
        return {**cols, **self.args.kwargs}

    def __call__(self, batch: list[RewardInput]) -> list[Any]:
        if self.per_sample:
            return [self.score(x) for x in batch]
        return list(self.fn(**self._batch_kwargs(batch)))

    async def acall(self, batch: list[RewardInput]) -> list[Any]:
        return list(await self.fn(**self._batch_kwargs(batch)))


def missing_columns(args: dict[str, Any], columns: list[str]) -> list[str]:
    """`fleetrl config validate`: the data columns a batched function requires that ``columns`` (the first
    row's, besides the prompt) lack; [] for a per-sample function (it takes fields, not columns)."""
    reward = PythonReward(**args)
    if reward.per_sample:
        return []
    return [c for c in reward.required_columns if c not in columns]
