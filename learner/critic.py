"""PPO's value model (``algorithm.adv_estimator: gae``): a scalar head on a copy of the policy's
architecture, trained by its own DeepSpeed engine inside the learner.

Shape legend: B samples, T response positions, b / L a micro-batch's samples / length, H hidden size.

    values = critic.values(batch)                        # V [B, T] by the current critic, no grad
    adv, returns = ADV_ESTIMATORS["gae"](token_rewards, mask, group_index, values, alg)
    for each mini-batch: actor update; critic.update(batch, idx, values, returns)
    critic.end_step(values, returns, mask)               # explained variance; counts warmup steps

V_t is read from the hidden state at the position whose logits predict response token t (the
batch's ``logit_pos``): the state before token t is emitted, as the GAE recursion
delta_t = r_t + gamma V_{t+1} - V_t needs. Values are computed for every leased batch by the current
critic, so stale samples are valued by today's critic, not the one that was current when they were
generated.

Initialisation: the backbone of ``critic.path`` (default ``model.path``; ``AutoModel`` loads the base
model out of a causal-LM checkpoint). The head is zero (V = 0 at the start) unless that checkpoint
holds a one-output ``score`` (an HF ``*ForSequenceClassification`` reward model) or ``v_head``
layer, which is then loaded: a reward model is a common critic initialisation.

Training: the clipped value loss (``value_loss``, token-mean over the mini-batch) times
``critic.vf_coef``, AdamW at ``critic.lr`` with the learner's schedule, and the learner's gradient
clipping. The first ``critic.warmup_steps`` learner steps train only the critic.

Checkpoints: the critic engine saves into ``<checkpoint>/critic/`` (weights, optimizer, scheduler,
its step count) before the checkpoint's meta.json is written; resume and rollback restore it with
the policy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.actor import _reduce, _sync_max
from fleetrl.learner.algorithms import masked_mean, value_loss
from fleetrl.learner.algorithms.common import masked_var
from fleetrl.learner.batch import Batch, MicroBatch, micro_batches
from fleetrl.learner.runtime import build_engine

HEAD_NAMES = ("score.weight", "v_head.weight", "v_head.summary.weight")
TAG = "critic"


class ValueModel(torch.nn.Module):
    """Backbone (the policy's architecture without its LM head) + a linear head to one value."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.backbone = backbone
        self.v_head = torch.nn.Linear(hidden_size, 1, bias=True, dtype=dtype)
        torch.nn.init.zeros_(self.v_head.weight)
        torch.nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logit_pos: torch.Tensor) -> torch.Tensor:
        """Values ``[b, T]`` (float32) at the positions ``logit_pos`` ``[b, T]``."""
        hidden_bLH = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        hidden_bTH = torch.gather(hidden_bLH, 1, logit_pos.unsqueeze(-1).expand(-1, -1, hidden_bLH.shape[-1]))
        return self.v_head(hidden_bTH).squeeze(-1).float()


def _saved_head(path: str, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [1, H], bias or None) of a one-output value/score head stored in ``path``, if any."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys = set(st.keys())
            for name in HEAD_NAMES:
                if name in keys and list(st.get_slice(name).get_shape()) == [1, hidden_size]:
                    bias = name.removesuffix("weight") + "bias"
                    return st.get_tensor(name), st.get_tensor(bias) if bias in keys else None
    return None


