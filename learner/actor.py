"""One optimizer step of the policy on a leased batch: log-probs, advantages, clipped losses.

Shape legend: B samples, T response positions, V vocabulary, b / L a micro-batch's samples / length.

    old, ref log-probs (no grad, only when needed) -> token rewards (+ KL penalty) -> advantages
    -> ppo_epochs x mini_batches x micro-batches of the policy loss -> engine.step()

With ``adv_estimator: gae`` the critic (learner/critic.py) values the batch before the advantages and
takes its own optimizer step next to each of the policy's; ``policy_loss: dpo`` uses learner/dpo.py.

Log-probs follow the rollout engines' convention: log_softmax(logits / temperature) over the full
vocabulary, so the importance ratio against the behaviour log-probs compares like with like.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as tdist

from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    aggregate,
    apply_kl_penalty,
    entropy_from_logits,
    kl_controller_from_config,
    masked_mean,
    overlong_penalty,
)
from fleetrl.learner.batch import Batch, MicroBatch, micro_batches


@dataclass
class ForwardOut:
    logp: torch.Tensor  # [b, T]
    entropy: torch.Tensor | None  # [b, T]


def response_logprobs(model, mb: MicroBatch, temperature: float, device: torch.device, entropy: bool) -> ForwardOut:
    """log pi(y_t | prompt, y_<t) of a micro-batch's response tokens (and the entropy there)."""
    input_ids = mb.input_ids.to(device)
    logits = model(input_ids=input_ids, attention_mask=mb.attention_mask.to(device), use_cache=False).logits
    pos = mb.logit_pos.to(device)
    logits_bTV = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
    if temperature > 0 and temperature != 1.0:
        logits_bTV = logits_bTV / temperature
    targets = torch.gather(input_ids, 1, (pos + 1).clamp(max=input_ids.shape[1] - 1))
    logp = torch.log_softmax(logits_bTV, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = entropy_from_logits(logits_bTV) if entropy else None
    return ForwardOut(logp, ent)


def _sync_max(n: int, device: torch.device) -> int:
    """The largest ``n`` over ranks: every rank runs as many forwards (ZeRO-3 gathers are collective)."""
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return n
    t = torch.tensor([n], device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


class Actor:
    def __init__(self, engine, ref_model, cfg: JobConfig, device: torch.device, generator: torch.Generator,
                 critic=None):
        self.engine, self.ref, self.cfg, self.device, self.gen = engine, ref_model, cfg, device, generator
        self.critic = critic  # learner/critic.py, with adv_estimator: gae
        alg = cfg.algorithm
        if alg.loss_agg_norm_len is None:  # seq-mean-token-sum-norm divides by a fixed length
            alg = msgspec.structs.replace(alg, loss_agg_norm_len=cfg.rollout.max_new_tokens)
        self.alg = alg
        self.adv_fn = ADV_ESTIMATORS[alg.adv_estimator]
        self.loss_fn = POLICY_LOSSES[alg.policy_loss]
        self.kl_fn = KL_ESTIMATORS[alg.kl.estimator] if alg.kl.placement != "none" else None
        self.kl_ctl = kl_controller_from_config(alg)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.max_tokens = cfg.learner.max_tokens_per_microbatch

    # ------------------------------------------------------------- no-grad passes
    @torch.no_grad()
    def _logprobs_all(self, model, batch: Batch) -> torch.Tensor:
        """log-probs ``[B, T]`` of every response under ``model`` (0 where masked)."""
        out = torch.zeros(batch.responses.shape)
        mbs = micro_batches(batch, torch.arange(batch.size), self.max_tokens)
        for k in range(_sync_max(len(mbs), self.device)):
            mb = mbs[min(k, len(mbs) - 1)]
            fwd = response_logprobs(model, mb, self.temperature, self.device, entropy=False)
            if k < len(mbs):
                out[mb.index, : mb.response_len] = fwd.logp.float().cpu()
        return out * batch.mask

    def needs_old_pass(self) -> bool:
        """Recompute pi_old before updating only when the weights change within the step or KL shapes rewards."""
        lc = self.cfg.learner
        return lc.ppo_epochs > 1 or lc.mini_batches > 1 or self.alg.kl.placement == "reward"

    # ------------------------------------------------------------- the step
    def token_rewards(self, batch: Batch, old: torch.Tensor | None, ref: torch.Tensor | None) -> torch.Tensor:
        """Outcome reward on each response's last token (+ overlong shaping, + per-token KL penalty)."""
        B, T = batch.responses.shape
        rewards = batch.rewards.clone()
        if self.alg.overlong.enabled:
            ol = self.alg.overlong
            rewards = rewards + overlong_penalty(batch.lengths, self.cfg.rollout.max_new_tokens, ol.buffer_len, ol.penalty)
        tok = torch.zeros(B, T)
        has = batch.lengths > 0
        tok[has.nonzero().squeeze(-1), (batch.lengths[has] - 1)] = rewards[has]
        if self.alg.kl.placement == "reward":
            tok = apply_kl_penalty(tok, self.kl_fn(old, ref), batch.mask, self.kl_ctl.value)
        return tok

    def step(self, batch: Batch, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        model = self.engine
        old = self._logprobs_all(model, batch) if self.needs_old_pass() else None
        ref = self._logprobs_all(self.ref, batch) if self.kl_fn is not None else None
        old_values = self.critic.values(batch) if self.critic is not None else None  # by the current critic
        t_fwd = time.perf_counter()
        token_rewards = self.token_rewards(batch, old, ref)
        adv, returns = self.adv_fn(token_rewards, batch.mask, batch.group_index, old_values, self.alg)
        train_policy = self.critic is None or not self.critic.warming_up  # critic.warmup_steps: critic only
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.cfg.learner.ppo_epochs):
            perm = torch.randperm(batch.size, generator=self.gen)
            for idx in perm.chunk(self.cfg.learner.mini_batches):
                updates = self._update(batch, idx, old, ref, adv) if train_policy else {}
                if self.critic is not None:  # the critic's update next to the policy's, on the same samples
                    updates.update(self.critic.update(batch, idx, old_values, returns))
                for name, value in updates.items():
                    metrics[name].append(value)
        out = {name: _reduce(name, values) for name, values in metrics.items()}
        if self.critic is not None:
            out.update(self.critic.end_step(old_values, returns, batch.mask))
        out.update(self._batch_metrics(batch, adv, version))
        out["timing/forward_s"] = t_fwd - t0
        out["timing/update_s"] = time.perf_counter() - t_fwd
        if self.kl_fn is not None:
            if "actor/kl" in out:  # critic warm-up steps leave the policy (and its KL) alone
                self.kl_ctl.update(out["actor/kl"], batch.size)
            out["actor/kl_coef"] = self.kl_ctl.value
        return out

    def _update(self, batch: Batch, idx: torch.Tensor, old, ref, adv) -> dict[str, float]:
        """One optimizer update on the samples ``idx``: micro-batches weighted to the mini-batch's aggregate."""
        mbs = micro_batches(batch, idx, self.max_tokens)
        per_token = self.alg.loss_agg == "token-mean"
        denom = float(batch.mask[idx].sum()) if per_token else float(len(idx))
        agg = lambda x, mask: aggregate(x, mask, self.alg.loss_agg, self.alg.loss_agg_norm_len)  # noqa: E731
        part: dict[str, list[tuple[float, float]]] = defaultdict(list)  # name -> [(value, share)]
        t_bwd = 0.0
        for k in range(_sync_max(len(mbs), self.device)):
            dummy = k >= len(mbs)
            mb = mbs[0] if dummy else mbs[k]
            sel, T = mb.index, mb.response_len
            fwd = response_logprobs(self.engine, mb, self.temperature, self.device, entropy=True)
            mask = batch.mask[sel, :T].to(self.device)
            old_mb = old[sel, :T].to(self.device) if old is not None else fwd.logp.detach()
            inp = LossInputs(logp=fwd.logp, old_logp=old_mb, behav_logp=batch.behav_logp[sel, :T].to(self.device),
                             adv=adv[sel, :T].to(self.device), mask=mask)
            out = self.loss_fn(inp, self.alg)
            loss, extra = out.loss, {}
            if ref is not None:
                kl = self.kl_fn(fwd.logp, ref[sel, :T].to(self.device))
                extra["actor/kl"] = float(masked_mean(kl.detach(), mask))
                if self.alg.kl.placement == "loss":
                    loss = loss + self.kl_ctl.value * agg(kl, mask)
            if self.alg.entropy_coef > 0:
                loss = loss - self.alg.entropy_coef * agg(fwd.entropy, mask)
            share = 0.0 if dummy else (float(mask.sum()) if per_token else float(len(sel))) / max(denom, 1.0)
            t = time.perf_counter()
            self.engine.backward(loss * share, scale_wrt_gas=False)
            t_bwd += time.perf_counter() - t
            if not dummy:
                extra["actor/loss"] = float(loss.detach())
                extra["actor/entropy"] = float(masked_mean(fwd.entropy.detach(), mask))
                for name, value in {**out.metrics, **extra}.items():
                    part[name].append((value, share))
        local_norm = self._local_grad_norm() if self.cfg.learner.zero_stage == 0 else None
        t = time.perf_counter()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        result = {name: _reduce(name, [v for v, _ in vs], [s for _, s in vs]) for name, vs in part.items()}
        result.update({"timing/step_s": time.perf_counter() - t, "timing/backward_s": t_bwd,
                       "actor/grad_norm": float(norm) if norm is not None else local_norm})
        return result

    def _local_grad_norm(self) -> float:
        """Norm of this rank's accumulated gradients before the step (ZeRO-0 keeps no global norm)."""
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def _batch_metrics(self, batch: Batch, adv: torch.Tensor, version: int) -> dict[str, float]:
        m = batch.mask
        lag = (version - batch.versions).clamp(min=0).float()
        valid = adv[m > 0]
        return {
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
            "reward/max": float(batch.rewards.max()),
            "reward/min": float(batch.rewards.min()),
            "adv/mean": float(masked_mean(adv, m)),
            "adv/abs_mean": float(masked_mean(adv.abs(), m)),
            "adv/max": float(valid.max()) if valid.numel() else 0.0,
            "adv/min": float(valid.min()) if valid.numel() else 0.0,
            "response/length_mean": float(batch.lengths.float().mean()),
            "response/length_max": float(batch.lengths.max()),
            "response/truncated_frac": float(batch.truncated.float().mean()),
            "off_policy/staleness_mean": float(lag.mean()),
            "off_policy/staleness_max": float(lag.max()),
            "actor/lr": float(self.engine.get_lr()[0]),
            "batch/samples": float(batch.size),
            "batch/groups": float(len(batch.group_ids)),
            "batch/tokens": float(batch.num_tokens),
        }


def _reduce(name: str, values: list[float], weights: list[float] | None = None) -> float:
    """Combine a metric over micro-batches or updates: min/max for extremes, else a (weighted) mean."""
    if name.endswith("_min"):
        return min(values)
    if name.endswith("_max"):
        return max(values)
    if weights is None:
        return sum(values) / len(values)
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else sum(values) / len(values)
