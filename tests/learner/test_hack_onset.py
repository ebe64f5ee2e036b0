"""The onset of reward hacking (benchmarks/health_analysis.py hack_onset) and the delays health_recovery.py
reports from it, on the recorded recovery runs of 2026-12-06 (tests/learner/data/hack_onset_evals.json)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from health_analysis import eval_lengths, hack_onset  # noqa: E402

DATA = json.loads((Path(__file__).parent / "data" / "hack_onset_evals.json").read_text())


def lengths(name):
    return eval_lengths(DATA["evals"][name])


@pytest.mark.parametrize(
    "name,onset,seen",
    [
        ("reward_hack-s1", 61, 70),  # 3.44 tokens before the bug; 3.31 at step 70 (a 0.09 share), 2.67 at 80
        ("reward_hack-s2", 71, 80),
        ("reward_hack-s3", 71, 80),
        ("persistent-s1", 71, 80),
        ("persistent-s2", 71, 80),
        ("persistent-s3", 51, 60),
    ],
)
def test_the_onset_is_read_from_the_held_out_answers_on_the_recorded_hack_runs(name, onset, seen):
    found = hack_onset(lengths(name), 45)
    assert (found["onset_step"], found["seen_step"]) == (onset, seen)
    assert found["share"] > found["margin"] == 0.05


@pytest.mark.parametrize("name", ["unfaulted-s1", "unfaulted-s2", "unfaulted-s3", "unfaulted2-s1"])
def test_no_onset_on_the_unfaulted_runs(name):
    assert hack_onset(lengths(name), 45)["onset_step"] is None


def test_the_share_counts_from_the_pre_fault_level_and_the_onset_not_before_the_bug():
    paid = 2.0  # one character and the end token
    base = [(0, 3.5), (10, 3.4), (20, 3.45)]  # pre-fault mean 3.45; (3.45 - v) / 1.45 is the paid share
    # a dip under the margin (share 0.04) is not an onset; one over it is, dated after the last clean evaluation
    found = hack_onset([*base, (30, 3.45 - 0.04 * 1.45), (40, 3.45 - 0.2 * 1.45)], 25, paid_tokens=paid)
    assert (found["onset_step"], found["seen_step"]) == (31, 40) and found["share"] == pytest.approx(0.2)
    # the evaluation before the bug is the last clean one, but the onset is never dated before the bug
    assert hack_onset([*base, (30, 2.0)], 25)["onset_step"] == 25
    # answers growing longer are not what the bug pays
    assert hack_onset([*base, (30, 4.5)], 25)["onset_step"] is None
    # no evaluation before the bug: no level to compare with
    assert hack_onset([(30, 2.0)], 25)["onset_step"] is None


def test_health_recovery_reports_both_delays_for_a_reward_hack_run():
    from health_recovery import compare, summarize

    def run(name, fault):
        curve = [(int(r["step"]), r["eval/accuracy"]) for r in DATA["evals"][name]]
        return {
            "fault": fault,
            "inject_at": 45,
            "exit_code": 0,
            "curve": curve,
            "events": DATA["events"][name],
            "eval_len": lengths(name),
        }

    r = compare(run("reward_hack-s1", "reward_hack"), run("unfaulted-s1", None))
    assert (r["bug_step"], r["onset_step"], r["onset_seen_step"], r["detected_step"]) == (45, 61, 70, 80)
    assert (r["delay_from_bug"], r["delay_from_onset"], r["delay_from_seen"]) == (35, 19, 10)
    missed = compare(run("reward_hack-s3", "reward_hack"), run("unfaulted-s3", None))
    assert missed["onset_step"] == 71 and missed["delay_from_onset"] is None
    assert "onset_step" not in compare(run("unfaulted-s2", "divergence"), run("unfaulted-s2", None))
    table = summarize(
        {
            "reward_hack-s1": run("reward_hack-s1", "reward_hack"),
            "unfaulted-s1": run("unfaulted-s1", None),
            "persistent-s3": run("persistent-s3", "persistent"),
            "unfaulted-s3": run("unfaulted-s3", None),
        },
        ["reward_hack", "persistent"],
        [1, 3],
    )
    # persistent-s3: onset 51, detected at 80 (29 steps)
    assert table["targets"]["reward_hack_runs_detected_within_20_steps_of_onset"].startswith("1 of 2")


def test_the_replay_mode_reads_this_checkouts_detection_off_a_recorded_run(tmp_path):
    from health_recovery_replay import replayed

    runs = json.loads((Path(__file__).parent / "data" / "reward_hack_streams.json").read_text())["runs"]
    rec = runs["p10/reward_hack-s1"]
    rows = {s: {"step": s, "reward/mean": r} for s, r in rec["reward"]}
    for s, acc, length in rec["evals"]:
        rows[s].update({"eval/accuracy": acc, "eval/response_len_mean": length})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    live = [
        {"step": 80, "rule": "reward_hacking", "action": "rollback"},
        {"step": 80, "rule": "rollback", "action": "rollback"},
    ]
    run = {"fault": "reward_hack", "inject_at": 45, "exit_code": 0, "events": live, "curve": []}
    out = replayed(run, tmp_path, "[{name: reward_hacking, action: rollback}]")
    assert out["replay_readable"] and [(e["step"], e["rule"]) for e in out["events"]] == [
        (70, "reward_hacking"),
        (70, "rollback"),
    ]
    # a live event before the replayed one: what followed is another run, the recorded events stand
    early = {**run, "events": [{"step": 50, "rule": "reward_drop", "action": "rollback"}]}
    out = replayed(early, tmp_path, "[{name: reward_hacking, action: rollback}]")
    assert not out["replay_readable"] and out["events"] == early["events"]
