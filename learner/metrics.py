"""The metric block every objective reports about the samples it trained on (written once).

Shape legend: B samples. ``versions`` is each sample's oldest token version, so staleness is the lag
of the oldest policy that produced any of its tokens.
"""

from __future__ import annotations

import torch


def sample_metrics(rewards_B: torch.Tensor, lengths_B: torch.Tensor, truncated_B: torch.Tensor,
                   versions_B: torch.Tensor, version: int) -> dict[str, float]:
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
