"""What goes into an engine and what comes out: ``Request`` (token-in) and ``Generation`` (token-out,
with the behaviour log-prob and the policy version of every sampled token; see ``params.py``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetrl.rollout.engines.params import SamplingParams


@dataclass
class Request:
    """One generation request, token-in/token-out.

    prompt_ids: the whole context so far (an episode's prompt plus every earlier turn, as tokens;
        never re-tokenized).
    params: how to sample it: temperature, top-p/k, max_new_tokens, stop strings/ids and the seed
        (None = the engine's own generator).
    request_id: unique while the request is in flight (abort and logs use it).
    trace: the W3C trace context (traceparent, tracestate) of the caller's span, or None.
    on_token: streaming: called with the token ids sampled since its last call, as they are produced
        (hf: from the decode thread; vllm: on the engine loop), so it must be thread-safe and quick.
        What it got is not final (a stop string may cut the last tokens): the `Generation` is.
    """

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: os.urandom(16).hex())  # uuid4().hex: 5x the CPU
    trace: dict[str, str] | None = None
    on_token: Callable[[list[int]], None] | None = field(default=None, compare=False, repr=False)


@dataclass
class Generation:
    """One sampled response (the result of one `Request`).

    token_ids: the sampled tokens, including the eos / stop token (or the token completing a stop
        string) that ended the response; the learner trains on all of them.
    logprobs: behaviour log-prob of each token in ``token_ids`` (see the module docstring).
    finish_reason: ``"stop"`` (eos, stop id or stop string) or ``"length"`` (max_new_tokens or the
        model's context length).
    text: the decoded response for rewards: special tokens skipped, a final stop token not decoded,
        cut before the first stop string.
    versions: the policy version of the weights that sampled each token (one per token; empty =
        all the engine's version at the time). A response sampled across an in-flight weight update
        spans two or more versions.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    versions: list[int] = field(default_factory=list)
    request_id: str = field(default="", compare=False)
