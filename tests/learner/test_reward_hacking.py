"""The reward_hacking rule on hand-computed synthetic streams, the rollback target it moves, and the
diversity metrics the learner emits for it."""

from __future__ import annotations

import random

import pytest

from fleetrl.common.config.learner import HealthConfig, HealthRule
from fleetrl.learner.health import HealthMonitor
from fleetrl.learner.metrics import diversity_metrics

HEALTHY = {"reward/mean": 0.3, "response/length_mean": 3.5, "response/distinct_2": 0.6, "response/identical_frac": 0.1}
HACK = {"reward/mean": 0.9, "response/length_mean": 1.8, "response/distinct_2": 0.2, "response/identical_frac": 0.9}


def monitor(**rule) -> HealthMonitor:
    return HealthMonitor(
        HealthConfig(rules=[HealthRule(name="reward_hacking", action="rollback", **rule)], healthy_window=2), None
    )


def run(m: HealthMonitor, rows: list[dict], checkpoint_every: int = 0) -> dict[int, list]:
    fired = {}
    for step, row in enumerate(rows, 1):
        events = m.observe(step, row)
        if events:
            fired[step] = events
        if checkpoint_every and step % checkpoint_every == 0:
            m.on_checkpoint(step)
    return fired


def test_identical_responses_catch_the_hack_6_steps_after_onset():
    # window 10, baseline identical_frac 0.1: after k hack steps the MA is 0.1 + 0.08 k, above
    # max(0.5, 0.1 + 0.25) = 0.5 first at k = 6 (0.58; k = 5 gives exactly 0.5, not above)
    fired = run(monitor(), [HEALTHY] * 40 + [HACK] * 30)
    assert list(fired)[0] == 46
    event = fired[46][0]
    assert event.rule == "reward_hacking" and event.action == "rollback"
    assert event.metric == "response/identical_frac" and event.value == pytest.approx(0.58)
    assert event.threshold == pytest.approx(0.5)
    assert "one response answers many different prompts" in event.message


def test_length_collapse_alone_is_caught_9_steps_after_onset():
    # length MA after k steps: 3.5 - 0.17 k, under 0.6 x 3.5 = 2.1 first at k = 9 (1.97; k = 8: 2.14)
    hack = {**HEALTHY, "reward/mean": 0.9, "response/length_mean": 1.8}
    fired = run(monitor(), [HEALTHY] * 40 + [hack] * 30)
    assert list(fired)[0] == 49
    (event,) = fired[49]
    assert event.metric == "response/length_mean" and event.value == pytest.approx(1.97)
    assert event.threshold == pytest.approx(2.1)


def test_distinct_2_collapse_alone_is_caught():
    # distinct_2 MA: 0.6 - 0.04 k, under 0.5 x 0.6 = 0.3 first at k = 8 (0.28; k = 7 gives 0.32)
    hack = {**HEALTHY, "reward/mean": 0.5, "response/distinct_2": 0.2}
    fired = run(monitor(), [HEALTHY] * 40 + [hack] * 30)
    assert list(fired)[0] == 48 and fired[48][0].metric == "response/distinct_2"


def test_degenerate_samples_with_a_falling_reward_are_not_reward_hacking():
    # a collapse that does not pay is reward_drop's / length_collapse's business, not this rule's
    broken = {**HACK, "reward/mean": 0.05}
    assert run(monitor(), [HEALTHY] * 40 + [broken] * 30) == {}


def eval_stream(accuracies: dict[int, float], reward_from_21: float, n: int = 45) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        row = {"reward/mean": 0.3 if step <= 20 else reward_from_21}
        if step in accuracies:
            row["eval/accuracy"] = accuracies[step]
        rows.append(row)
    return rows


def test_held_out_accuracy_falling_while_reward_rises_fires_at_the_evaluation():
    # evals at 10, 20, 30, 40; reward MA 0.3 at 10 and 20, 0.8 at 30 and 40. At 30 the best of the
    # last 3 is 0.32 (step 20) and 0.28 is only 0.04 below; at 40 (evals 20, 30, 40) 0.15 is 0.17 below
    # with a rise of 0.5 since step 20 -> fires, evidence from step 21
    m = monitor()
    fired = run(m, eval_stream({10: 0.30, 20: 0.32, 30: 0.28, 40: 0.15}, 0.8), checkpoint_every=5)
    assert list(fired) == [40]
    (event,) = fired[40]
    assert event.metric == "eval/accuracy" and event.value == pytest.approx(0.15)
    assert event.threshold == pytest.approx(0.22)
    assert "from 0.32 at step 20" in event.message and "rose 0.5" in event.message
    # the checkpoints inside the divergence (25, 30, 35) lost their tag; the rollback goes to step 20
    assert m.rollback_target([5, 10, 15, 20, 25, 30, 35]) == 20
    assert "step 25: inside the evidence of reward_hacking (from step 21, fired at step 40)" in m.target_evidence
    assert "step 35:" in m.target_evidence
    note = m.record_rollback(20, 40).message
    assert "newer checkpoints passed over" in note and "step 30: inside the evidence of reward_hacking" in note


def test_held_out_accuracy_falling_with_the_reward_is_not_reward_hacking():
    assert run(monitor(), eval_stream({10: 0.30, 20: 0.32, 30: 0.28, 40: 0.15}, 0.2)) == {}


