"""The ``rl`` objective's step: old / reference log-probs, token rewards, advantages, clipped losses.

Shape legend: B samples, T response positions, b a micro-batch's samples.

    batch = actor.plan(leased)          # packed once on the device (learner/batch.py)
    stats = actor.step(batch, version)  # the passes below, all over the same micro-batches

    old, ref log-probs (no grad, only when needed) and the critic's values -> token rewards (+ KL
    penalty) -> advantages ([B, T]) -> ppo_epochs x mini_batches updates, each the share-weighted
    policy loss of its micro-batches (learner/update.py) -> engine.step()

With ``adv_estimator: gae`` the critic (learner/critic.py) values the batch before the advantages and
takes its own optimizer step next to each of the policy's. Mini-batches are groups of whole
micro-batches: epoch 0 takes them in the planned order, later epochs in a fresh order each.
"""

from __future__ import annotations

import time
from collections import defaultdict

import msgspec
import torch
import torch.distributed as tdist

from fleetrl.common.config.algorithm import RlAlgorithm
from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    aggregate,
    apply_kl_penalty,
    global_counts,
    kl_controller_from_config,
    masked_mean,
    overlong_penalty,
    per_token,
)
from fleetrl.learner.algorithms.kl import KL_ESTIMATORS, kl_loss
from fleetrl.learner.algorithms.off_policy import mismatch_sums
from fleetrl.learner.batch import MicroBatch, RolloutBatch, pack_groups
from fleetrl.learner.metrics import diversity_metrics, sample_metrics
from fleetrl.learner.source import Leased
from fleetrl.learner.update import Piece, accumulate_and_step, forward_passes, reduce_updates, response_logprobs


