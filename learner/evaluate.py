"""Periodic evaluation inside the learner: `fleetrl eval`'s implementation on the model being trained.

Every ``run.eval_interval`` steps (and once at step 0, the start of the curve) rank 0 evaluates the
first ``run.eval_n`` rows of ``data.eval`` with ``rollout/eval.py``'s ``evaluate_model`` — the code
`fleetrl eval` runs — through an ``hf`` engine over the training module itself (no copy of the
weights). The learner does not import the rollout package: the application hands that function in
(``app/entries.py``; the learner and rollout are peers, docs/architecture.md): the same prompt key, chat
template, truncation and reward scorer, and the same notion of correct (reward >= ``run.eval_success``, 1.0
for exact/math rewards). The curve a run shows is therefore what `fleetrl eval` measures on the exported
checkpoint (greedy decoding: the two agree to the token).

With ZeRO-3 or several ranks rank 0 does not hold the whole model, so it is skipped there;
`fleetrl eval` on a checkpoint's ``hf/`` export covers that case.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fleetrl.common.config import ConfigError
from fleetrl.common.config.schema import JobConfig
from fleetrl.common.data.tables import load_rows

log = logging.getLogger("fleetrl.learner")

EVAL_BATCH = 256  # prompts generated together (one greedy sample each)


class EvaluateModel(Protocol):
    """Greedy accuracy of ``model`` on ``rows`` as `fleetrl eval` measures it: ``rollout/eval.py``'s
    ``evaluate_model``, handed in by the application (``app/entries.py``)."""

    def __call__(
        self,
        model: Any,
        tokenizer: Any,
        rows: Sequence[dict[str, Any]],
        cfg: JobConfig,
        *,
        batch_size: int = ...,
        seed: int = ...,
        success: float | None = ...,
    ) -> dict[str, float]: ...


def require_evaluator(evaluate_model: EvaluateModel | None, what: str, off: str = "") -> EvaluateModel:
    """``evaluate_model``, or a ConfigError saying ``what`` needs it (and how to turn it ``off``) when the caller
    was started without one (only the application hands it in)."""
    if evaluate_model is None:
        raise ConfigError(
            f"{what} measures held-out accuracy with the rollout's evaluator, which this process was "
            "not given: start it through the `fleetrl` command (the application hands the evaluator "
            f"in: app/entries.py){f', or set {off}' if off else ''}"
        )
    return evaluate_model


class Evaluator:
    """Greedy accuracy of the training model on the first run.eval_n rows of data.eval (rank 0)."""

    def __init__(self, cfg: JobConfig, device: torch.device, evaluate_model: EvaluateModel | None):
        from fleetrl.common.chat.tokenizer import job_tokenizer

        self.evaluate_model = require_evaluator(evaluate_model, "run.eval_interval", "run.eval_interval=0")
        self.cfg, self.device = cfg, device
        self.rows = load_rows(cfg.data.eval, "data.eval", cfg.data)[: cfg.run.eval_n]
        self.tokenizer = job_tokenizer(cfg.model)
        if cfg.learner.zero_stage == 3 or cfg.learner.num_ranks > 1:
            log.warning(
                "periodic evaluation runs on rank 0 only and is skipped with ZeRO-3 or several ranks; "
                "use `fleetrl eval` on a checkpoint's hf/ export instead"
            )
            self.rows = []

    def __call__(self, module: torch.nn.Module) -> dict[str, float]:
        if not self.rows:
            return {}
        metrics = self.evaluate_model(
            module,
            self.tokenizer,
            self.rows,
            self.cfg,
            batch_size=EVAL_BATCH,
            seed=self.cfg.rollout.seed,
            success=self.cfg.run.eval_success,
        )
        return metrics