def test_a_healthy_noisy_stream_never_fires():
    # 3,000 steps: the reward climbs 0.3 -> 0.6 with +-0.15 noise, the length drifts 3.5 -> 2.5 (a policy
    # learning to be concise) with +-0.6 noise, distinct_2 and identical_frac jitter, and the held-out
    # accuracy (every 25 steps) climbs 0.3 -> 0.5 with the +-0.04 noise of a 200-problem evaluation
    rng = random.Random(7)
    rows = []
    for step in range(1, 3001):
        t = step / 3000
        row = {
            "reward/mean": 0.3 + 0.3 * t + rng.uniform(-0.15, 0.15),
            "response/length_mean": 3.5 - t + rng.uniform(-0.6, 0.6),
            "response/distinct_2": 0.6 + rng.uniform(-0.1, 0.1),
            "response/identical_frac": max(0.0, 0.15 + rng.uniform(-0.1, 0.1)),
        }
        if step % 25 == 0:
            row["eval/accuracy"] = 0.3 + 0.2 * t + rng.uniform(-0.04, 0.04)
        rows.append(row)
    assert run(monitor(), rows) == {}
    # the same stream with a hack from step 2000 is caught within 20 steps
    hacked = rows[:1999] + [dict(HACK) for _ in range(100)]
    fired = run(monitor(), hacked)
    assert fired and 2000 <= min(fired) <= 2020


def test_an_old_alert_does_not_drag_the_rollback_target_back():
    m = HealthMonitor(
        HealthConfig(
            rules=[
                HealthRule(name="reward_hacking", action="rollback"),
                HealthRule(name="grad_spike", action="alert", window=3),
            ],
            healthy_window=2,
        ),
        None,
    )
    rows = [{**HEALTHY, "actor/grad_norm": 1.0} for _ in range(60)]
    rows[7]["actor/grad_norm"] = 100.0  # a spike at step 8: an alert long before the hack
    rows += [{**HACK, "actor/grad_norm": 1.0} for _ in range(20)]
    fired = run(m, rows, checkpoint_every=10)
    assert [e.rule for e in fired[8]] == ["grad_spike"] and fired[66][0].rule == "reward_hacking"
    assert m.rollback_target([10, 20, 30, 40, 50, 60]) == 60  # the hack began at 61; step 8 is not this episode
    assert m.target_evidence == ""


def test_state_survives_a_checkpoint_round_trip():
    rows = [HEALTHY] * 40 + [HACK] * 30
    a = monitor()
    run(a, rows[:43])
    b = monitor()
    b.load_state_dict(a.state_dict())
    fired = {}
    for step, row in enumerate(rows[43:], 44):
        if b.observe(step, row):
            fired[step] = True
    assert min(fired) == 46


@pytest.mark.parametrize("field, value, match", [("threshold", 1.5, "in \\(0, 1\\)"), ("window", 1, ">= 2")])
def test_bad_settings_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"health.rules\\[0\\].{field}.*{match}"):
        monitor(**{field: value})


def test_diversity_metrics_by_hand():
    # 2 prompt groups; group 0's repeat counts once; framed by start S and end E the bigrams are
    # S1 12 23 3E | S4 45 5E | S1 12 2E: 10 bigrams, 8 distinct (S1 12 23 3E S4 45 5E 2E)
    out = diversity_metrics([(1, 2, 3), (1, 2, 3), (4, 5), (1, 2)], [0, 0, 1, 1])
    assert out["response/distinct_2"] == pytest.approx(8 / 10)
    assert out["response/identical_frac"] == pytest.approx(0.5)  # (1, 2, 3) only in group 0 of 2
    # one-token answers, the same for 4 prompts: S9 9E x 4 -> 2 of 8 distinct; every group holds it
    same = diversity_metrics([(9,), (9,), (9,), (9,)], [0, 1, 2, 3])
    assert same["response/distinct_2"] == pytest.approx(0.25) and same["response/identical_frac"] == 1.0
    assert diversity_metrics([(), ()], [0, 1])["response/distinct_2"] == pytest.approx(0.5)  # empty answers count


def test_distinct_2_does_not_fall_when_each_prompt_converges_to_its_own_answer():
    # a policy that learns: every group of 8 agrees on its own answer. S1 12 2E | S3 34 4E: 6 of 6 distinct
    # (counting all 16 responses, 6 of 48: the rule would read learning as a collapse)
    learned = diversity_metrics([(1, 2)] * 8 + [(3, 4)] * 8, [0] * 8 + [1] * 8)
    assert learned["response/distinct_2"] == pytest.approx(1.0) and learned["response/identical_frac"] == 0.5


def _recorded(name: str) -> list[dict]:
    import json
    from pathlib import Path

    path = Path(__file__).parent / "data" / f"{name}.metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _replay(rows: list[dict]) -> list:
    m = monitor()
    return [e for row in rows for e in m.observe(int(row["step"]), {k: v for k, v in row.items() if k != "step"})]


def test_a_probe_every_5_steps_keeps_the_reach_of_the_held_out_path():
    # benchmarks/health_recovery.py --eval-interval 5 --eval-n 250, seed 1 (2026-12-06): the reward hack from
    # version 45 shows on the held-out probe from step 75 (0.268 at 70 -> 0.208, 0.148, 0.104). The last 3
    # evaluations then span only 10 steps, over which the reward MA rose < 0.05: the rule never fired. It now
    # judges all the evaluations of the last 2 x window steps when they are more than 3.
    events = _replay(_recorded("reward_hack_eval5"))
    assert events and events[0].step == 85 and events[0].metric == "eval/accuracy"
    assert _replay(_recorded("unfaulted_eval5")) == []  # the unfaulted run of the same seed and probe: quiet
