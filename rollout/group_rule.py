"""From a prompt's finished samples to what the finisher pushes: the group rule, the shared prompt, rewards.

**The group rule** (the one rule for every environment and for agent sessions): a sample whose
environment failed (``Episode.failure``; with ``rollout.env.on_truncation: drop`` also a truncated
one) is dropped and counted, never scored. The group is then pushed with its survivors when at
least ``rollout.env.min_group_samples`` remain (capped at ``rollout.group_size``), and the
advantages are computed over those survivors; with fewer it is dropped whole and its prompt goes
back to the broker, which issues it again (``env/groups_dropped_total``).

**The shared prompt**: a SampleGroup has one prompt for all its responses. An environment whose
``reset`` gives every sample the same messages (the usual case) gives every sample the same prompt
tokens; otherwise the group's prompt is the samples' longest common prefix and what each sample had
beyond it becomes the start of its response, with loss mask 0 (nothing is re-tokenized). Prompts
that share no prefix at all (a session opened with a system message beside one without) are never
cut to fit: the group keeps the largest set that shares a prefix, the others are dropped and counted
(``env/prompt_mismatch_total``), and the group rule applies to what remains. (Per-sample prompts on
the wire, which would keep them all, are not built yet: issue 28.)

**Rewards**: an episode whose environment gave a reward keeps it (part ``env``); the others are
scored by ``rollout.rewards`` on their last assistant text, as single-turn samples are.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs.base import EnvStats, Episode
from fleetrl.rollout.rewards import RewardInput, RewardResult


def is_dropped(sample: Generation, on_truncation: str) -> bool:
    return isinstance(sample, Episode) and (sample.failed or (on_truncation == "drop" and bool(sample.truncated)))


def untaken(sample: Generation) -> bool:
    """An agent session's sample that no agent took (it expired waiting): not a failure of the task."""
    return isinstance(sample, Episode) and sample.error.startswith("no agent opened a session")


def survivors(samples: Sequence[Generation], env_cfg: Any, group_size: int, stats: EnvStats) -> list[Generation] | None:
    """The samples the group keeps, or None when too few survive (the group rule above)."""
    kept = [s for s in samples if not is_dropped(s, env_cfg.on_truncation)]
    lost = len(samples) - len(kept)
    if not lost:
        return kept
    stats.add(samples_dropped=lost)
    if len(kept) < min(env_cfg.min_group_samples, group_size):
        stats.add(groups_dropped=1)
        return None
    stats.add(groups_partial=1)
    return kept


def common_prompt(samples: Sequence[Generation], fallback: list[int]) -> list[int]:
    """The longest common prefix of the episodes' prompts (``fallback`` for plain generations).

    When the prompts share no token (e.g. sessions opened with and without a system message), the
    prompt is the common prefix of the largest set of prompts that share their first token; the samples
    whose prompts do not extend it are then dropped by :func:`fitting` (never cut to fit)."""
    prompts = [s.prompt_ids for s in samples if isinstance(s, Episode)]
    if not prompts:
        return list(fallback)
    prefix = os.path.commonprefix(prompts)
    if prefix:
        return list(prefix)
    firsts = Counter(p[0] for p in prompts if p)
    if not firsts:
        return list(fallback)
    top = max(firsts.values())
    first = next(p[0] for p in prompts if p and firsts[p[0]] == top)  # ties: the earliest sample's
    return list(os.path.commonprefix([p for p in prompts if p and p[0] == first]))


def fits(sample: Generation, prompt: list[int]) -> bool:
    """Whether ``sample`` can be trained under the group prompt ``prompt``: its own prompt extends it,
    token for token (plain generations always do: they were generated from the group's prompt)."""
    return not isinstance(sample, Episode) or sample.prompt_ids[: len(prompt)] == list(prompt)


def fitting(
    samples: Sequence[Generation], prompt: list[int], env_cfg: Any, group_size: int, stats: EnvStats
) -> list[Generation] | None:
    """The samples that fit ``prompt`` (``fits``), or None when too few remain (the group rule). A sample whose
    prompt differs is dropped and counted (``env/samples_dropped_total``, ``env/prompt_mismatch_total``), as
    training it under another prompt would train a context the model never saw."""
    kept = [s for s in samples if fits(s, prompt)]
    lost = len(samples) - len(kept)
    if not lost:
        return kept
    stats.add(samples_dropped=lost, prompt_mismatch=lost)
    if len(kept) < min(env_cfg.min_group_samples, group_size) or not kept:
        stats.add(groups_dropped=1)
        return None
    stats.add(groups_partial=1)
    return kept


def rebase(sample: Generation, prompt: list[int]) -> Generation:
    """An episode whose prompt extends ``prompt``: the extra prompt tokens move into its response (mask 0).
    Raises ValueError when its prompt does not start with ``prompt`` token for token (see ``fitting``)."""
    if not isinstance(sample, Episode) or len(sample.prompt_ids) == len(prompt):
        if isinstance(sample, Episode) and sample.prompt_ids != list(prompt):
            raise ValueError("rebase: the episode's prompt differs from the group's prompt")
        return sample
    if not fits(sample, prompt):
        raise ValueError(f"rebase: the episode's prompt does not start with the group's {len(prompt)}-token prompt")
    extra = sample.prompt_ids[len(prompt) :]
    version = min(sample.versions, default=0)
    sample.prompt_ids = list(prompt)
    sample.token_ids = extra + sample.token_ids
    sample.logprobs = [0.0] * len(extra) + sample.logprobs
    sample.versions = [version] * len(extra) + sample.versions
    sample.loss_mask = [0] * len(extra) + sample.loss_mask
    return sample


def score(scorer: Any, inputs: Sequence[RewardInput], samples: Sequence[Generation]) -> Future:
    """Rewards of ``samples`` (in order): the environment's where it gave one, ``scorer`` for the rest."""
    todo = [i for i, s in enumerate(samples) if not (isinstance(s, Episode) and s.reward is not None)]
    if len(todo) == len(samples):
        return scorer.submit(list(inputs))
    out: Future = Future()
    out.set_running_or_notify_cancel()
    given = {
        i: RewardResult(reward=s.reward, parts={"env": s.reward}, failed=False)
        for i, s in enumerate(samples)
        if i not in set(todo)
    }

    def merge(fut: Future) -> None:
        try:
            scored = dict(zip(todo, fut.result()))
        except BaseException as e:  # noqa: BLE001 - reaches the finisher, which reports it
            out.set_exception(e)
            return
        out.set_result([given[i] if i in given else scored[i] for i in range(len(samples))])

    if todo:
        scorer.submit([inputs[i] for i in todo]).add_done_callback(merge)
    else:
        out.set_result([given[i] for i in range(len(samples))])
    return out
