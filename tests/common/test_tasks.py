from __future__ import annotations

import json

import pytest

from fleetrl.common.data.tasks import arithmetic_problems, eval_path, init_data, make_splits


def test_arithmetic_problems_are_zero_padded_and_correct():
    problems = list(arithmetic_problems())
    assert len(problems) == 100 * 100
    assert ("07+58=", "65") in problems
    assert {len(p) for p, _ in problems} == {6}
    for prompt, answer in problems[::37]:
        a, b = prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(answer)


def test_splits_are_disjoint_and_deterministic():
    train, held = make_splits("arithmetic", 3000, 500, seed=1)
    assert len(train) == 3000 and len(held) == 500
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert make_splits("arithmetic", 3000, 500, seed=1) == (train, held)
    assert make_splits("arithmetic", 3000, 500, seed=2)[1] != held
    more, held2 = make_splits("arithmetic", 20000, 500, seed=1)  # more rows than problems: repeats, still disjoint
    assert len(more) == 20000 and held2 == held and not {r["prompt"] for r in more} & {r["prompt"] for r in held}


def test_init_data_writes_both_files(tmp_path):
    train, held = init_data("arithmetic", str(tmp_path / "a.jsonl"), 10, 5, 0, 9)
    assert held == eval_path(train) == tmp_path / "a.eval.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 10 and set(rows[0]) == {"id", "prompt", "answer"}
    assert rows[0]["prompt"].endswith("=") and len(rows[0]["prompt"]) == 4  # one-digit operands: "3+4="


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="valid tasks: arithmetic"):
        make_splits("algebra", 1, 1, 0)
    with pytest.raises(ValueError, match="lower --eval-n"):
        make_splits("arithmetic", 1, 10_000, 0)
