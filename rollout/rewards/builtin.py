"""Rule-based rewards: ``math`` (math-verify equivalence), ``exact``, ``regex`` (format) and ``length``.

All score one sample at a time (``SampleReward``) and are pure functions of the sample, so they are
safe to run from many worker threads at once.
"""

from __future__ import annotations

import re
from functools import lru_cache, partial, reduce
from typing import Annotated, Any, Literal

from msgspec import Meta

from fleetrl.common.config.base import doc
from fleetrl.rollout.rewards.base import (
    RewardArgs,
    RewardArgsError,
    RewardInput,
    SampleReward,
    register_reward,
    require_answer,
)

RegexFlag = Literal["IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE", "ASCII"]


def compile_pattern(pattern: str, flags: list[str] | tuple[str, ...] = ()) -> re.Pattern[str]:
    """``re.compile`` with flag names from the config; a bad pattern is a ``RewardArgsError``."""
    bits = reduce(lambda acc, name: acc | getattr(re, name), flags, 0)
    try:
        return re.compile(pattern, bits)
    except re.error as e:
        raise RewardArgsError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None


@register_reward("math")
class MathReward(SampleReward):
    """1.0 when the response's final answer equals the ground truth mathematically, else 0.0.

    Both sides are parsed by math-verify (``parse``: LaTeX such as ``\\frac{1}{2}`` and
    ``\\boxed{...}`` — the boxed answer first —, else plain expressions, the last one in the text)
    and compared by ``verify`` (numerically and symbolically), so "1/2", "0.5" and "\\frac{1}{2}"
    are equal. A response with no parsable answer scores 0.0; a ground truth math-verify cannot
    parse fails the sample (a data problem, counted, not a silent 0).

    math-verify's own time limits use ``signal.alarm``, which only works in the main thread; they
    are switched off here (``parsing_timeout=None``, ``timeout_seconds=None``) and the scorer's
    ``rollout.reward_timeout_s`` bounds each call instead, from any thread.
    """

    class Args(RewardArgs):
        float_rounding: Annotated[int, doc("Decimal places floats are rounded to before comparing.", ge=0)] = 6
        numeric_precision: Annotated[int, doc("Significant digits of numeric evaluation (sympy evalf).", ge=1)] = 15
        strict: Annotated[bool, doc("Variables must match by name and sets are not tuples (math-verify strict).")] = (
            True
        )

    def __init__(self, **args: Any):
        super().__init__(**args)
        import math_verify  # sympy underneath: ~1 s to import, so only when configured
        import math_verify.grader
        import math_verify.parser

        # Both modules log "timeout is disabled" once; the scorer enforces the time limit instead.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
        self._parse = partial(math_verify.parse, parsing_timeout=None)
        self._verify = partial(
            math_verify.verify,
            float_rounding=self.args.float_rounding,
            numeric_precision=self.args.numeric_precision,
            strict=self.args.strict,
            timeout_seconds=None,
        )
        # A group's responses share one ground truth: parse it once.
        self._parse_gold = lru_cache(maxsize=4096)(self._parse_gold_uncached)
        # The first parse builds math-verify's grammars (~0.2 s): pay it at start-up, not in a timed call.
        self._verify(self._parse("\\frac{1}{2}"), self._parse("0.5"))

    def _parse_gold_uncached(self, answer: str) -> list[Any]:
        gold = self._parse(answer)
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {answer[:80]!r}")
        return gold

    def score(self, x: RewardInput) -> float:
        gold = self._parse_gold(require_answer(x, self.name))
        return 1.0 if self._verify(gold, self._parse(x.response)) else 0.0


