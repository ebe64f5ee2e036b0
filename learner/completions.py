"""What the learner shows of the samples it trains on: metrics per reward function, and sample completions.

- :func:`reward_part_metrics`: ``reward/<label>/mean`` of each reward function over the step's samples
  (the groups carry every sample's unweighted parts, named after the function: ``reward/accuracy_reward/mean``)
  and ``reward/<label>/scored_frac`` when some samples had no score from it (a failed part is no score: its
  0.0 is left out of the mean and counted in ``reward/<label>/failed_frac``); ``reward/failed_frac`` is the
  share of the step's samples with any failed part. They go to every sink
  through the monitor, like every other metric.
- :class:`CompletionLog`: every ``telemetry.log_completions_every`` steps, the first
  ``telemetry.log_completions_prompts`` groups of the step, one row per response: the prompt as the
  model saw it (chat template and all), the response, its reward and parts, its advantage, finish
  reason, length and policy version. The monitor writes them to ``completions.jsonl`` and hands them
  to the sinks (a wandb Table, TensorBoard text); `fleetrl report` shows the latest.

Both run on rank 0 over rank 0's share of the step's groups.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from fleetrl.common import messages as m
from fleetrl.common.config.schema import JobConfig

COLUMNS = ("step", "policy_version", "group", "prompt", "response", "reward", "advantage", "finish_reason", "tokens")


def reward_part_metrics(groups: list[m.SampleGroup]) -> dict[str, float]:
    """Mean of each reward function's unweighted score over the samples it scored and did not fail on, and
    the share of samples with a failed part (see the module docstring)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    fails: dict[str, int] = defaultdict(int)
    samples = failed = 0
    for g in groups:
        failed_parts = g.failed_parts or [[] for _ in g.reward_parts]
        for j, parts in enumerate(g.reward_parts):
            samples += 1
            failed += bool(g.failed[j]) if g.failed else 0
            for name, value in parts.items():
                if name in failed_parts[j]:  # its 0.0 is a failure, not a score
                    fails[name] += 1
                    continue
                sums[name] += value
                counts[name] += 1
    out = {"reward/failed_frac": failed / samples} if samples else {}
    for name in sorted(set(sums) | set(fails)):
        if counts[name]:
            out[f"reward/{name}/mean"] = sums[name] / counts[name]
        if counts[name] < samples:
            out[f"reward/{name}/scored_frac"] = counts[name] / samples
        if fails[name]:
            out[f"reward/{name}/failed_frac"] = fails[name] / samples
    return out


def sample_advantages(batch: Any) -> list[float] | None:
    """Each sample's mean advantage over its trained tokens (rows in group order), or None (no advantages: DPO)."""
    gather = getattr(batch, "gather", None)
    if gather is None or not all(getattr(mb, "adv", None) is not None for mb in batch.micro):
        return None
    adv, mask = gather("adv"), batch.mask
    per = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return [float(x) for x in per.tolist()]


class CompletionLog:
    """Picks and decodes the rows of a completions log (rank 0)."""

    def __init__(self, cfg: JobConfig):
        self.every = cfg.telemetry.log_completions_every
        self.prompts = cfg.telemetry.log_completions_prompts
        self.model_cfg = cfg.model
        self._tokenizer = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from fleetrl.common.chat.tokenizer import job_tokenizer

            self._tokenizer = job_tokenizer(self.model_cfg)
        return self._tokenizer

    def rows(self, step: int, groups: list[m.SampleGroup], advantages: list[float] | None) -> list[dict[str, Any]]:
        """One row per response of the first groups (``advantages``: per sample, all groups in order)."""
        out, at, now = [], 0, time.time()
        for gi, g in enumerate(groups):
            if gi >= self.prompts:
                break
            masks, offsets = g.loss_mask_array(), g.offsets()
            for i in range(g.num_responses):
                tokens = g.response_tokens(i).tolist()
                # a multi-turn sample (appended, mask-0 tokens) keeps its role markers: the turns stay readable
                multi = bool(len(g.loss_mask)) and not masks[offsets[i] : offsets[i + 1]].all()
                if i == 0 or g.prompt_lengths:  # a sample with a prompt of its own shows it
                    prompt = self.tokenizer.decode(g.prompt_of(i).tolist(), skip_special_tokens=False)
                out.append(
                    {
                        "step": step,
                        "time": now,
                        "policy_version": g.policy_version,
                        "group": g.group_id,
                        "prompt": prompt,
                        "response": self.tokenizer.decode(tokens, skip_special_tokens=not multi),
                        "reward": g.rewards[i],
                        "parts": g.reward_parts[i] if g.reward_parts else {},
                        "advantage": advantages[at + i] if advantages is not None else None,
                        "finish_reason": g.finish_reason(i),
                        "tokens": len(tokens),
                    }
                )
            at += g.num_responses
        return out
