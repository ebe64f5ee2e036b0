"""The metric block every objective reports about the samples it trained on (written once).

Shape legend: B samples. ``versions`` is each sample's oldest token version, so staleness is the lag
of the oldest policy that produced any of its tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def sample_metrics(
    rewards_B: torch.Tensor, lengths_B: torch.Tensor, truncated_B: torch.Tensor, versions_B: torch.Tensor, version: int
) -> dict[str, float]:
    """``reward/*``, ``response/*`` and ``off_policy/staleness_*`` of one step's samples."""
    lag = (version - versions_B).clamp(min=0).float()
    return {
        "reward/mean": float(rewards_B.mean()),
        "reward/std": float(rewards_B.std()) if rewards_B.numel() > 1 else 0.0,
        "reward/max": float(rewards_B.max()),
        "reward/min": float(rewards_B.min()),
        "response/length_mean": float(lengths_B.float().mean()),
        "response/length_max": float(lengths_B.max()),
        "response/truncated_frac": float(truncated_B.float().mean()),
        "off_policy/staleness_mean": float(lag.mean()),
        "off_policy/staleness_max": float(lag.max()),
    }


START, END = -1, -2  # marks around each response for distinct_2 (no token id is negative)


def diversity_metrics(responses: Sequence[tuple[int, ...]], groups: Sequence[int]) -> dict[str, float]:
    """``response/distinct_2`` and ``response/identical_frac`` of one step's sampled responses (token ids).

    ``distinct_2``: distinct token bigrams over all bigrams of the step, each response framed by a start
    and an end mark (so one-token and empty responses count too, and every rank reports the figure:
    the learner averages the same keys over ranks). ``identical_frac``: the fraction of the step's prompt
    groups that contain the step's most common response. Answers that agree within a group (one prompt) are expected; one response spread
    over many different prompts is the sign of a policy that answers every prompt alike (reward hacking).
    """
    out: dict[str, float] = {}
    if responses:
        framed = [(START, *r, END) for r in responses]
        bigrams = [f[i : i + 2] for f in framed for i in range(len(f) - 1)]
        out["response/distinct_2"] = len(set(bigrams)) / len(bigrams)
        top, _ = Counter(responses).most_common(1)[0]
        with_top = {g for r, g in zip(responses, groups) if r == top}
        out["response/identical_frac"] = len(with_top) / len(set(groups))
    return out
