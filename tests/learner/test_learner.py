"""One-process learner on the tiny model with an in-process broker: steps, algorithms, resume."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.common.config import ConfigError, load_config
from fleetrl.learner.batch import plan_micro_batches
from fleetrl.learner.runtime import init_distributed
from fleetrl.learner.source import Leased
from fleetrl.learner.train import Learner
from tests.learner.conftest import inproc_client, pack, samples, synthetic_groups

ALGOS = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "drgrpo": ["algorithm.adv_estimator=drgrpo", "algorithm.loss_agg=seq-mean-token-sum-norm"],
    "dapo": [
        "algorithm.adv_estimator=grpo",
        "algorithm.policy_loss=dapo",
        "algorithm.dynamic_sampling=true",
        "algorithm.overlong.enabled=true",
        "algorithm.overlong.buffer_len=2",
        "rollout.max_new_tokens=6",
    ],
    "gspo": ["algorithm.adv_estimator=grpo", "algorithm.policy_loss=gspo", "algorithm.loss_agg=seq-mean-token-mean"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": [
        "algorithm.adv_estimator=reinforce_pp",
        "algorithm.kl.placement=reward",
        "algorithm.kl.estimator=k1",
    ],
}


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
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def dist():
    return init_distributed(load_config(None, ["learner.device=cpu"]))


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_every_parameter_changes_after_a_step(algo, dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, *ALGOS[algo])
    client, _ = inproc_client(synthetic_groups(8))
    learner = Learner(cfg, tmp_path, client, dist)
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    stats = learner.train_step()
    unchanged = [n for n, p in learner.module.named_parameters() if torch.equal(before[n], p.detach())]
    assert not unchanged, f"{algo}: parameters that did not change: {unchanged}"
    assert all(math.isfinite(v) for v in stats.values()), {k: v for k, v in stats.items() if not math.isfinite(v)}
    assert stats["batch/samples"] == 16 and learner.version == 1 and learner.step == 1
    assert (tmp_path / "weights" / "v1" / "model.safetensors").exists()  # published for the fleet
    learner.close()


def test_off_policy_batch_gives_finite_loss_and_is_metrics(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, "algorithm.off_policy.mode=tis", "algorithm.off_policy.cap=2.0")
    client, _ = inproc_client(synthetic_groups(4, logp=-9.0))  # mu far from the tiny policy
    learner = Learner(cfg, tmp_path, client, dist)
    stats = learner.train_step()
    assert math.isfinite(stats["actor/loss"]) and math.isfinite(stats["actor/grad_norm"])
    assert stats["off_policy/drift_kl"] > 0.1
    # the groups are version 0, the weights being trained: the gap is engine mismatch, measured on every token
    assert stats["off_policy/mismatch_kl"] > 0.1 and stats["off_policy/fresh_token_frac"] == 1.0
    assert 0 < stats["off_policy/is_ess"] <= 1 and stats["off_policy/is_capped_frac"] > 0.5
    assert stats["off_policy/is_weight_mean"] <= 2.0 + 1e-6  # truncated at the cap
    learner.close()


def _spanning(groups, first, rest=None):
    """The same groups with each response's first token tagged ``first`` and the others ``rest`` (default
    ``first``): ``first < rest`` is a response sampled across an in-flight update."""
    import msgspec
    import numpy as np

    rest = first if rest is None else rest
    out = []
    for g in groups:
        offsets = g.offsets()
        tv = np.full(offsets[-1], rest, dtype=np.int32)
        tv[np.asarray(offsets[:-1])] = first
        out.append(msgspec.structs.replace(g, policy_version=int(tv.min()), token_versions=tv.tobytes()))
    return out


def test_mismatch_counts_only_tokens_of_the_trained_version_and_drift_counts_all(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, "algorithm.off_policy.mode=tis")
    learner = Learner(cfg, tmp_path, inproc_client([])[0], dist)
    groups = synthetic_groups(4, logp=-9.0)  # mu far from the tiny policy: large KL on any token it is taken over
    stale = learner.actor.step(learner.actor.plan(Leased(groups=_spanning(groups, 1))), 2)
    assert "off_policy/mismatch_kl" not in stale and stale["off_policy/fresh_token_frac"] == 0.0  # all drift
    assert stale["off_policy/drift_kl"] > 0.1
    spanning = learner.actor.step(learner.actor.plan(Leased(groups=_spanning(groups, 1, 2))), 2)
    assert "off_policy/mismatch_kl" not in spanning  # across an update: its version-2 tokens saw version 1's KV
    mixed = learner.actor.step(
        learner.actor.plan(Leased(groups=_spanning(groups[:2], 2) + _spanning(groups[2:], 1))), 2
    )
    assert 0.2 < mixed["off_policy/fresh_token_frac"] < 0.8 and mixed["off_policy/mismatch_kl"] > 0.1
    moved = learner.actor.step(learner.actor.plan(Leased(groups=_spanning(groups, 2))), 2, pristine=False)
    assert "off_policy/mismatch_kl" not in moved  # the weights changed since version 2 was published
    learner.close()


def test_the_learner_measures_mismatch_only_while_its_weights_are_the_published_ones(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, "sync.interval=2")
    client, _ = inproc_client(synthetic_groups(8))
    learner = Learner(cfg, tmp_path, client, dist)
    first, second = learner.train_step(), learner.train_step()
    assert "off_policy/mismatch_kl" in first  # version 0 sampled, version 0's weights trained
    assert "off_policy/mismatch_kl" not in second and learner.version == 1  # one update since: nothing to compare
    assert learner.pristine  # published after step 2
    learner.close()


def test_async_without_correction_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="algorithm.off_policy.mode=tis"):
        load_config(None, [f"model.path={tiny_model_dir}", "broker.max_staleness=1", "algorithm.off_policy.mode=none"])


def test_micro_batches_respect_the_token_budget_and_cover_every_sample():
    groups = synthetic_groups(6)
    batch = pack(groups, max_tokens=30)
    seqs = samples(groups)
    assert sorted(i for mb in batch.micro for i in mb.index.tolist()) == list(range(batch.size))
    for mb in batch.micro:
        b, L = mb.input_ids.shape
        assert b * L <= 30 or b == 1
        for row, i in enumerate(mb.index.tolist()):  # logits at logit_pos predict the response tokens
            response = torch.from_numpy(seqs[i][1])
            n = len(response)
            assert torch.equal(mb.input_ids[row, mb.logit_pos[row, :n] + 1], response)
            assert torch.equal(mb.targets[row, :n], response) and mb.mask[row, :n].sum() == n


def test_planning_takes_samples_in_order_then_sorts_by_length():
    assert plan_micro_batches([5, 3, 5, 2], [2, 0, 1, 3], max_tokens=10) == [[3, 1], [2, 0]]
    assert plan_micro_batches([12, 3], [0, 1], max_tokens=10) == [[1], [0]]  # too long for the budget: alone


def test_mini_batches_get_a_micro_batch_each_and_every_pass_reuses_them(dist, tiny_model_dir, tmp_path):
    cfg = job(
        tiny_model_dir,
        tmp_path,
        "learner.ppo_epochs=2",
        "learner.mini_batches=3",
        "learner.max_tokens_per_microbatch=100000",
    )  # the budget alone would give one micro-batch
    client, _ = inproc_client(synthetic_groups(8))
    learner = Learner(cfg, tmp_path, client, dist)
    batch = learner.actor.plan(learner.source.next(1))
    assert len(batch.micro) >= 3
    stats = learner.actor.step(batch, 0)
    assert all(
        mb.old_logp is not None and mb.adv is not None for mb in batch.micro
    )  # filled once, on the micro-batches
    assert math.isfinite(stats["actor/loss"]) and learner.engine.global_steps == 6  # 2 epochs x 3 mini-batches
    learner.close()


def test_resume_reproduces_the_same_loss_on_the_same_batch(dist, tiny_model_dir, tmp_path):
    cfg = job(
        tiny_model_dir, tmp_path, "learner.ppo_epochs=2", "learner.mini_batches=2", "broker.commit_on_checkpoint=true"
    )
    fixed = synthetic_groups(4, seed=7)
    client, broker = inproc_client(synthetic_groups(12), "broker.commit_on_checkpoint=true")
    first = Learner(cfg, tmp_path, client, dist)
    first.train_step()
    path = first.save()
    after_save = first.actor.step(first.actor.plan(Leased(groups=fixed)), first.version)  # what a resume must reproduce
    first.train_step()
    first.close()

    trained_after = [gid for step, gid in broker.state.uncommitted["learner-0"] if step > 1]
    assert len(trained_after) == 4
    again = Learner(cfg, tmp_path, client, dist)  # a fresh process's view: new weights from model.path
    again.resume(path)
    assert [broker.state.queue[i] for i in range(4)] == trained_after  # exactly the uncommitted groups, in order
    assert again.step == 1 and again.version == 3  # republished as a version newer than any the fleet saw
    replay = again.actor.step(again.actor.plan(Leased(groups=fixed)), again.version)
    for key in ("actor/loss", "actor/grad_norm", "actor/clipfrac", "actor/entropy"):
        assert replay[key] == after_save[key], key
    again.close()


def _holey_groups(garbage: float):
    """Two groups whose responses have appended (loss-mask 0) tokens inside and at the end."""
    import numpy as np

    from fleetrl.common import messages as m

    rng = np.random.default_rng(3)
    groups = []
    for g in range(2):
        responses, masks = [], []
        for i in range(4):
            mask = np.array([1, 1, 0, 0, 1, 1, 0])  # sampled, an observation, sampled, a trailing observation
            logp = np.where(mask == 1, -1.5 - 0.1 * i, garbage)  # appended tokens carry no behaviour log-prob
            responses.append((rng.integers(7, 200, 7), logp))
            masks.append(mask)
        groups.append(
            m.build_group(
                f"h{g}",
                f"0:{g}",
                0,
                rng.integers(7, 200, 5),
                responses,
                [float(i % 2) for i in range(4)],
                loss_masks=masks,
            )
        )
    return groups


def test_loss_mask_holes_are_trained_around_and_never_read(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path)
    stats = []
    for garbage in (0.0, -1e4):  # what sits at the appended tokens must not matter
        torch.manual_seed(0)
        learner = Learner(cfg, tmp_path, inproc_client([])[0], dist)
        batch = learner.actor.plan(Leased(groups=_holey_groups(garbage)))
        assert batch.last.tolist() == [5] * 8  # the reward sits on the last *sampled* token, not the trailing one
        assert batch.mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0]
        stats.append(learner.actor.step(batch, 0))
        learner.close()
    for key in ("actor/loss", "actor/grad_norm", "off_policy/mismatch_kl", "off_policy/drift_kl", "adv/abs_mean"):
        assert stats[0][key] == stats[1][key] and math.isfinite(stats[0][key]), key
    assert stats[0]["adv/abs_mean"] > 0


def test_remax_trains_against_the_greedy_baseline_the_groups_carry(dist, tiny_model_dir, tmp_path):
    cfg = job(tiny_model_dir, tmp_path, "algorithm.adv_estimator=remax")
    groups = synthetic_groups(4)
    for g in groups:
        g.baseline_reward = 0.5  # what the rollout server scored for the greedy response
    learner = Learner(cfg, tmp_path, inproc_client(groups)[0], dist)
    batch = learner.actor.plan(learner.source.next(1))
    assert batch.baselines.tolist() == [0.5] * 16
    stats = learner.actor.step(batch, 0)
    assert stats["adv/abs_mean"] == pytest.approx(0.5)  # rewards are 0 or 1: |R - 0.5| = 0.5 on every token
    learner.close()
    with pytest.raises(ValueError, match="greedy"):  # groups without the baseline: a clear error, not a silent 0
        plain = Learner(cfg, tmp_path, inproc_client(synthetic_groups(4, seed=5))[0], dist)
        plain.actor.step(plain.actor.plan(plain.source.next(1)), 0)