def load_value_model(path: str, cfg: JobConfig, dtype: torch.dtype) -> ValueModel:
    from transformers import AutoConfig, AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)
    if cfg.model.gradient_checkpointing:
        backbone.gradient_checkpointing_enable()
    hidden = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code).hidden_size
    model = ValueModel(backbone, hidden, dtype)
    head = _saved_head(path, hidden)
    if head is not None:
        with torch.no_grad():
            model.v_head.weight.copy_(head[0])
            if head[1] is not None:
                model.v_head.bias.copy_(head[1])
    return model


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens: 1 = perfect, 0 = no better than a constant, < 0 worse.

    0 when the returns do not vary (nothing to explain).
    """
    var_r = masked_var(returns, mask)
    if float(var_r) <= 0:
        return 0.0
    return float(1.0 - masked_var(returns - values, mask) / var_r)


class Critic:
    def __init__(self, cfg: JobConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.cc, self.device = cfg, cfg.algorithm.critic, device
        model = load_value_model(self.cc.path or cfg.model.path, cfg, dtype)
        self.engine, self.optimizer, self.scheduler = build_engine(model, cfg, dtype, lr=self.cc.lr)
        self.max_tokens = cfg.learner.max_tokens_per_microbatch
        self.steps = 0  # learner steps this critic has trained on (for critic.warmup_steps)

    @property
    def warming_up(self) -> bool:
        """True while only the critic trains (the first ``critic.warmup_steps`` steps)."""
        return self.steps < self.cc.warmup_steps

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        return self.engine(input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device),
                           logit_pos=mb.logit_pos.to(self.device))

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """V ``[B, T]`` of every response token under the current critic (0 where masked)."""
        out = torch.zeros(batch.responses.shape)
        mbs = micro_batches(batch, torch.arange(batch.size), self.max_tokens)
        for k in range(_sync_max(len(mbs), self.device)):
            mb = mbs[min(k, len(mbs) - 1)]
            v = self._forward(mb)
            if k < len(mbs):
                out[mb.index, : mb.response_len] = v.cpu()
        return out * batch.mask

    def update(self, batch: Batch, idx: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """One critic optimizer step on samples ``idx``: vf_coef x the clipped value loss (token-mean)."""
        t0 = time.perf_counter()
        mbs = micro_batches(batch, idx, self.max_tokens)
        denom = max(float(batch.mask[idx].sum()), 1.0)
        part: dict[str, list[tuple[float, float]]] = {}
        for k in range(_sync_max(len(mbs), self.device)):
            dummy = k >= len(mbs)
            mb = mbs[0] if dummy else mbs[k]
            sel, T = mb.index, mb.response_len
            mask = batch.mask[sel, :T].to(self.device)
            out = value_loss(self._forward(mb), old_values[sel, :T].to(self.device), returns[sel, :T].to(self.device),
                             mask, self.cc.cliprange_value)
            share = 0.0 if dummy else float(mask.sum()) / denom
            self.engine.backward(self.cc.vf_coef * out.loss * share, scale_wrt_gas=False)
            if not dummy:
                for name, value in out.metrics.items():
                    part.setdefault(name, []).append((value, share))
        local_norm = self._local_grad_norm() if self.cfg.learner.zero_stage == 0 else None  # ZeRO-0: no global norm
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = local_norm if norm is None else float(norm)
        result = {name: _reduce(name, [v for v, _ in vs], [s for _, s in vs]) for name, vs in part.items()}
        result.update({"critic/grad_norm": float(norm), "timing/critic_update_s": time.perf_counter() - t0})
        return result

    def _local_grad_norm(self) -> float:
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def end_step(self, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """Step-level metrics (of the values the advantages were computed with); counts the step."""
        warmup = self.warming_up
        self.steps += 1
        return {"critic/explained_variance": explained_variance(values, returns, mask),
                "critic/returns_mean": float(masked_mean(returns, mask)),
                "critic/lr": float(self.engine.get_lr()[0]), "critic/warmup": float(warmup)}

    # ------------------------------------------------------------- checkpoints
    def save(self, checkpoint: Path) -> None:
        """Collective: the critic's DeepSpeed state into ``<checkpoint>/critic/``."""
        self.engine.save_checkpoint(str(checkpoint), tag=TAG, client_state={"steps": self.steps}, save_latest=False)

    def load(self, checkpoint: Path) -> None:
        """Collective: restore the critic saved with ``checkpoint``."""
        if not (Path(checkpoint) / TAG).is_dir():
            raise FileNotFoundError(f"checkpoint {checkpoint} holds no critic/ (was it written without "
                                    "adv_estimator: gae?); resume it with the algorithm it was trained with")
        _, state = self.engine.load_checkpoint(str(checkpoint), tag=TAG, load_optimizer_states=True,
                                               load_lr_scheduler_states=True)
        if state is None:
            raise RuntimeError(f"the critic in {checkpoint}/{TAG} could not be loaded by DeepSpeed")
        self.steps = int(state["steps"])
