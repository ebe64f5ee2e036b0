"""From a prompt's finished samples to what the finisher pushes: the group rule, the shared prompt, rewards.

**The group rule** (the one rule for every environment and for agent sessions): a sample whose
environment failed (``Episode.failure``; with ``rollout.env.on_truncation: drop`` also a truncated
one) is dropped and counted, never scored. The group is then pushed with its survivors when at
least ``rollout.env.min_group_samples`` remain (capped at ``rollout.group_size``), and the
advantages are computed over those survivors; with fewer it is dropped whole and its prompt goes
back to the broker, which issues it again (``env/groups_dropped_total``).

**The prompt**: a SampleGroup has one prompt for all its responses when they share it (the usual case:
an environment's ``reset`` gives every sample the same messages, so every sample the same prompt
tokens). When the samples' prompts differ at all (agent sessions opened with and without a system
message, chat and completions sessions of one task), every sample keeps its own prompt
(``SampleGroup.prompt_lengths``): the learner trains each sample on exactly the context the engine saw,
and the advantages are still computed over the whole group. Nothing is re-tokenized, cut or dropped.

**Rewards**: an episode whose environment gave a reward keeps it (part ``env``); the others are
scored by ``rollout.rewards`` on their last assistant text, as single-turn samples are.
"""

from __future__ import annotations

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


def own_prompts(samples: Sequence[Generation], fallback: list[int]) -> list[list[int]]:
    """The prompt each sample followed: an episode's own ``prompt_ids``, ``fallback`` (the task's prompt) for
    plain generations."""
    return [list(s.prompt_ids) if isinstance(s, Episode) and s.prompt_ids else list(fallback) for s in samples]


def shared_prompt(prompts: Sequence[list[int]]) -> list[int] | None:
    """The one prompt every sample followed, or None when they differ: then each sample keeps its own
    (``SampleGroup.prompt_lengths``); nothing is cut, moved or dropped to fit one prompt."""
    first = prompts[0] if prompts else []
    return list(first) if all(p == first for p in prompts) else None


def score(scorer: Any, inputs: Sequence[RewardInput], samples: Sequence[Generation]) -> Future:
    """Rewards of ``samples`` (in order): the environment's where it gave one, ``scorer`` for the rest."""
    todo = [i for i, s in enumerate(samples) if not (isinstance(s, Episode) and s.reward is not None)]
    if len(todo) == len(samples):
        return scorer.submit(list(inputs))
    out: Future = Future()
    out.set_running_or_notify_cancel()
    given = {
        i: RewardResult(reward=s.reward, parts=dict(s.reward_parts) or {"env": s.reward}, failed=False)
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
