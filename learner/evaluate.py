"""Periodic evaluation inside the learner: `fleetrl eval`'s implementation on the model being trained.

Every ``run.eval_interval`` steps (and once at step 0, the start of the curve) rank 0 evaluates the
first ``run.eval_n`` rows of ``data.eval`` with ``rollout/eval.py``'s ``evaluate`` — the function
`fleetrl eval` runs — through an ``hf`` engine over the training module itself (no copy of the
weights): the same prompt key, chat template, truncation and reward scorer, and the same notion of
correct (reward >= ``run.eval_success``, 1.0 for exact/math rewards). The curve a run shows is therefore what `fleetrl eval` measures on the
exported checkpoint (greedy decoding: the two agree to the token).

With ZeRO-3 or several ranks rank 0 does not hold the whole model, so it is skipped there;
`fleetrl eval` on a checkpoint's ``hf/`` export covers that case.
"""

from __future__ import annotations

import logging

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.data.tables import load_rows

log = logging.getLogger("fleetrl.learner")

EVAL_BATCH = 256  # prompts generated together (one greedy sample each)


class Evaluator:
    """Greedy accuracy of the training model on the first run.eval_n rows of data.eval (rank 0)."""

    def __init__(self, cfg: JobConfig, device: torch.device):
        from transformers import AutoTokenizer

        self.cfg, self.device = cfg, device
        self.rows = load_rows(cfg.data.eval, "data.eval", cfg.data)[: cfg.run.eval_n]
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
        if cfg.learner.zero_stage == 3 or cfg.learner.num_ranks > 1:
            log.warning("periodic evaluation runs on rank 0 only and is skipped with ZeRO-3 or several ranks; "
                        "use `fleetrl eval` on a checkpoint's hf/ export instead")
            self.rows = []

    def __call__(self, module: torch.nn.Module) -> dict[str, float]:
        if not self.rows:
            return {}
        from fleetrl.rollout.eval import evaluate_model

        metrics = evaluate_model(module, self.tokenizer, self.rows, self.cfg, batch_size=EVAL_BATCH,
                                 seed=self.cfg.rollout.seed, success=self.cfg.run.eval_success)
        return metrics