class PolicyActor:
    def __init__(
        self, engine, ref_model, cfg: JobConfig, device: torch.device, generator: torch.Generator, critic=None
    ):
        self.engine, self.ref, self.cfg, self.device, self.gen = engine, ref_model, cfg, device, generator
        self.critic = critic  # learner/critic.py, with adv_estimator: gae
        alg: RlAlgorithm = cfg.algorithm  # type: ignore[assignment]
        if alg.loss_agg_norm_len is None:  # seq-mean-token-sum-norm divides by a fixed length
            alg = msgspec.structs.replace(alg, loss_agg_norm_len=cfg.rollout.max_new_tokens)
        self.alg = alg
        self.adv_fn = ADV_ESTIMATORS[alg.adv_estimator]
        self.loss_fn = POLICY_LOSSES[alg.policy_loss]
        self.kl_on = alg.kl.placement != "none"
        self.kl_ctl = kl_controller_from_config(alg)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.zero_stage = cfg.learner.zero_stage

    # ------------------------------------------------------------- planning and no-grad passes
    def plan(self, leased: Leased) -> RolloutBatch:
        """Pack the leased groups once, taking samples in an order drawn from the learner's generator."""
        n = sum(g.num_responses for g in leased.groups)
        order = torch.randperm(n, generator=self.gen)
        return pack_groups(
            leased.groups,
            self.cfg.learner.max_tokens_per_microbatch,
            self.device,
            order,
            min_micro=self.cfg.learner.mini_batches,
            # gradient checkpointing keeps no cache: one forward per row then
            share_prompts=self.cfg.learner.shared_prompts and not self.cfg.model.gradient_checkpointing,
        )

    def needs_old_pass(self) -> bool:
        """Recompute pi_old before updating only when the weights change within the step or KL shapes rewards."""
        lc = self.cfg.learner
        return lc.ppo_epochs > 1 or lc.mini_batches > 1 or self.alg.kl.placement == "reward"

    def _fill_logprobs(self, model, batch: RolloutBatch, name: str) -> None:
        def one(mb: MicroBatch) -> torch.Tensor:
            return response_logprobs(model, mb, self.temperature)[0]

        for mb, logp in zip(batch.micro, forward_passes(one, batch.micro, self.device)):
            setattr(mb, name, torch.where(mb.mask > 0, logp.float(), 0.0))

    def token_rewards(self, batch: RolloutBatch) -> torch.Tensor:
        """Outcome reward on each sample's last trained token (+ overlong shaping, + per-token KL penalty)."""
        rewards = batch.rewards.clone()
        if self.alg.overlong.enabled:
            ol = self.alg.overlong
            rewards = rewards + overlong_penalty(
                batch.lengths, self.cfg.rollout.max_new_tokens, ol.buffer_len, ol.penalty
            )
        tok = torch.zeros_like(batch.mask)
        has = (batch.last >= 0).nonzero().squeeze(-1)
        tok[has, batch.last[has]] = rewards[has]
        if self.alg.kl.placement == "reward":
            kl = KL_ESTIMATORS[self.alg.kl.estimator](batch.gather("old_logp"), batch.gather("ref_logp"))
            tok = apply_kl_penalty(tok, kl, batch.mask, self.kl_ctl.value)
        return tok

    # ------------------------------------------------------------- the step
    def step(self, batch: RolloutBatch, version: int, pristine: bool = True) -> dict[str, float]:
        """One optimizer step on ``batch``. ``version``: the newest policy version the learner published;
        ``pristine``: the weights being trained are exactly those of ``version`` (no update since the publish),
        so the engine mismatch can be measured on the tokens ``version`` sampled."""
        t0 = time.perf_counter()
        if self.needs_old_pass():
            self._fill_logprobs(self.engine, batch, "old_logp")
        if self.kl_on:
            self._fill_logprobs(self.ref, batch, "ref_logp")
        if self.critic is not None:
            self.critic.fill_values(batch)  # by the current critic
        t_fwd = time.perf_counter()
        values = batch.gather("values") if self.critic is not None else None
        adv, returns = self.adv_fn(
            self.token_rewards(batch), batch.mask, batch.group_index, values, self.alg, baselines_B=batch.baselines
        )
        batch.scatter("adv", adv)
        batch.scatter("returns", returns)
        train_policy = self.critic is None or not self.critic.warming_up  # critic.warmup_steps: critic only
        metrics: dict[str, list[float]] = defaultdict(list)
        mismatch = MismatchMeter(version if pristine else None, self.device)
        for epoch in range(self.cfg.learner.ppo_epochs):
            order = (
                torch.arange(len(batch.micro)) if epoch == 0 else torch.randperm(len(batch.micro), generator=self.gen)
            )
            for chunk in torch.tensor_split(order, min(self.cfg.learner.mini_batches, len(batch.micro))):
                items = [batch.micro[i] for i in chunk.tolist()]
                updates = self._update(items, mismatch if epoch == 0 else None) if train_policy else {}
                if self.critic is not None:  # the critic's update next to the policy's, on the same samples
                    updates.update(self.critic.update(items))
                for name, value in updates.items():
                    metrics[name].append(value)
        out = reduce_updates(metrics)
        out.update(mismatch.metrics(batch.num_tokens))
        if self.critic is not None:
            out.update(self.critic.end_step(values, returns, batch.mask))
        out.update(self._batch_metrics(batch, adv, version))
        out["timing/forward_s"] = t_fwd - t0
        out["timing/update_s"] = time.perf_counter() - t_fwd
        if self.kl_on:
            if "actor/kl" in out:  # critic warm-up steps leave the policy (and its KL) alone
                self.kl_ctl.update(out["actor/kl"], batch.size)
            out["actor/kl_coef"] = self.kl_ctl.value
        return out

    def _update(self, items: list[MicroBatch], mismatch: MismatchMeter | None = None) -> dict[str, float]:
        """One optimizer update on ``items``: every loss term divides by the step's global count (tokens for
        ``token-mean``, non-empty sequences for the ``seq-mean-*`` modes) over these micro-batches and every
        rank's, summed by one all-reduce before the backward passes; the backward multiplies by the world
        size, which undoes DeepSpeed's average over ranks, so the step's gradient is that of the whole
        batch's aggregate. The first epoch's log-probs before any update also feed the engine-mismatch meter."""
        alg = self.alg
        col = 0 if per_token(alg.loss_agg) else 1  # which count the aggregation divides by
        local, total = global_counts([mb.mask for mb in items], self.device)  # one all-reduce, before any backward
        rows = torch.stack([*(c.to(total.device) for c in local), total]).tolist()  # one device sync
        own = {id(mb): row[col] for mb, row in zip(items, rows)}
        denom = max(rows[-1][col], 1.0)  # tokens or sequences of the whole step: every micro-batch, every rank
        world = float(tdist.get_world_size()) if tdist.is_initialized() else 1.0  # DeepSpeed averages over ranks

        def loss_fn(mb: MicroBatch) -> Piece:
            logp, entropy = response_logprobs(
                self.engine, mb, self.temperature, entropy=True if alg.entropy_coef > 0 else "metric"
            )
            old = mb.old_logp if mb.old_logp is not None else logp.detach()
            if mismatch is not None:  # old: the weights as published (recomputed before the step, or no update yet)
                mismatch.add(old, mb)
            out = self.loss_fn(
                LossInputs(
                    logp=logp, old_logp=old, behav_logp=mb.behav_logp, adv=mb.adv, mask=mb.mask, agg_denom=denom
                ),
                alg,
            )
            loss, extra = out.loss, {}
            if self.kl_on:
                kl_term, kl = kl_loss(
                    logp, mb.ref_logp, mb.mask, alg.kl.estimator, alg.loss_agg, alg.loss_agg_norm_len, denom
                )
                extra["actor/kl"] = float(masked_mean(kl.detach(), mb.mask))
                if alg.kl.placement == "loss":
                    loss = loss + self.kl_ctl.value * kl_term
            if alg.entropy_coef > 0:
                loss = loss - alg.entropy_coef * aggregate(entropy, mb.mask, alg.loss_agg, alg.loss_agg_norm_len, denom)
            n = own[id(mb)]
            # the loss is this micro-batch's part of the step's aggregate; its metric is its own aggregate
            extra["actor/loss"] = float(loss.detach()) * denom / max(n, 1.0)
            extra["actor/entropy"] = float(masked_mean(entropy.detach(), mb.mask))
            return Piece(loss, n / denom, {**out.metrics, **extra}, grad_scale=world)

        return accumulate_and_step(self.engine, items, loss_fn, self.device, self.zero_stage)

    def _batch_metrics(self, batch: RolloutBatch, adv: torch.Tensor, version: int) -> dict[str, float]:
        m = batch.mask
        valid = adv[m > 0]
        return {
            **sample_metrics(batch.rewards, batch.lengths, batch.truncated, batch.versions, version),
            **diversity_metrics(*sampled_responses(batch)),
            "adv/mean": float(masked_mean(adv, m)),
            "adv/abs_mean": float(masked_mean(adv.abs(), m)),
            "adv/max": float(valid.max()) if valid.numel() else 0.0,
            "adv/min": float(valid.min()) if valid.numel() else 0.0,
            "actor/lr": float(self.engine.get_lr()[0]),
            "batch/samples": float(batch.size),
            "batch/groups": float(len(batch.group_ids)),
            "batch/tokens": float(batch.num_tokens),
        }

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])


