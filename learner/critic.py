"""PPO's value model (``algorithm.adv_estimator: gae``): a scalar head on a copy of the policy's
architecture, trained by its own DeepSpeed engine inside the learner.

Shape legend: B samples, T response positions, b / L a micro-batch's samples / length, H hidden size.

    critic.fill_values(batch)                            # mb.values by the current critic, no grad
    adv, returns = ADV_ESTIMATORS["gae"](token_rewards, mask, group_index, batch.gather("values"), alg)
    for each mini-batch: actor update; critic.update(micro_batches)   # against mb.values, mb.returns
    critic.end_step(values, returns, mask)               # explained variance; counts warmup steps

V_t is read from the hidden state at the position whose logits predict response token t (the
micro-batch's ``logit_pos``): the state before token t is emitted, as the GAE recursion
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
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as tdist

from fleetrl.common.config.schema import JobConfig
from fleetrl.learner.algorithms import global_counts, masked_mean, value_loss
from fleetrl.learner.algorithms.common import masked_var
from fleetrl.learner.batch import MicroBatch, RolloutBatch
from fleetrl.learner.runtime import build_engine
from fleetrl.learner.update import Piece, accumulate_and_step, forward_passes

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
        hidden_bLH = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
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
    def __init__(self, cfg: JobConfig, dtype: torch.dtype, device: torch.device, clock=None):
        self.cfg, self.cc, self.device = cfg, cfg.algorithm.critic, device
        model = load_value_model(self.cc.path or cfg.model.path, cfg, dtype)
        self.engine, self.optimizer, self.scheduler = build_engine(model, cfg, dtype, lr=self.cc.lr, clock=clock)
        self.steps = 0  # learner steps this critic has trained on (for critic.warmup_steps)

    @property
    def warming_up(self) -> bool:
        """True while only the critic trains (the first ``critic.warmup_steps`` steps)."""
        return self.steps < self.cc.warmup_steps

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        return self.engine(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logit_pos=mb.logit_pos)

    def fill_values(self, batch: RolloutBatch) -> None:
        """``mb.values`` ``[b, T]``: V of every response token under the current critic (0 where masked)."""
        for mb, v in zip(batch.micro, forward_passes(self._forward, batch.micro, self.device)):
            mb.values = torch.where(mb.mask > 0, v, 0.0)

    def update(self, items: Sequence[MicroBatch]) -> dict[str, float]:
        """One critic optimizer step on ``items``: vf_coef x the clipped value loss (token-mean) against
        each micro-batch's ``values`` (the old predictions) and ``returns``, over the step's global token
        count (every micro-batch and rank, one all-reduce; the backward undoes DeepSpeed's rank average)."""
        t0 = time.perf_counter()
        _, total = global_counts([mb.mask for mb in items], self.device)
        denom = max(float(total[0]), 1.0)
        world = float(tdist.get_world_size()) if tdist.is_initialized() else 1.0

        def loss_fn(mb: MicroBatch) -> Piece:
            out = value_loss(self._forward(mb), mb.values, mb.returns, mb.mask, self.cc.cliprange_value, denom=denom)
            return Piece(self.cc.vf_coef * out.loss, mb.num_tokens / denom, out.metrics, grad_scale=world)

        result = accumulate_and_step(
            self.engine,
            items,
            loss_fn,
            self.device,
            self.cfg.learner.zero_stage,
            norm_key="critic/grad_norm",
            timing="timing/critic_",
        )
        result["timing/critic_update_s"] = time.perf_counter() - t0
        return result

    def end_step(self, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """Step-level metrics (of the values the advantages were computed with); counts the step."""
        warmup = self.warming_up
        self.steps += 1
        return {
            "critic/explained_variance": explained_variance(values, returns, mask),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/lr": float(self.engine.get_lr()[0]),
            "critic/warmup": float(warmup),
        }

    # ------------------------------------------------------------- checkpoints
    def save(self, checkpoint: Path) -> None:
        """Collective: the critic's DeepSpeed state into ``<checkpoint>/critic/``."""
        self.engine.save_checkpoint(str(checkpoint), tag=TAG, client_state={"steps": self.steps}, save_latest=False)

    def load(self, checkpoint: Path) -> None:
        """Collective: restore the critic saved with ``checkpoint``."""
        if not (Path(checkpoint) / TAG).is_dir():
            raise FileNotFoundError(
                f"checkpoint {checkpoint} holds no critic/ (was it written without "
                "adv_estimator: gae?); resume it with the algorithm it was trained with"
            )
        _, state = self.engine.load_checkpoint(
            str(checkpoint), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if state is None:
            raise RuntimeError(f"the critic in {checkpoint}/{TAG} could not be loaded by DeepSpeed")
        self.steps = int(state["steps"])
