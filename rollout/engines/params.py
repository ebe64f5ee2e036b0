"""``SamplingParams``: how one request samples (temperature, top-p/k, length, stops, seed).

Behaviour log-prob convention (the learner computes the same): for a sampled token ``y_t``,

    logp_t = log_softmax(z_t / T)[y_t]        z_t: raw logits over the FULL vocabulary, T: temperature

taken before top-k / top-p filtering, which only decide what may be sampled. ``T == 0`` means greedy
decoding, whose log-probs are taken at ``T = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetrl.common.config.schema import RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy; ``top_k == 0`` is off; ``seed`` None =
    the engine's own generator."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # Lists from configs are accepted and frozen, so that the params stay hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig) -> SamplingParams:
        """The `rollout` section's sampling settings; the seed stays with the engine (None here)."""
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop=tuple(rollout_cfg.stop),
            stop_token_ids=tuple(rollout_cfg.stop_token_ids),
        )
