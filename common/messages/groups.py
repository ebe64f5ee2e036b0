"""The payloads: ``Prompt`` (broker -> rollout) and ``SampleGroup`` (rollout -> broker -> learner), the
zero-copy array helpers and the deep checks of a group the broker runs at ingest."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from fleetrl.common.messages.base import (
    FLOAT32_MAX,
    LOGPROB_DTYPE,
    MASK_DTYPE,
    MAX_POLICY_VERSION,
    TOKEN_DTYPE,
    FinishReason,
    Id,
)

MAX_METADATA_DEPTH = 16  # nesting of a group's metadata / reward_parts: deeper is refused at ingest


class Prompt(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One prompt of the data set. ``prompt_id`` is stable across re-issues ("<epoch>:<index>")."""

    prompt_id: Id
    prompt: str | list[dict[str, str]]  # raw text, or chat messages [{role, content}]
    answer: str | None = None
    metadata: dict[str, Any] = {}


class SampleGroup(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """All responses to one prompt, produced by one policy version: a ragged batch.

    The responses' token ids and behaviour log-probs lie back to back in two flat arrays; response
    ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` with ``offsets = cumsum([0] + lengths)``. Decoded
    arrays are memoryviews into the frame they arrived in (no copy); use :meth:`token_array`,
    :meth:`logprob_array` and :meth:`response_tokens` to read them.

    Each response is trained after the group's prompt; ``prompt_lengths`` (optional) gives each response a
    prompt of its own instead: then ``prompt_tokens`` holds the G prompts back to back and response ``i``
    follows ``prompt_tokens[poffsets[i]:poffsets[i + 1]]`` (:meth:`prompt_of`). A rollout sends it only
    when its samples' prompts differ (agent sessions opened with and without a system message); frames
    without it decode as before (one shared prompt).

    Two optional per-token arrays ride the same way (empty = the default for every token):

    - ``loss_mask`` (uint8): 1 for tokens the policy sampled and the learner trains on, 0 for tokens
      that were appended, not sampled (a multi-turn episode's observations and tool results). Their
      log-probs are not behaviour log-probs; the learner never reads them. Default: all 1.
    - ``token_versions`` (int32): the policy version that produced each token; a response generated
      across an in-flight weight update spans versions. ``policy_version`` is the oldest of them (the
      group's staleness), so every entry is ``>= policy_version``. Default: all ``policy_version``.
    """

    group_id: Id  # unique per group; a retried push keeps it, so the broker de-duplicates
    prompt_id: Id
    policy_version: int
    prompt_tokens: memoryview  # int32 LE [P]
    lengths: list[int]  # [G] response lengths in tokens
    tokens: memoryview  # int32 LE [sum(lengths)]: sampled token ids
    logprobs: memoryview  # float32 LE [sum(lengths)]: log mu(token | prefix) from the engine's raw logits
    rewards: list[float]  # [G]
    finish_reasons: list[FinishReason] = []  # [G]; empty = every response ended with "stop"
    reward_parts: list[dict[str, float]] = []  # [G] per reward function, for logging
    failed: list[bool] = []  # [G] a reward function failed on this sample
    lease_id: Id = ""
    server_id: str = ""
    trace: dict[str, str] = {}  # W3C trace context (traceparent, tracestate)
    created_at: float = 0.0
    metadata: dict[str, Any] = {}
    # built from bytes, decoded as memoryview (msgspec): both are read as buffers
    loss_mask: memoryview = b""  # type: ignore[assignment]  # uint8 [sum(lengths)] or empty (= all 1): 0 = untrained
    token_versions: memoryview = b""  # type: ignore[assignment]  # int32 LE [sum(lengths)] or empty (= all policy_version)
    baseline_reward: float | None = None  # ReMax: the reward of the prompt's greedy response (None = not sampled)
    failed_parts: list[list[str]] = []  # [G] the reward labels that failed on each sample; empty = none failed
    prompt_lengths: list[int] = []  # [G] each response's own prompt (back to back in prompt_tokens); empty = shared

    def __post_init__(self) -> None:
        gid, n = self.group_id, len(self.lengths)
        if not gid:
            raise ValueError("group has an empty group_id")
        if n == 0:
            raise ValueError(f"group {gid} has no responses; push groups of at least one response")
        if len(self.rewards) != n:
            raise ValueError(
                f"group {gid} has {n} responses but {len(self.rewards)} rewards; send one reward per response"
            )
        for name in ("finish_reasons", "reward_parts", "failed", "failed_parts"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"group {gid} has {n} responses but {len(getattr(self, name))} {name}")
        if min(self.lengths) < 0:
            raise ValueError(f"group {gid} has a negative response length")
        total = 4 * sum(self.lengths)
        if len(self.tokens) != total:
            raise ValueError(
                f"group {gid} lengths sum to {total // 4} tokens but tokens holds {len(self.tokens)} bytes "
                f"({len(self.tokens) / 4:g} int32)"
            )
        if len(self.logprobs) != total:
            raise ValueError(
                f"group {gid} has {total // 4} tokens but {len(self.logprobs) / 4:g} log-probs; "
                "send one behaviour log-prob per sampled token"
            )
        if len(self.loss_mask) and len(self.loss_mask) != total // 4:
            raise ValueError(
                f"group {gid} has {total // 4} tokens but a loss_mask of {len(self.loss_mask)} bytes; "
                "send one uint8 per token, or none"
            )
        if len(self.token_versions) and len(self.token_versions) != total:
            raise ValueError(
                f"group {gid} has {total // 4} tokens but token_versions of {len(self.token_versions)} "
                "bytes; send one int32 per token, or none"
            )
        if not all(map(math.isfinite, self.rewards)):
            raise ValueError(
                f"group {gid} has a reward that is not finite ({self.rewards}); rewards must be finite numbers"
            )
        if max(map(abs, self.rewards)) > FLOAT32_MAX:
            raise ValueError(
                f"group {gid} has a reward beyond the float32 range ({max(map(abs, self.rewards)):g}); "
                "rewards are trained in float32, where it would be inf"
            )
        if self.baseline_reward is not None and not (
            math.isfinite(self.baseline_reward) and abs(self.baseline_reward) <= FLOAT32_MAX
        ):
            raise ValueError(
                f"group {gid} has a baseline_reward that is not a finite float32 ({self.baseline_reward}); "
                "send the greedy response's reward, or none"
            )
        if not len(self.prompt_tokens) or len(self.prompt_tokens) % 4:
            raise ValueError(f"group {gid} prompt_tokens is {len(self.prompt_tokens)} bytes, not int32 ids")
        if self.prompt_lengths and (
            len(self.prompt_lengths) != n
            or min(self.prompt_lengths) < 1
            or 4 * sum(self.prompt_lengths) != len(self.prompt_tokens)
        ):
            raise ValueError(
                f"group {gid} has prompt_lengths {self.prompt_lengths[:8]} for {n} responses and "
                f"{len(self.prompt_tokens) // 4} prompt tokens; send one length >= 1 per response "
                "summing to the prompt tokens, or none (one shared prompt)"
            )
        if not 0 <= self.policy_version <= MAX_POLICY_VERSION:
            raise ValueError(f"group {gid} has policy_version {self.policy_version} outside [0, {MAX_POLICY_VERSION}]")

    @property
    def num_responses(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def offsets(self) -> np.ndarray:
        """[G + 1] start of each response in the flat arrays, then the total."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    def prompt_array(self) -> np.ndarray:
        """int32 [P]: the shared prompt (with ``prompt_lengths``: every response's prompt back to back)."""
        return np.frombuffer(self.prompt_tokens, dtype=TOKEN_DTYPE)

    def prompt_offsets(self) -> np.ndarray | None:
        """[G + 1] start of each response's own prompt in ``prompt_tokens``, or None for a shared prompt."""
        if not self.prompt_lengths:
            return None
        return np.concatenate([[0], np.cumsum(self.prompt_lengths)]).astype(np.int64)

    def prompt_of(self, i: int) -> np.ndarray:
        """int32 [p]: the prompt response ``i`` follows (the shared one, or its own)."""
        offsets = self.prompt_offsets()
        whole = self.prompt_array()
        return whole if offsets is None else whole[offsets[i] : offsets[i + 1]]

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=TOKEN_DTYPE)

    def logprob_array(self) -> np.ndarray:
        return np.frombuffer(self.logprobs, dtype=LOGPROB_DTYPE)

    def response_tokens(self, i: int) -> np.ndarray:
        start = sum(self.lengths[:i])
        return self.token_array()[start : start + self.lengths[i]]

    def finish_reason(self, i: int) -> str:
        return self.finish_reasons[i] if self.finish_reasons else "stop"

    def loss_mask_array(self) -> np.ndarray:
        """uint8 [sum(lengths)]: 1 where the learner trains (all ones when the group sent none)."""
        if not len(self.loss_mask):
            return np.ones(self.num_tokens, dtype=MASK_DTYPE)
        return np.frombuffer(self.loss_mask, dtype=MASK_DTYPE)

    def version_array(self) -> np.ndarray:
        """int32 [sum(lengths)]: the policy version of each token (``policy_version`` when none was sent)."""
        if not len(self.token_versions):
            return np.full(self.num_tokens, self.policy_version, dtype=TOKEN_DTYPE)
        return np.frombuffer(self.token_versions, dtype=TOKEN_DTYPE)


def build_group(
    group_id: str,
    prompt_id: str,
    policy_version: int,
    prompt_ids: Any,
    responses: list[tuple[Any, Any]],
    rewards: list[float],
    finish_reasons: list[str] | None = None,
    loss_masks: list[Any] | None = None,
    token_versions: list[Any] | None = None,
    per_sample_prompts: bool = False,
    **fields: Any,
) -> SampleGroup:
    """A SampleGroup from per-response (token ids, log-probs) pairs (lists or arrays).

    ``loss_masks`` / ``token_versions``: one array per response (or None for the defaults).
    ``prompt_ids``: the shared prompt, or (``per_sample_prompts=True``) one prompt per response.
    """
    tokens = [np.asarray(t, dtype=TOKEN_DTYPE) for t, _ in responses]
    logprobs = [np.asarray(lp, dtype=LOGPROB_DTYPE) for _, lp in responses]
    if loss_masks is not None:
        fields["loss_mask"] = b"".join(np.asarray(x, dtype=MASK_DTYPE).tobytes() for x in loss_masks)
    if token_versions is not None:
        fields["token_versions"] = b"".join(np.asarray(x, dtype=TOKEN_DTYPE).tobytes() for x in token_versions)
    if per_sample_prompts:
        fields["prompt_lengths"] = [len(p) for p in prompt_ids]
        prompt_bytes = b"".join(np.asarray(p, dtype=TOKEN_DTYPE).tobytes() for p in prompt_ids)
    else:
        prompt_bytes = np.asarray(prompt_ids, dtype=TOKEN_DTYPE).tobytes()
    arrays: dict[str, Any] = dict(  # bytes for the memoryview fields (decoded groups hold memoryviews: both buffers)
        prompt_tokens=prompt_bytes,
        tokens=b"".join(t.tobytes() for t in tokens),
        logprobs=b"".join(lp.tobytes() for lp in logprobs),
        finish_reasons=list(finish_reasons or []),
    )
    return SampleGroup(
        group_id=group_id,
        prompt_id=prompt_id,
        policy_version=policy_version,
        lengths=[len(t) for t in tokens],
        rewards=[float(r) for r in rewards],
        **arrays,
        **fields,
    )


# ---------------------------------------------------------------------------- array helpers


def pack_tokens(ids: Any) -> bytes:
    """Token ids (list or array) -> int32 little-endian bytes."""
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()


def unpack_tokens(buf: bytes) -> np.ndarray:
    """int32 little-endian bytes -> read-only int32 array [T]."""
    return np.frombuffer(buf, dtype=TOKEN_DTYPE)


def pack_logprobs(values: Any) -> bytes:
    """Log-probs (list or array) -> float32 little-endian bytes."""
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def unpack_logprobs(buf: bytes) -> np.ndarray:
    """float32 little-endian bytes -> read-only float32 array [T]."""
    return np.frombuffer(buf, dtype=LOGPROB_DTYPE)


def check_group(
    group: SampleGroup, vocab_size: int = 0, *, max_abs_reward: float | None = None, max_version: int | None = None
) -> str | None:
    """Deeper checks than decoding does; returns a reason or None. The broker runs it on every group.

    Decoding already guarantees matching lengths, rewards finite in float32 and a bounded version.
    Here, in a few reductions over zero-copy views: token ids in ``[0, vocab_size)`` (read as *unsigned*, so a
    negative id shows up as huge); behaviour log-probs finite and ``<= 0``; every response has at least
    one token (the empty-response rule); rewards within ``max_abs_reward``; ``policy_version`` and
    every token version at most ``max_version`` (the broker's current version plus its slack: a
    version from the future is refused); a loss mask of 0/1; metadata nested at most
    ``MAX_METADATA_DEPTH`` deep.
    """
    gid = group.group_id
    if min(group.lengths) == 0:
        return (
            f"group {gid} has an empty response (0 tokens); every response must hold at least one sampled "
            "token (an engine that stops at once returns its stop token)"
        )
    if max_abs_reward is not None and max(map(abs, group.rewards)) > max_abs_reward:
        return (
            f"group {gid} has a reward of magnitude {max(map(abs, group.rewards)):g} over "
            f"broker.max_abs_reward={max_abs_reward:g}; scale the rewards or raise that setting"
        )
    hi = max(
        int(np.frombuffer(group.prompt_tokens, dtype="<u4").max()), int(np.frombuffer(group.tokens, dtype="<u4").max())
    )
    if hi >= 2**31:
        return f"group {gid} has a negative token id {hi - 2**32}"
    if vocab_size and hi >= vocab_size:
        return f"group {gid} has token id {hi} outside the vocabulary of {vocab_size}"
    if len(group.loss_mask) and int(np.frombuffer(group.loss_mask, dtype=MASK_DTYPE).max()) > 1:
        return f"group {gid} has a loss_mask value other than 0 or 1"
    newest = group.policy_version
    if len(group.token_versions):
        versions = np.frombuffer(group.token_versions, dtype=TOKEN_DTYPE)
        if int(versions.min()) < group.policy_version:
            return (
                f"group {gid} has a token version below its policy_version {group.policy_version}; "
                "policy_version must be the oldest version of any token"
            )
        newest = int(versions.max())
    if max_version is not None and newest > max_version:
        return (
            f"group {gid} claims policy version {newest}, ahead of the broker's newest version {max_version}; "
            "a rollout can only hold versions the broker announced"
        )
    logp = np.frombuffer(group.logprobs, dtype=LOGPROB_DTYPE)
    lp_lo, lp_hi = float(logp.min()), float(logp.max())  # NaN propagates through both
    if not (math.isfinite(lp_lo) and math.isfinite(lp_hi)):
        return f"group {gid} has log-probs that are not finite"
    if lp_hi > 0.0:
        return f"group {gid} has a log-prob of {lp_hi:g} > 0; behaviour log-probs are log-probabilities"
    for name in ("metadata", "reward_parts"):
        if getattr(group, name) and nesting_depth(getattr(group, name)) > MAX_METADATA_DEPTH:
            return f"group {gid} has {name} nested deeper than {MAX_METADATA_DEPTH} levels"
    return None


def nesting_depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (a scalar is 0), without recursion."""
    depth, level = 0, [value]
    while level:
        nxt: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, (list, tuple)):
                nxt.extend(v)
        if not nxt and not any(isinstance(v, (dict, list, tuple)) for v in level):
            break
        depth += 1
        level = nxt
    return depth