@register_reward("exact")
class ExactReward(SampleReward):
    """1.0 when the (extracted) response equals the ground truth after stripping whitespace, else 0.0.

    With ``pattern``, the answer is taken from the response first: the ``occurrence`` (last by
    default) match of the pattern, its group 1 when the pattern has a group, else the whole match;
    no match scores 0.0.
    """

    class Args(RewardArgs):
        pattern: Annotated[
            str | None, doc("Regex extracting the answer from the response (null = whole response).")
        ] = None
        occurrence: Annotated[Literal["first", "last"], doc("Which match of `pattern` is the answer.")] = "last"
        ignore_case: Annotated[bool, doc("Compare case-insensitively (str.casefold).")] = False
        flags: Annotated[list[RegexFlag], doc("Flags of `pattern`, e.g. [DOTALL].")] = []

    def __init__(self, **args: Any):
        super().__init__(**args)
        self.regex = None if self.args.pattern is None else compile_pattern(self.args.pattern, self.args.flags)

    def extract(self, response: str) -> str | None:
        """The answer part of ``response`` (None when ``pattern`` does not match)."""
        if self.regex is None:
            return response
        matches = list(self.regex.finditer(response))
        if not matches:
            return None
        m = matches[-1] if self.args.occurrence == "last" else matches[0]
        return m.group(1) if self.regex.groups else m.group(0)

    def score(self, x: RewardInput) -> float:
        answer = require_answer(x, self.name).strip()
        got = self.extract(x.response)
        if got is None:
            return 0.0
        got = got.strip()
        if self.args.ignore_case:
            got, answer = got.casefold(), answer.casefold()
        return 1.0 if got == answer else 0.0


@register_reward("regex", "format")
class RegexReward(SampleReward):
    """``hit`` (1.0) when the response matches ``pattern``, else ``miss`` (0.0): a format reward.

    ``mode`` picks ``re.search`` (anywhere), ``re.match`` (at the start) or ``re.fullmatch``
    (the whole response), e.g. ``pattern: "<think>.*</think>\\s*<answer>.*</answer>"`` with
    ``mode: full`` and ``flags: [DOTALL]``.
    """

    class Args(RewardArgs):
        pattern: Annotated[str, doc("Regular expression (Python `re` syntax) the response should match.")]
        mode: Annotated[
            Literal["search", "start", "full"], doc("Match anywhere, at the start, or the whole response.")
        ] = "search"
        flags: Annotated[list[RegexFlag], doc("Regex flags, e.g. [DOTALL, MULTILINE].")] = []
        hit: Annotated[float, doc("Reward when the response matches.")] = 1.0
        miss: Annotated[float, doc("Reward when it does not.")] = 0.0

    def __init__(self, **args: Any):
        super().__init__(**args)
        regex = compile_pattern(self.args.pattern, self.args.flags)
        self._match = {"search": regex.search, "start": regex.match, "full": regex.fullmatch}[self.args.mode]

    def score(self, x: RewardInput) -> float:
        return self.args.hit if self._match(x.response) else self.args.miss


@register_reward("length")
class LengthReward(SampleReward):
    """A non-positive length penalty (shaping), computed from ``num_tokens`` and ``finish_reason``::

        r = -min(max_penalty, penalty_per_token * max(0, num_tokens - target))
            - truncation_penalty * [finish_reason == "length"]

    ``target`` = L_max - L_cache, ``penalty_per_token`` = 1 / L_cache and ``max_penalty`` = 1 give
    DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13) for responses up to L_max tokens.
    """

    class Args(RewardArgs):
        target: Annotated[int, doc("Tokens a response may use without penalty.", ge=0)]
        penalty_per_token: Annotated[float, doc("Penalty for each token beyond `target`.", ge=0)] = 0.001
        max_penalty: Annotated[
            Annotated[float, Meta(ge=0)] | None, doc("Cap of the per-token penalty (null = none).")
        ] = None
        truncation_penalty: Annotated[float, doc("Extra penalty when the response hit max_new_tokens.", ge=0)] = 0.0

    def score(self, x: RewardInput) -> float:
        a = self.args
        over = a.penalty_per_token * max(0, x.num_tokens - a.target)
        if a.max_penalty is not None:
            over = min(over, a.max_penalty)
        cut = a.truncation_penalty if x.finish_reason == "length" else 0.0
        return 0.0 - over - cut
