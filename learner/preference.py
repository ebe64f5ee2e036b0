"""Offline DPO's data: preference pairs from ``data.preference`` as batches, and the held-out check.

A job with ``algorithm.type: dpo`` and ``data.preference`` set needs no rollout fleet and no
broker (``JobConfig.needs_fleet``): the learner reads the pairs itself.

- Files: .jsonl / .json / .parquet or a saved HF ``datasets`` directory, with the columns
  ``data.prompt_key``, ``data.chosen_key`` and ``data.rejected_key``. A prompt is text (wrapped in
  the tokenizer's chat template when ``data.apply_chat_template``) or a list of chat messages
  (always templated); it is left-truncated to ``data.max_prompt_tokens`` exactly as the rollout
  server encodes prompts. A response is text, or a list of chat messages whose last message is the
  response (the HF "conversational" preference format); it gets the tokenizer's eos appended and is
  cut at ``rollout.max_new_tokens`` tokens.
- Batches: ``learner.groups_per_step`` pairs per step across all ranks (each rank its share), in a
  per-epoch order shuffled with ``data.seed + epoch`` when ``data.shuffle``; after ``data.epochs``
  passes the run ends. The source hands the DPO step (learner/dpo.py) the pairs' token ids, which it
  packs into a ``PreferenceBatch`` like the online pairs. The cursor is saved in checkpoints and
  restored on resume.
- Held-out accuracy: the first ``run.eval_n`` pairs of ``data.preference_eval`` (``fleetrl
  init-data --task arithmetic-preference`` writes one next to the training file), every
  ``run.eval_interval`` steps on rank 0: ``dpo/heldout_accuracy`` is the share of pairs whose
  implicit reward beta (log pi - log pi_ref) is higher for the chosen response, the metric DPO
  optimises; ``dpo/heldout_policy_accuracy`` the share where the policy itself gives the chosen
  response the higher log-likelihood; ``dpo/heldout_margin`` the mean implicit-reward margin.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.common.data.tables import DataError, load_rows
from fleetrl.learner.batch import pack_pairs
from fleetrl.learner.source import Interrupted, Leased, share_of
from fleetrl.learner.update import forward_passes

log = logging.getLogger(__name__)


class PreferenceDataError(DataError):
    """The preference file cannot be read; the message names the file and the key to change."""


def _response_text(value: Any) -> str:
    """A response given as text, or as chat messages whose last one is the response."""
    if isinstance(value, list):
        return str(value[-1]["content"])
    return str(value)


def encode_pairs(rows: list[dict[str, Any]], tokenizer, cfg: JobConfig, source: str) -> list[tuple[list[int], ...]]:
    """(prompt ids, chosen ids + eos, rejected ids + eos) per row."""
    d = cfg.data
    if not rows:
        raise PreferenceDataError(f"{source}: no preference pairs")
    missing = [k for k in (d.prompt_key, d.chosen_key, d.rejected_key) if k not in rows[0]]
    if missing:
        raise PreferenceDataError(
            f"{source}: rows have no {missing} column(s) (columns: {sorted(rows[0])}); "
            "set data.prompt_key / data.chosen_key / data.rejected_key"
        )
    if d.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise PreferenceDataError(
            "data.apply_chat_template is true but the tokenizer has no chat template; "
            "set data.apply_chat_template=false"
        )
    limit = cfg.rollout.max_new_tokens
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = []
    for row in rows:
        prompt = row[d.prompt_key]
        if d.apply_chat_template or not isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])[-d.max_prompt_tokens :]
        encode = lambda v: (list(tokenizer(_response_text(v), add_special_tokens=False)["input_ids"]) + eos)[:limit]  # noqa: E731
        out.append((ids, encode(row[d.chosen_key]), encode(row[d.rejected_key])))
    return out


def load_tokenizer(cfg: JobConfig):
    from fleetrl.common.chat.tokenizer import job_tokenizer

    return job_tokenizer(cfg.model)


class PreferenceSource:
    """This rank's share of ``learner.groups_per_step`` pairs per step (same interface as BrokerBatchSource)."""

    def __init__(self, cfg: JobConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.pairs = encode_pairs(
            load_rows(cfg.data.preference, "data.preference", cfg.data), load_tokenizer(cfg), cfg, cfg.data.preference
        )
        self.per_step = cfg.learner.groups_per_step
        self.offset = sum(share_of(self.per_step, r, world) for r in range(rank))
        self.want = share_of(self.per_step, rank, world)
        self.epoch, self.cursor = 0, 0  # global position: the same on every rank
        self.order = self._order(0)
        log.info(
            "offline DPO: %d preference pairs from %s, %d per step", len(self.pairs), cfg.data.preference, self.per_step
        )

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.pairs)))
        if self.cfg.data.shuffle:
            random.Random(self.cfg.data.seed + epoch).shuffle(order)
        return order

    def _take(self, n: int) -> list[int]:
        """The next ``n`` pair indices of the global order (into the next epoch when this one ends)."""
        out = []
        while len(out) < n:
            if self.cursor >= len(self.order):
                self.epoch, self.cursor = self.epoch + 1, 0
                if self.epoch >= self.cfg.data.epochs:
                    log.info(
                        "offline DPO: data.epochs=%d passes over %s done",
                        self.cfg.data.epochs,
                        self.cfg.data.preference,
                    )
                    raise Interrupted()
                self.order = self._order(self.epoch)
            k = min(n - len(out), len(self.order) - self.cursor)
            out.extend(self.order[self.cursor : self.cursor + k])
            self.cursor += k
        return out

    def next(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> Leased:
        if should_stop():
            raise Interrupted()
        t0 = time.monotonic()
        state = (self.epoch, self.cursor, self.order)
        try:
            ids = self._take(self.per_step)[self.offset : self.offset + self.want]
        except Interrupted:
            self.epoch, self.cursor, self.order = state
            raise
        return Leased(
            groups=[],
            pairs=[self.pairs[i] for i in ids],
            pair_ids=[f"pref-e{self.epoch}-{i}" for i in ids],
            wait_s=time.monotonic() - t0,
        )

    def ack(self, leased: Leased, step: int) -> None:
        """Nothing to acknowledge: the data is local."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state:
            self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
            self.order = self._order(self.epoch)


class PreferenceEvaluator:
    """Held-out preference accuracy on rank 0 (module docstring); ``then`` adds another evaluator's metrics."""

    def __init__(self, cfg: JobConfig, ref_model, device: torch.device, then: Callable | None = None):
        self.cfg, self.ref, self.device, self.then = cfg, ref_model, device, then
        rows = load_rows(cfg.data.preference_eval, "data.preference_eval", cfg.data)[: cfg.run.eval_n]
        pairs = encode_pairs(rows, load_tokenizer(cfg), cfg, cfg.data.preference_eval)
        self.batch = pack_pairs(pairs, cfg.learner.max_tokens_per_microbatch, device)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.ref_sum: torch.Tensor | None = None  # the reference never changes: computed once
        if cfg.learner.zero_stage == 3 or cfg.learner.num_ranks > 1:
            log.warning("held-out preference accuracy runs on rank 0 only and is skipped with ZeRO-3 or several ranks")
            self.batch = None

    def _sums(self, model) -> torch.Tensor:
        """Summed log-probs ``[2P]``: the chosen responses of pairs 0..P-1, then their rejected ones."""
        from fleetrl.learner.dpo import sequence_sums

        if model is None:  # reference-free DPO: the reference counts as 0
            return torch.zeros(2 * self.batch.num_pairs, device=self.device)
        per_chunk = forward_passes(
            lambda c: sequence_sums(model, c.mb, self.temperature)[c.rows],
            self.batch.chunks,
            self.device,
            collective=False,
        )
        chosen = torch.cat([s[: c.n] for c, s in zip(self.batch.chunks, per_chunk)])
        rejected = torch.cat([s[c.n :] for c, s in zip(self.batch.chunks, per_chunk)])
        return torch.cat([chosen, rejected])

    def __call__(self, module) -> dict[str, float]:
        out = dict(self.then(module)) if self.then is not None else {}
        if self.batch is None:
            return out
        t0 = time.perf_counter()
        if self.ref_sum is None:
            self.ref_sum = self._sums(self.ref)
        module.eval()
        try:
            logp = self._sums(module)
        finally:
            module.train()
        beta, P = self.cfg.algorithm.beta, self.batch.num_pairs
        reward = beta * (logp - self.ref_sum)
        margin = reward[:P] - reward[P:]
        out.update(
            {
                "dpo/heldout_accuracy": float((margin > 0).float().mean()),
                "dpo/heldout_margin": float(margin.mean()),
                "dpo/heldout_policy_accuracy": float((logp[:P] > logp[P:]).float().mean()),
                "timing/preference_eval_s": time.perf_counter() - t0,
            }
        )
        return out
