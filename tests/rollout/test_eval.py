"""`fleetrl eval`: the pass@k estimator, greedy accuracy against answers built from the model's own
greedy outputs, and the command's table and JSON."""

from __future__ import annotations

import json
import math
from itertools import combinations

import pytest

from fleetrl.app.cli import main as cli_main
from fleetrl.rollout.engines import SamplingParams
from fleetrl.rollout.eval import evaluate, evaluate_detailed, pass_at_k
from fleetrl.rollout.loop import encode_prompt

MAX_NEW = 5


@pytest.fixture(scope="module")
def rows(engine):
    """Arithmetic prompts whose `answer` is the tiny model's own greedy response (so greedy is 100% right)."""
    prompts = [f"{a:02d}+{b:02d}=" for a, b in [(7, 58), (12, 3), (99, 99), (40, 1), (5, 5), (31, 68)]]
    ids = [encode_prompt(engine.tokenizer, p, False, 100) for p in prompts]
    out = engine.generate_batch(ids, SamplingParams(temperature=0, max_new_tokens=MAX_NEW), 1)
    return [{"id": i, "prompt": p, "answer": g[0].text} for i, (p, g) in enumerate(zip(prompts, out))]


def test_pass_at_k_hand_computed():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(4, 2, 3) == 1.0  # only 2 wrong samples: every 3-subset holds a right one
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_pass_at_k_matches_counting_subsets():
    """The product form equals the fraction of k-subsets of the n samples holding a correct one."""
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [i < c for i in range(n)]
            for k in range(1, n + 1):
                subsets = list(combinations(correct, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / math.comb(n, k))


def test_greedy_accuracy_right_wrong_and_half(engine, rows, tiny_model_dir):
    kw = dict(k=0, max_new_tokens=MAX_NEW, reward="exact", engine=engine)
    assert evaluate(tiny_model_dir, rows, **kw)["eval/accuracy"] == 1.0
    wrong = [{**r, "answer": r["answer"] + "x"} for r in rows]
    metrics = evaluate(tiny_model_dir, wrong, **kw)
    assert metrics["eval/accuracy"] == 0.0 and metrics["eval/reward_mean"] == 0.0
    half = rows[:3] + wrong[3:]
    assert evaluate(tiny_model_dir, half, **kw)["eval/accuracy"] == pytest.approx(0.5)
    first3 = evaluate(tiny_model_dir, half, n=3, **kw)  # the first N rows only
    assert first3["eval/n"] == 3 and first3["eval/accuracy"] == 1.0
    assert "eval/pass@1" not in evaluate(tiny_model_dir, rows, **kw)  # k = 0: greedy only


def test_sampled_pass_at_k(engine, rows, tiny_model_dir):
    # A temperature near 0 samples the greedy response: every sample right, or every sample wrong.
    kw = dict(k=2, samples=3, temperature=1e-4, max_new_tokens=MAX_NEW, reward="exact", engine=engine)
    metrics = evaluate(tiny_model_dir, rows[:3] + [{**r, "answer": "nope"} for r in rows[3:]], **kw)
    assert metrics["eval/pass@2"] == pytest.approx(0.5) and metrics["eval/pass@1"] == pytest.approx(0.5)
    assert metrics["eval/samples"] == 3
    # At temperature 1 the metric is the mean estimator over the per-row counts.
    metrics, records = evaluate_detailed(
        tiny_model_dir,
        rows,
        k=2,
        samples=4,
        temperature=1.0,
        max_new_tokens=MAX_NEW,
        reward="exact",
        engine=engine,
        seed=3,
    )
    assert all(len(r["sample_rewards"]) == 4 for r in records)
    expected = sum(pass_at_k(4, r["samples_correct"], 2) for r in records) / len(records)
    assert metrics["eval/pass@2"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="at least k samples"):
        evaluate(tiny_model_dir, rows, k=3, samples=2, engine=engine)


def test_eval_command_prints_table_and_writes_json(rows, tiny_model_dir, tmp_path, capsys, engine):
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    code = cli_main(
        [
            "eval",
            "--model",
            tiny_model_dir,
            "--data",
            str(data),
            "--n",
            "4",
            "--k",
            "2",
            "--max-new-tokens",
            str(MAX_NEW),
            "--reward",
            "exact",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "greedy accuracy    1.0000" in printed and "pass@2" in printed
    result = json.loads(out.read_text())
    assert result["metrics"]["eval/n"] == 4 and result["metrics"]["eval/accuracy"] == 1.0
    assert [r["prompt"] for r in result["rows"]] == [r["prompt"] for r in rows[:4]]
    assert cli_main(["eval", "--model", tiny_model_dir, "--data", str(tmp_path / "missing.jsonl")]) == 2


def test_distinct_n_hand_computed():
    from fleetrl.rollout.eval import distinct_n

    # unigrams of [1,2,3] + [1,2,4]: six, four distinct; bigrams (1,2) (2,3) (1,2) (2,4): three distinct of four
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == pytest.approx(4 / 6)
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)
    assert distinct_n([[5, 5], [5, 5]], 1) == pytest.approx(1 / 4)  # collapsed onto one token
    assert distinct_n([[], [7]], 2) == 1.0  # no bigram at all


def test_length_distribution_truncation_and_diversity(engine, rows, tiny_model_dir):
    metrics, records = evaluate_detailed(
        tiny_model_dir,
        rows,
        k=1,
        samples=3,
        temperature=1.0,
        max_new_tokens=MAX_NEW,
        reward="exact",
        engine=engine,
        seed=1,
    )
    lengths = sorted(r["greedy_tokens"] for r in records)
    assert (
        metrics["eval/response_len_max"] == lengths[-1]
        and metrics["eval/response_len_p50"] == lengths[len(lengths) // 2]
    )
    assert metrics["eval/truncated_frac"] == pytest.approx(sum(r["greedy_truncated"] for r in records) / len(records))
    assert metrics["eval/truncated_frac"] == pytest.approx(sum(t == MAX_NEW for t in lengths) / len(lengths))
    assert 0 < metrics["eval/distinct_1"] <= 1 and 0 < metrics["eval/distinct_2"] <= 1
    assert metrics["eval/success_threshold"] == 1.0


def test_success_is_explicit_for_shaped_rewards_and_printed(engine, rows, tiny_model_dir, tmp_path, capsys):
    """A shaped reward (1.1 for a wrong answer) scored 100% when "correct" silently meant reward >= 1."""
    from fleetrl.common.config import ConfigError, load_config

    shaped = load_config(None, ["rollout.rewards=[{name: exact}, {name: length, weight: 0.1, args: {target: 1}}]"])
    with pytest.raises(ConfigError, match="--success: which reward counts as correct is ambiguous"):
        evaluate(tiny_model_dir, rows, cfg=shaped, k=0, engine=engine)
    assert (
        evaluate(tiny_model_dir, rows, cfg=shaped, k=0, engine=engine, success=0.95)["eval/success_threshold"] == 0.95
    )
    data = tmp_path / "q.jsonl"  # other column names: --prompt-key / --answer-key
    data.write_text("".join(json.dumps({"question": r["prompt"], "solution": r["answer"]}) + "\n" for r in rows))
    args = [
        "eval",
        "--model",
        tiny_model_dir,
        "--data",
        str(data),
        "--k",
        "0",
        "--max-new-tokens",
        str(MAX_NEW),
        "--reward",
        "exact",
        "--device",
        "cpu",
    ]
    assert cli_main(args) == 2  # no `prompt` column: one line naming --prompt-key
    assert "rows have no 'prompt' column" in capsys.readouterr().err
    assert cli_main([*args, "--prompt-key", "question", "--answer-key", "solution", "--success", "1"]) == 0
    printed = capsys.readouterr().out
    assert "correct            reward >= 1  (--success)" in printed and "greedy accuracy    1.0000" in printed
    assert "truncated at max_new_tokens" in printed


def test_evaluate_model_scores_a_model_in_memory_like_the_run_and_gives_its_mode_back(rows, engine, tiny_model_dir):
    """The one evaluator (issue 24): `evaluate_model` on a model object agrees with `evaluate` on its
    directory, leaves a training model in training mode, and `fleetrl sft`'s early stop reads it too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fleetrl.common.config import load_config
    from fleetrl.learner.sft import held_out_accuracy
    from fleetrl.rollout.eval import evaluate_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.train()
    cfg = load_config(None, [f"rollout.max_new_tokens={MAX_NEW}", f"model.path={tiny_model_dir}"])
    cfg.rollout.rewards = [type(cfg.rollout.rewards[0])(name="exact")]
    half = rows[:3] + [{**r, "answer": r["answer"] + "x"} for r in rows[3:]]
    metrics = evaluate_model(model, tokenizer, half, cfg)
    assert metrics["eval/accuracy"] == pytest.approx(0.5) and model.training
    assert metrics["eval/accuracy"] == evaluate(tiny_model_dir, half, cfg=cfg, k=0)["eval/accuracy"]
    # no job config: the arithmetic task's exact answer within 6 new tokens
    ids = [encode_prompt(engine.tokenizer, r["prompt"], False, 100) for r in rows]
    six = [g[0].text for g in engine.generate_batch(ids, SamplingParams(temperature=0, max_new_tokens=6), 1)]
    half6 = [{**r, "answer": t if i < 2 else t + "x"} for i, (r, t) in enumerate(zip(rows, six))]
    assert (
        held_out_accuracy(None, model, tokenizer, half6, tiny_model_dir, evaluate_model) == pytest.approx(2 / 6)
        and model.training
    )