def sampled_responses(batch: RolloutBatch) -> tuple[list[tuple[int, ...]], list[int]]:
    """Each sample's sampled tokens (loss mask 1: tokens an environment appended are left out) and its group."""
    responses: list[tuple[int, ...]] = [()] * batch.size
    for mb in batch.micro:
        targets, mask = mb.targets.cpu(), mb.mask.cpu() > 0
        for row, i in enumerate(mb.index.tolist()):
            responses[i] = tuple(targets[row][mask[row]].tolist())
    return responses, batch.group_index.cpu().tolist()


class MismatchMeter:
    """``off_policy/mismatch_kl``: the engine mismatch over the samples that the learner's published version
    sampled from start to end (``mismatch_sums``), summed over micro-batches and ranks (one all-reduce) before dividing, so every rank reports the
    same value. Absent when no such token was trained this step (all were stale, or the weights changed
    since the publish: ``sync.interval`` > 1). ``off_policy/fresh_token_frac`` is the share it was taken over.
    """

    def __init__(self, version: int | None, device: torch.device):
        self.version, self.device = version, device
        self.kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.seen: set[int] = set()  # a dummy pass (ranks matched under ZeRO-3) repeats a micro-batch

    def add(self, old_logp: torch.Tensor, mb: MicroBatch) -> None:
        if self.version is None or mb.token_versions is None or id(mb) in self.seen:
            return
        self.seen.add(id(mb))
        kl, n = mismatch_sums(old_logp, mb.behav_logp, mb.mask, mb.token_versions, self.version)
        self.kl_sum += kl.double()
        self.count += n.double()

    def metrics(self, num_tokens: int) -> dict[str, float]:
        t = torch.stack(
            [self.kl_sum, self.count, torch.tensor(float(num_tokens), dtype=torch.float64, device=self.device)]
        )
        if tdist.is_initialized() and tdist.get_world_size() > 1:  # every rank calls step(): collective-safe
            tdist.all_reduce(t)
        kl_sum, count, total = t.tolist()
        out = {"off_policy/fresh_token_frac": count / total if total else 0.0}
        if count > 0:
            out["off_policy/mismatch_kl"] = kl_sum / count
        return out
