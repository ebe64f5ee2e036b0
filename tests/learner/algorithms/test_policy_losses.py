"""Policy losses and off-policy correction: hand-computed values, loop references, finiteness, metrics."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.config.algorithm import OffPolicyConfig, RlAlgorithm
from fleetrl.learner.algorithms import POLICY_LOSSES, LossInputs

METRIC_KEYS = {
    "actor/pg_loss",
    "actor/clipfrac",
    "actor/dual_clipfrac",
    "actor/approx_kl",
    "actor/ratio_min",
    "actor/ratio_mean",
    "actor/ratio_max",
    "off_policy/drift_kl",
    "off_policy/is_ess",
    "off_policy/is_weight_mean",
    "off_policy/is_capped_frac",
}
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OFF_POLICY = [
    ("none", "token"),
    ("tis", "token"),
    ("tis", "sequence"),
    ("decoupled", "token"),
    ("decoupled", "sequence"),
]


def _cfg(mode="none", level="token", cap=2.0, **kw) -> RlAlgorithm:
    return RlAlgorithm(off_policy=OffPolicyConfig(mode=mode, level=level, cap=cap), **kw)


def _inputs(ratio, adv, mask=None, old=None, behav=None) -> tuple[LossInputs, torch.Tensor]:
    """LossInputs whose pi_theta / pi_old equals ``ratio``; ``logp`` is returned as a leaf."""
    ratio, adv = torch.tensor(ratio, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
    old = torch.full_like(ratio, -1.0) if old is None else torch.tensor(old, dtype=torch.float64)
    behav = old.clone() if behav is None else torch.tensor(behav, dtype=torch.float64)
    mask = torch.ones_like(ratio, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    logp = (old + ratio.log()).requires_grad_(True)
    return LossInputs(logp=logp, old_logp=old, behav_logp=behav, adv=adv, mask=mask), logp


# ------------------------------------------------------------------------------ hand-computed


def test_ppo_clip_hand_computed():
    inp, logp = _inputs([[1.1, 1.5, 0.5, 0.5]], [[1.0, 1.0, -1.0, 2.0]])
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg())
    # eps = 0.2, per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.1, A=+1: max(-1.1, -1.1) = -1.1            (inside the clip range)
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  clipped
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  clipped
    #   r=0.5, A=+2: max(-1.0, -1.6) = -1.0            (pessimistic bound keeps the unclipped term)
    # token-mean: (-1.1 - 1.2 + 0.8 - 1.0) / 4 = -0.625
    assert out.loss.item() == pytest.approx(-0.625)
    assert out.metrics["actor/clipfrac"] == pytest.approx(0.5)
    assert out.metrics["actor/ratio_min"] == pytest.approx(0.5)
    assert out.metrics["actor/ratio_max"] == pytest.approx(1.5)
    assert out.metrics["actor/ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 0.5) / 4)
    out.loss.backward()
    # d/dlogp (-A r) / 4 = -A r / 4 on unclipped tokens, 0 on clipped ones: [-1.1/4, 0, 0, -2*0.5/4]
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.275, 0.0, 0.0, -0.25]], dtype=torch.float64))


def test_dual_clip_bounds_negative_advantages():
    inp, _ = _inputs([[5.0, 5.0]], [[-1.0, 1.0]])
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg(dual_clip=3.0))
    # r=5, A=-1: max(5, 1.2) = 5, then min(5, -c A = 3) = 3   (dual clip)
    # r=5, A=+1: max(-5, -1.2) = -1.2                        (dual clip only acts on A < 0)
    # mean: (3 - 1.2) / 2 = 0.9
    assert out.loss.item() == pytest.approx(0.9)
    assert out.metrics["actor/dual_clipfrac"] == pytest.approx(0.5)


def test_dapo_clips_higher_by_default_and_config_overrides():
    inp, _ = _inputs([[1.25, 0.75]], [[1.0, -1.0]])
    # ppo_clip (0.2/0.2): r=1.25 -> -1.2 (clipped); r=0.75, A=-1 -> max(0.75, 0.8) = 0.8;  mean -0.2
    assert POLICY_LOSSES["ppo_clip"](inp, _cfg()).loss.item() == pytest.approx(-0.2)
    # dapo (0.2/0.28): r=1.25 < 1.28 -> -1.25 (unclipped); 0.8 as before;  mean (-1.25 + 0.8) / 2 = -0.225
    assert POLICY_LOSSES["dapo"](inp, _cfg()).loss.item() == pytest.approx(-0.225)
    # clip_high 0.1 in the config wins over the default: -1.1 and 0.8 -> -0.15
    assert POLICY_LOSSES["dapo"](inp, _cfg(clip_high=0.1)).loss.item() == pytest.approx(-0.15)


def test_gspo_hand_computed_value_and_gradient():
    ratio = [[math.exp(0.1), math.exp(-0.3)], [math.exp(0.1), math.exp(-0.3)]]
    inp, logp = _inputs(ratio, [[1.0, 1.0], [-1.0, -1.0]])
    out = POLICY_LOSSES["gspo"](inp, _cfg(loss_agg="seq-mean-token-mean"))
    # log s_i = mean(0.1, -0.3) = -0.1 -> s = 0.904837 for both sequences; clip [1 - 3e-4, 1 + 4e-4]
    #   seq 0, A=+1: max(-0.904837, -0.9997) = -0.904837  (unclipped)
    #   seq 1, A=-1: max( 0.904837,  0.9997) =  0.9997    (clipped: the whole sequence)
    # seq-mean-token-mean: (-0.904837 + 0.9997) / 2 = 0.0474315
    s = math.exp(-0.1)
    assert out.loss.item() == pytest.approx((-s + 0.9997) / 2)
    assert out.metrics["actor/clipfrac"] == pytest.approx(0.5)
    assert out.metrics["actor/ratio_min"] == pytest.approx(s)
    out.loss.backward()
    # sequence form: d(-A s_i)/dlogp_t = -A s_i / |y_i|; times 1/2 for the mean over sequences:
    # seq 0: -0.904837 / 2 / 2 = -0.226209 per token; seq 1 is clipped -> 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 4, -s / 4], [0.0, 0.0]], dtype=torch.float64))


def test_tis_token_level_hand_computed():
    # ratio 1 everywhere (logp = old), A = 1: per-token objective -1
    inp, _ = _inputs([[1.0, 1.0]], [[1.0, 1.0]], old=[[-1.0, -1.0]], behav=[[-1.0 - math.log(3), -1.0 + math.log(2)]])
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg("tis", cap=2.0))
    # rho = pi_old / mu = [3, 0.5] -> w = min(rho, 2) = [2, 0.5];  loss = (-1*2 - 1*0.5) / 2 = -1.25
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.metrics["off_policy/is_weight_mean"] == pytest.approx(1.25)
    assert out.metrics["off_policy/is_capped_frac"] == pytest.approx(0.5)
    # ESS = (2 + 0.5)^2 / (2 * (4 + 0.25)) = 6.25 / 8.5 = 0.735294
    assert out.metrics["off_policy/is_ess"] == pytest.approx(6.25 / 8.5)


def test_tis_sequence_level_hand_computed():
    old = [[-1.0, -1.0], [-1.0, -1.0]]
    behav = [[-1.0 - math.log(3), -1.0 + math.log(2)], [-1.0 - math.log(3), -1.0]]
    inp, _ = _inputs([[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], old=old, behav=behav)
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg("tis", level="sequence", cap=2.0))
    # seq 0: rho = 3 * 0.5 = 1.5 -> w = 1.5 on both tokens;  seq 1: rho = 3 * 1 = 3 -> w = min(3, 2) = 2
    # token-mean: (-1.5 * 2 - 2 * 2) / 4 = -1.75
    assert out.loss.item() == pytest.approx(-1.75)


def test_decoupled_clips_against_proximal_and_drops_tokens_above_the_cap():
    # ratio pi_theta / pi_prox = 1.5 with A = 1 -> clipped to 1.2 (eps 0.2): per-token objective -1.2
    inp, _ = _inputs([[1.5, 1.5]], [[1.0, 1.0]], old=[[-1.0, -1.0]], behav=[[-1.0 - math.log(3), -1.0 + math.log(2)]])
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg("decoupled", cap=2.0))
    # w = pi_prox / mu = [3, 0.5]; 3 > cap -> token dropped (w = 0) but kept in the denominator (AReaL)
    # loss = (-1.2 * 0 - 1.2 * 0.5) / 2 = -0.3
    assert out.loss.item() == pytest.approx(-0.3)
    assert out.metrics["off_policy/is_weight_mean"] == pytest.approx(0.25)
    assert out.metrics["off_policy/is_capped_frac"] == pytest.approx(0.5)


def test_none_mode_ignores_behaviour_but_reports_the_mismatch():
    inp, _ = _inputs([[1.0, 1.0]], [[1.0, 1.0]], behav=[[-1.5, -0.5]])
    out = POLICY_LOSSES["ppo_clip"](inp, _cfg("none"))
    assert out.loss.item() == pytest.approx(-1.0)
    # raw rho = exp(-1 - (-1.5)), exp(-1 - (-0.5)) = e^0.5, e^-0.5; mean = cosh(0.5) = 1.127626
    assert out.metrics["off_policy/is_weight_mean"] == pytest.approx(math.cosh(0.5))
    # k3 KL(mu || pi_theta) per token: r = pi/mu = e^{0.5}, e^{-0.5};  (r - 1) - log r
    k3 = [(math.exp(x) - 1) - x for x in (0.5, -0.5)]
    assert out.metrics["off_policy/drift_kl"] == pytest.approx(sum(k3) / 2)


def test_weights_are_one_when_behaviour_equals_old():
    inp, _ = _inputs([[1.3, 0.7]], [[1.0, -0.5]])
    base = POLICY_LOSSES["ppo_clip"](inp, _cfg("none")).loss
    for mode, level in OFF_POLICY:
        out = POLICY_LOSSES["ppo_clip"](inp, _cfg(mode, level))
        assert out.loss.item() == pytest.approx(base.item())
        assert out.metrics["off_policy/is_ess"] == pytest.approx(1.0)
        # with mu = pi_old, the drift KL(mu || pi_theta) is the approx KL(pi_old || pi_theta)
        assert out.metrics["off_policy/drift_kl"] == pytest.approx(out.metrics["actor/approx_kl"])


# ------------------------------------------------------------------------------ loop reference


def _ragged(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    behav = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logp, old, behav, adv, mask


def _weight(mode, rho, cap):
    if mode == "none":
        return 1.0
    if mode == "tis":
        return min(rho, cap)
    return 0.0 if rho > cap else rho


def _aggregate_reference(losses, mode, norm_len):
    """``losses``: one list of token-loss tensors per non-empty sequence."""
    if mode == "token-mean":
        flat = [x for seq in losses for x in seq]
        return sum(flat) / len(flat) if flat else 0.0
    per_seq = {
        "seq-mean-token-sum": lambda seq: sum(seq),
        "seq-mean-token-mean": lambda seq: sum(seq) / len(seq),
        "seq-mean-token-sum-norm": lambda seq: sum(seq) / norm_len,
    }[mode]
    return sum(per_seq(seq) for seq in losses) / len(losses) if losses else 0.0


def _ppo_reference(logp, old, behav, adv, mask, cfg, clip, seq_ratio=False):
    """Plain Python per sequence and token, differentiable through ``logp`` element by element."""
    off = cfg.off_policy
    losses = []
    for i in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not idx:
            continue
        if seq_ratio:  # GSPO: geometric-mean ratio and geometric-mean behaviour weight
            mean_lr = sum(float(logp[i, t].detach() - old[i, t]) for t in idx) / len(idx)
            rho_seq = math.exp(sum(float(old[i, t] - behav[i, t]) for t in idx) / len(idx))
        elif off.level == "sequence":
            rho_seq = math.exp(sum(float(old[i, t] - behav[i, t]) for t in idx))
        seq = []
        for t in idx:
            if seq_ratio:
                ratio = math.exp(mean_lr) * torch.exp(logp[i, t] - logp[i, t].detach())
            else:
                ratio = torch.exp(logp[i, t] - old[i, t])
            a = float(adv[i, t])
            term = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip[0], 1 + clip[1]))
            rho = rho_seq if (seq_ratio or off.level == "sequence") else math.exp(float(old[i, t] - behav[i, t]))
            seq.append(term * _weight(off.mode, rho, off.cap))
        losses.append(seq)
    return _aggregate_reference(losses, cfg.loss_agg, cfg.loss_agg_norm_len)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(("mode", "level"), OFF_POLICY)
@pytest.mark.parametrize(("name", "clip"), [("ppo_clip", (0.2, 0.2)), ("dapo", (0.2, 0.28)), ("gspo", (3e-4, 4e-4))])
def test_matches_loop_reference(seed, agg, mode, level, name, clip):
    logp, old, behav, adv, mask = _ragged(seed)
    if name == "gspo":
        adv = adv[:, :1].expand_as(adv).contiguous()  # GSPO's advantages are per sequence
    cfg = _cfg(mode, level, cap=1.5, loss_agg=agg, loss_agg_norm_len=12)
    leaf = logp.clone().requires_grad_(True)
    out = POLICY_LOSSES[name](LossInputs(leaf, old, behav, adv, mask), cfg)
    ref_leaf = logp.clone().requires_grad_(True)
    expected = _ppo_reference(ref_leaf, old, behav, adv, mask, cfg, clip, seq_ratio=name == "gspo")
    expected_value = float(expected.detach()) if torch.is_tensor(expected) else expected
    assert out.loss.item() == pytest.approx(expected_value, rel=1e-9, abs=1e-12)
    if torch.is_tensor(expected) and expected.requires_grad:
        out.loss.backward()
        expected.backward()
        torch.testing.assert_close(leaf.grad, ref_leaf.grad)


# ------------------------------------------------------------------------------ robustness


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize(("mode", "level"), OFF_POLICY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_ratios_stay_finite(name, mode, level, dtype):
    # log pi - log pi_old and log pi_old - log mu of +-50, advantages of both signs, long sequences
    signs = torch.tensor([1.0, -1.0]).repeat(4, 50)
    old = torch.full((4, 100), -1.0, dtype=dtype)
    logp = (old + 50 * signs.to(dtype)).requires_grad_(True)
    behav = old - 50 * signs.flip(0).to(dtype)
    adv = torch.randn(4, 100).to(dtype)
    inp = LossInputs(logp, old, behav, adv, torch.ones(4, 100, dtype=torch.bool))
    out = POLICY_LOSSES[name](inp, _cfg(mode, level, dual_clip=3.0))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize(("mode", "level"), OFF_POLICY)
def test_metrics_keys_and_fully_masked_batch(name, mode, level):
    logp = torch.randn(2, 3, requires_grad=True)
    inp = LossInputs(logp, logp.detach(), logp.detach(), torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    out = POLICY_LOSSES[name](inp, _cfg(mode, level))
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
    assert set(out.metrics) == METRIC_KEYS
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize(("mode", "level"), OFF_POLICY)
def test_garbage_in_padding_does_not_reach_loss_or_gradient(name, mode, level):
    logp = torch.tensor([[-1.0, -math.inf, math.nan], [-0.5, -2.0, math.inf]], requires_grad=True)
    old = torch.tensor([[-1.1, math.nan, -math.inf], [-0.4, -2.1, math.nan]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    inp = LossInputs(logp, old, old.clone(), torch.tensor([[1.0, 0.0, 0.0], [-1.0, -1.0, 0.0]]), mask)
    out = POLICY_LOSSES[name](inp, _cfg(mode, level))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


def test_old_and_behaviour_log_probs_get_no_gradient():
    logp, old, behav, adv, mask = _ragged(1)
    old.requires_grad_(True)
    behav.requires_grad_(True)
    adv.requires_grad_(True)
    mask[0, 0] = True
    out = POLICY_LOSSES["ppo_clip"](LossInputs(logp.requires_grad_(True), old, behav, adv, mask), _cfg("tis"))
    out.loss.backward()
    assert old.grad is None and behav.grad is None and adv.grad is None


def test_gradcheck_ppo_clip_with_tis():
    logp, old, behav, adv, mask = _ragged(2)
    mask[0, 0] = True
    cfg = _cfg("tis", cap=1.5, dual_clip=3.0)
    fn = lambda x: POLICY_LOSSES["ppo_clip"](LossInputs(x, old, behav, adv, mask), cfg).loss  # noqa: E731
    assert torch.autograd.gradcheck(fn, (logp.requires_grad_(True),))
