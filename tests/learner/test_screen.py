"""The fleet screen (learner/screen.py) and the per-server rule (learner/health_servers.py): one server's
poison is left out and quarantines that server; honest groups, however lopsided, always pass."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleetrl.common import messages as m
from fleetrl.common.config.learner import HealthConfig, HealthRule, ScreenConfig
from fleetrl.learner.health import HealthMonitor
from fleetrl.learner.screen import FleetScreen, impossible_logprobs

RNG = np.random.default_rng(0)


def group(
    gid: str,
    rewards: list[float],
    server: str = "honest",
    logp: float | None = None,
    first: list[int] | None = None,
    masks: list[list[int]] | None = None,
) -> m.SampleGroup:
    """A group of len(rewards) 3-token responses; log-probs drawn in (-3, -0.01) unless ``logp`` is given."""
    responses = []
    for i in range(len(rewards)):
        tokens = RNG.integers(7, 263, 3)
        if first is not None:
            tokens[0] = first[i]
        lp = np.full(3, logp) if logp is not None else RNG.uniform(-3, -0.01, 3)
        responses.append((tokens, lp))
    return m.build_group(gid, f"0:{gid}", 0, [5, 6], responses, rewards, loss_masks=masks, server_id=server)


def honest(i: int, server: str = "honest") -> m.SampleGroup:
    return group(f"{server}-{i}", [float(x) for x in RNG.integers(0, 2, 4)], server)


def warm(screen: FleetScreen, n: int = 40) -> None:
    assert not screen.judge([honest(i) for i in range(n)]).dropped


def test_a_reward_far_outside_the_fleets_is_left_out_and_counted_against_its_server():
    screen = FleetScreen(ScreenConfig())
    warm(screen)
    verdict = screen.judge([honest(100), group("bad", [0.0, -1e6, 1.0, 0.0], "poison"), honest(101)])
    assert [g.group_id for g in verdict.kept] == ["honest-100", "honest-101"]
    assert [g.group_id for g in verdict.dropped] == ["bad"]
    assert (
        "reward -1e+06" in verdict.reasons["poison"][0]
        and "health.screen.reward_spread" in verdict.reasons["poison"][0]
    )
    assert verdict.per_server() == {
        "honest": {"groups": 2.0, "screened": 0.0},
        "poison": {"groups": 1.0, "screened": 1.0},
    }


def test_a_format_penalty_among_binary_rewards_passes():
    screen = FleetScreen(ScreenConfig())
    warm(screen)
    assert screen.judge([group("penalised", [-10.0, 1.0, 0.0, -10.0], "s")]).dropped == []


def test_rewards_are_judged_only_after_the_warmup():
    screen = FleetScreen(ScreenConfig(warmup=64))
    # 8 samples seen: no fleet to compare with yet, so a large reward passes (its log-probs are plausible)
    assert screen.judge([honest(0), group("big", [50.0] * 4, "s")]).dropped == []
    warm(screen, 20)
    assert [g.group_id for g in screen.judge([group("big2", [5000.0] * 4, "s")]).dropped] == ["big2"]


def test_the_reward_limit_scales_with_the_fleets_spread():
    # a reward model on a wide scale: rewards ~ N(0, 30) pass, and so does one 50 IQRs out; 200 IQRs out does not
    screen = FleetScreen(ScreenConfig())
    wide = [group(f"w{i}", list(RNG.normal(0, 30, 4)), "rm") for i in range(64)]
    assert screen.judge(wide).dropped == []
    q1, med, q3 = np.percentile([r for g in wide for r in g.rewards], [25, 50, 75])
    iqr = q3 - q1  # ~40
    assert screen.judge([group("far-ish", [med + 50 * iqr] * 4, "rm")]).dropped == []
    assert len(screen.judge([group("far", [med + 200 * iqr] * 4, "rm")]).dropped) == 1


def test_honest_binary_rewards_never_trip_the_screen():
    # 5,000 groups of 0/1 rewards, the fleet's success rate drifting from 0% to 100% and back (a lopsided
    # fleet): the limit is 100 x max(IQR, 1) from the median, which 0/1 rewards never reach
    screen = FleetScreen(ScreenConfig())
    for i in range(5000):
        p = 0.5 + 0.5 * math.sin(i / 400)
        g = group(f"g{i}", [float(x) for x in RNG.random(8) < p], f"s{i % 3}")
        assert screen.judge([g]).dropped == [], i


def test_log_probs_of_exactly_zero_with_different_first_tokens_are_impossible():
    # two responses starting with different tokens were drawn from one distribution: not both with probability 1
    bad = group("zeros", [1.0, 0.0, 1.0, 0.0], "s", logp=0.0, first=[10, 11, 10, 10])
    assert "exactly 0.0" in impossible_logprobs(bad)
    # the same log-probs with every response alike is what a deterministic policy gives: plausible
    same = m.build_group("same", "0:1", 0, [5], [([10, 12, 2], [0.0, 0.0, 0.0])] * 4, [1.0] * 4, server_id="s")
    assert impossible_logprobs(same) is None
    # one honest token among the zeros is enough
    mixed = m.build_group("mixed", "0:2", 0, [5], [([10, 12], [0.0, 0.0]), ([11, 12], [-0.7, 0.0])], [1.0, 0.0])
    assert impossible_logprobs(mixed) is None


def test_a_positive_log_prob_is_impossible_but_only_on_sampled_tokens():
    bad = group("pos", [1.0, 0.0], "s", logp=0.3)
    assert "> 0" in impossible_logprobs(bad)
    # a multi-turn episode: the observation tokens (mask 0) carry no behaviour log-probs; whatever sits there
    obs = m.build_group(
        "obs",
        "0:3",
        0,
        [5],
        [([10, 40, 41], [-0.5, 7.0, 7.0]), ([11, 40, 41], [-0.9, 7.0, 7.0])],
        [1.0, 0.0],
        loss_masks=[[1, 0, 0], [1, 0, 0]],
    )
    assert impossible_logprobs(obs) is None


def test_a_quarantined_servers_groups_are_left_out():
    screen = FleetScreen(ScreenConfig())
    verdict = screen.judge([honest(0, "a"), honest(1, "b")], quarantined={"b"})
    assert [g.server_id for g in verdict.kept] == ["a"] and "quarantined" in verdict.reasons["b"][0]


def test_a_disabled_screen_keeps_everything():
    screen = FleetScreen(ScreenConfig(enabled=False))
    assert len(screen.judge([group("z", [1.0, 0.0], "s", logp=0.0, first=[10, 11])]).kept) == 1


# ------------------------------------------------------------------------------------------ server_poison


def monitor(*rules: HealthRule) -> HealthMonitor:
    return HealthMonitor(HealthConfig(rules=list(rules) or [HealthRule(name="server_poison", action="quarantine")]))


def test_server_poison_quarantines_after_more_than_threshold_groups_in_the_window(tmp_path):
    mon = HealthMonitor(
        HealthConfig(rules=[HealthRule(name="server_poison", action="quarantine")]), tmp_path / "ev.jsonl"
    )
    honest_seen = {"groups": 4.0, "screened": 0.0}
    # two screened groups in 20 steps: tolerated (a stray group is left out, not a reason to isolate a server)
    assert mon.observe_servers(1, {"a": honest_seen, "bad": {"groups": 1.0, "screened": 1.0}}) == []
    assert mon.observe_servers(2, {"a": honest_seen, "bad": {"groups": 1.0, "screened": 1.0}}) == []
    (event,) = mon.observe_servers(3, {"a": honest_seen, "bad": {"groups": 2.0, "screened": 1.0}})
    assert (event.rule, event.action, event.server, event.value, event.threshold) == (
        "server_poison",
        "quarantine",
        "bad",
        3.0,
        2.0,
    )
    assert "rollout server bad" in event.message and event.short() == "server_poison -> quarantine bad @ 3"
    assert mon.quarantined == {"bad": 3}
    assert mon.observe_servers(4, {"bad": {"groups": 2.0, "screened": 2.0}}) == []  # once
    assert '"server": "bad"' in (tmp_path / "ev.jsonl").read_text()
    # per-server events leave the checkpoints' healthy tags alone, and the run's action stays none
    assert mon.on_checkpoint(4) is True and mon.decide([]) == "none"


def test_server_poison_forgets_groups_older_than_its_window():
    mon = monitor(HealthRule(name="server_poison", action="quarantine", window=5))
    fired = [bool(mon.observe_servers(step, {"s": {"groups": 1.0, "screened": 1.0}})) for step in (1, 4, 7, 10, 13)]
    assert fired == [False] * 5  # never 3 within 5 steps
    assert mon.observe_servers(14, {"s": {"groups": 2.0, "screened": 2.0}})  # 13 and 14: 3 within 5


def test_server_poison_takes_only_server_actions_and_quarantine_only_server_rules():
    with pytest.raises(
        ValueError, match="health.rules\\[0\\].action='rollback' \\(server_poison\\).*alert, quarantine"
    ):
        monitor(HealthRule(name="server_poison", action="rollback"))
    with pytest.raises(ValueError, match="action='quarantine' \\(reward_drop\\).*only per-server rules"):
        monitor(HealthRule(name="reward_drop", action="quarantine"))


def test_server_rules_read_no_step_metrics_and_survive_a_checkpoint_and_a_rollback():
    mon = monitor()
    for step in range(1, 30):  # no missing-metric warning, no firing, from the step metrics
        assert mon.observe(step, {"reward/mean": 0.5}) == []
    mon.observe_servers(30, {"s": {"groups": 1.0, "screened": 1.0}})
    mon.observe_servers(31, {"s": {"groups": 1.0, "screened": 1.0}})
    state = mon.state_dict()
    again = monitor()
    again.load_state_dict(state)
    assert again.observe_servers(32, {"s": {"groups": 1.0, "screened": 1.0}})[0].server == "s"  # counts carried over
    again.rewind_to(state, 30)
    assert again.quarantined == {"s": 32}  # a rollback does not lift a quarantine


def test_the_guard_counts_groups_whose_weights_fingerprint_is_not_the_published_one():
    import torch

    from fleetrl.learner.quarantine import FleetGuard
    from fleetrl.learner.runtime import Dist
    from fleetrl.learner.source import Leased

    published = {5: {"names": "n1", "bfloat16": "aaaa", "float32": "bbbb", "float16": "cccc"}}
    guard = FleetGuard(None, object(), None, Dist(0, 1, 0, torch.device("cpu")), published=published.get)
    groups = []
    for i, fp in enumerate(
        [
            [5, "bfloat16", "n1", "aaaa"],  # the published weights
            [5, "bfloat16", "n1", "ffff"],  # other weights under version 5: stale
            [4, "bfloat16", "n1", "ffff"],  # a version with no record: not compared
            [5, "bfloat16", "other", "ffff"],  # other tensors (a fusing engine): not compared
            ["x", "bfloat16", "n1", "ffff"],  # malformed version: ignored, no crash
            None,
        ]
    ):
        g = honest(i, server="a" if i < 2 else "b")
        if fp is not None:
            g.metadata["weights_fp"] = fp
        groups.append(g)
    servers = guard.stale(Leased(groups=groups, servers={"a": {"groups": 2.0}, "b": {"groups": 4.0}}))
    assert servers == {"a": {"groups": 2.0, "stale": 1.0, "stale_version": 5.0}, "b": {"groups": 4.0}}
