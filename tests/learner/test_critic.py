"""PPO's critic on the tiny model: values at the right positions, the value loss falls, warmup, checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fleetrl.common.config import load_config
from fleetrl.learner.algorithms import ADV_ESTIMATORS
from fleetrl.learner.critic import Critic, explained_variance, load_value_model
from fleetrl.learner.runtime import init_distributed
from fleetrl.learner.train import Learner
from tests.learner.conftest import inproc_client, pack, samples, synthetic_groups

PPO = [
    "algorithm.adv_estimator=gae",
    "algorithm.lam=0.95",
    "algorithm.kl.placement=reward",
    "algorithm.kl.estimator=k1",
    "algorithm.kl.coef=0.05",
    "algorithm.critic.lr=1e-3",
]


def job(tiny_model_dir, tmp_path, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "learner.groups_per_step=4",
            "learner.lr=1e-2",
            "sync.transport=filesystem",
            f"run.dir={tmp_path}",
            "learner.max_tokens_per_microbatch=40",
            "checkpoint.interval=0",
            "learner.device=cpu",
            *PPO,
            *overrides,
        ],
    )


def values_of(critic, batch):
    critic.fill_values(batch)
    return batch.gather("values")


@pytest.fixture(scope="module")
def dist():
    return init_distributed(load_config(None, ["learner.device=cpu"]))


def test_values_come_from_the_hidden_state_that_predicts_each_token(dist, tiny_model_dir, tmp_path):
    critic = Critic(job(tiny_model_dir, tmp_path), torch.float32, dist.device)
    model = critic.engine.module
    torch.nn.init.normal_(model.v_head.weight, std=0.5)
    groups = synthetic_groups(3, seed=1)
    batch = pack(groups)
    values = values_of(critic, batch)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(
            samples(groups)
        ):  # one sample at a time: V_t from the state before token t
            p, n = len(prompt), len(response)
            ids = torch.from_numpy(np.concatenate([prompt, response]))[None]
            hidden = model.backbone(input_ids=ids).last_hidden_state[0]
            expected = model.v_head(hidden[p - 1 : p - 1 + n]).squeeze(-1)
            torch.testing.assert_close(values[i, :n], expected, atol=1e-5, rtol=1e-4)
            assert torch.all(values[i, n:] == 0)


def test_value_loss_falls_over_a_few_critic_steps_on_a_fixed_batch(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path)
    critic = Critic(cfg, torch.float32, dist.device)
    batch = pack(synthetic_groups(4, seed=2))
    token_rewards = torch.zeros(batch.mask.shape)
    token_rewards[torch.arange(batch.size), batch.lengths - 1] = batch.rewards  # outcome reward on the last token
    losses = []
    for _ in range(6):  # as successive learner steps on the same batch: re-valued by the current critic each time
        old_values = values_of(critic, batch)
        _, returns = ADV_ESTIMATORS["gae"](token_rewards, batch.mask, batch.group_index, old_values, cfg.algorithm)
        batch.scatter("returns", returns)
        stats = critic.update(batch.micro)
        losses.append(stats["critic/value_loss"])
        assert math.isfinite(stats["critic/grad_norm"]) and stats["critic/grad_norm"] > 0
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses


def test_packing_does_not_change_the_values(dist, tiny_model_dir, tmp_path):
    critic = Critic(job(tiny_model_dir, tmp_path), torch.float32, dist.device)
    torch.nn.init.normal_(critic.engine.module.v_head.weight, std=0.5)
    groups = synthetic_groups(4, seed=3)
    packed = pack(groups, max_tokens=40)
    whole = pack(groups, max_tokens=10**6)
    assert len(packed.micro) > 1 and len(whole.micro) == 1
    torch.testing.assert_close(values_of(critic, whole), values_of(critic, packed), atol=1e-5, rtol=1e-4)


def test_explained_variance():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # a constant prediction equal to the mean (3.0) explains nothing: Var(R - 3) = Var(R)
    assert explained_variance(torch.full_like(returns, 3.0), returns, mask) == pytest.approx(0.0, abs=1e-6)
    assert explained_variance(torch.zeros(2, 3), torch.ones(2, 3), mask) == 0.0  # nothing to explain


def test_ppo_step_warmup_then_policy_and_critic_train(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, "algorithm.critic.warmup_steps=1")
    client, _ = inproc_client(synthetic_groups(8))
    learner = Learner(cfg, tmp_path, client, dist)
    policy0 = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    head0 = learner.critic.engine.module.v_head.weight.detach().clone()
    first = learner.train_step()
    assert first["critic/warmup"] == 1.0 and "actor/pg_loss" not in first  # warmup: the critic only
    assert all(torch.equal(policy0[n], p) for n, p in learner.module.named_parameters())
    assert not torch.equal(head0, learner.critic.engine.module.v_head.weight)
    second = learner.train_step()
    assert second["critic/warmup"] == 0.0
    changed = [n for n, p in learner.module.named_parameters() if not torch.equal(policy0[n], p)]
    assert len(changed) == len(policy0)
    for key in (
        "critic/value_loss",
        "critic/vpred_mean",
        "critic/explained_variance",
        "critic/clipfrac",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/kl",
    ):
        assert math.isfinite(second[key]), key
    assert learner.version == 2
    learner.close()


def test_checkpoint_holds_the_critic_and_resume_restores_it(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path)
    probe = pack(synthetic_groups(2, seed=9))
    client, _ = inproc_client(synthetic_groups(12))
    first = Learner(cfg, tmp_path, client, dist)
    first.train_step()
    first.train_step()
    path = first.save()
    assert (path / "critic" / "mp_rank_00_model_states.pt").exists()
    saved = values_of(first.critic, probe)
    first.train_step()
    assert not torch.equal(values_of(first.critic, probe), saved)
    first.close()
    again = Learner(cfg, tmp_path, client, dist)
    again.resume(path)
    assert again.critic.steps == 2
    torch.testing.assert_close(values_of(again.critic, probe), saved, atol=0, rtol=0)
    again.close()


def test_value_head_is_loaded_from_a_reward_model(tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, config=config)
    torch.nn.init.normal_(rm.score.weight)
    rm.save_pretrained(tmp_path / "rm")
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"algorithm.critic.path={tmp_path / 'rm'}"])
    model = load_value_model(str(tmp_path / "rm"), cfg, torch.float32)
    torch.testing.assert_close(model.v_head.weight, rm.score.weight)
    fresh = load_value_model(tiny_model_dir, cfg, torch.float32)  # a causal LM: a new, zero head
    assert torch.all(fresh.v_head.weight == 0)
