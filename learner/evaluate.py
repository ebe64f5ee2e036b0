"""Periodic evaluation inside the learner: greedy accuracy of the model being trained.

Runs on rank 0 every ``run.eval_interval`` steps (and once at step 0, the start of the curve) on the
first ``run.eval_n`` rows of ``data.eval``. With ZeRO-3 or several ranks rank 0 does not hold the
whole model, so it is skipped there; `fleetrl eval` on a checkpoint's ``hf/`` export covers that case.
"""

from __future__ import annotations

import logging
import time

from fleetrl.common.config.schema import JobConfig

log = logging.getLogger("fleetrl.learner")


class Evaluator:
    """Greedy accuracy of the training model on the first run.eval_n rows of data.eval (rank 0)."""

    def __init__(self, cfg: JobConfig):
        from transformers import AutoTokenizer

        from fleetrl.learner.sft import read_rows

        self.rows = read_rows(cfg.data.eval)[: cfg.run.eval_n]
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
        self.max_new_tokens = cfg.rollout.max_new_tokens
        if cfg.learner.zero_stage == 3 or cfg.learner.num_ranks > 1:
            log.warning("periodic evaluation runs on rank 0 only and is skipped with ZeRO-3 or several ranks; "
                        "use `fleetrl eval` on a checkpoint's hf/ export instead")
            self.rows = []

    def __call__(self, module) -> dict[str, float]:
        if not self.rows:
            return {}
        from fleetrl.learner.sft import greedy_accuracy

        t0 = time.perf_counter()
        acc = greedy_accuracy(module, self.tokenizer, self.rows, self.max_new_tokens)
        return {"eval/accuracy": acc, "timing/eval_s": time.perf_counter() - t0}
