"""Rewards: each built-in on real inputs, user functions (sync, async, raising, hanging), the reward
model against a manual forward pass, weighted combination, and the start-up errors."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from fleetrl.common.config.schema import RewardSpec
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.rollout.rewards import REWARDS, RewardArgsError, RewardInput, RewardResult, RewardScorer
from tests.rollout import user_rewards

USER = "tests.rollout.user_rewards"


def sample(response: str, answer: str | None = None, **kw) -> RewardInput:
    return RewardInput(
        prompt=kw.pop("prompt", "Q: "), response=response, answer=answer, metadata=kw.pop("metadata", {}), **kw
    )


def spec(name: str, weight: float = 1.0, **args) -> RewardSpec:
    return RewardSpec(name=name, weight=weight, args=args)


@pytest.fixture
def scorer_of():
    """Build scorers that are closed after the test."""
    made: list[RewardScorer] = []

    def make(*specs: RewardSpec, **kw) -> RewardScorer:
        made.append(RewardScorer(list(specs), **{"timeout_s": 5.0, "workers": 2, "on_failure": "zero", **kw}))
        return made[-1]

    yield make
    for s in made:
        s.close()


# ------------------------------------------------------------------------------------ built-ins


@pytest.fixture(scope="module")
def math_reward():
    return REWARDS["math"]()


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("1/2", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\frac{1}{2}", "1/2", 1.0),
        ("The answer is $\\boxed{42}$.", "42", 1.0),
        ("42", "\\boxed{42}", 1.0),
        ("First 3, then 5, so the result is 7", "7", 1.0),  # the last number is the answer
        ("\\boxed{41}", "42", 0.0),
        ("1/3", "0.5", 0.0),
        ("I do not know", "42", 0.0),
    ],
)
def test_math_equivalence(math_reward, response, answer, expected):
    assert math_reward([sample(response, answer)]) == [expected]


def test_math_runs_in_worker_threads(scorer_of):
    # math-verify's own timeout uses signal.alarm and raises outside the main thread; the scorer's
    # worker threads must still get real verdicts, and a row without a ground truth fails.
    scorer = scorer_of(spec("math"), workers=4)
    results = scorer.score(
        [sample("\\boxed{\\dfrac{1}{2}}", "0.5"), sample("0.75", "3/4"), sample("2", "3"), sample("2")]
    )
    assert [r.reward for r in results] == [1.0, 1.0, 0.0, 0.0]
    assert [r.failed for r in results] == [False, False, False, True]
    assert "ground-truth answer" in results[3].error


def test_exact():
    plain = REWARDS["exact"]()
    assert plain([sample("  Paris\n", "Paris"), sample("paris", "Paris"), sample("Paris.", "Paris")]) == [1.0, 0.0, 0.0]
    folded = REWARDS["exact"](ignore_case=True)
    assert folded([sample("paris", " PARIS ")]) == [1.0]
    extract = REWARDS["exact"](pattern=r"answer:\s*(\w+)")
    batch = [sample("answer: 3 ... answer: 4", "4"), sample("answer: 4 then answer: 3", "4"), sample("4", "4")]
    assert extract(batch) == [1.0, 0.0, 0.0]  # the last match counts; no match scores 0
    first = REWARDS["exact"](pattern=r"\d+", occurrence="first")
    assert first([sample("7 then 9", "7")]) == [1.0]


def test_regex_format_reward():
    think = REWARDS["regex"](pattern=r"<think>.*</think>\s*<answer>.*</answer>", mode="full", flags=["DOTALL"])
    good = "<think>2+2\nis 4</think>\n<answer>4</answer>"
    assert think([sample(good), sample(good + " trailing"), sample("<answer>4</answer>")]) == [1.0, 0.0, 0.0]
    anywhere = REWARDS["format"](pattern=r"\\boxed\{", hit=0.5, miss=-1.0)
    assert anywhere([sample("so \\boxed{4}"), sample("4")]) == [0.5, -1.0]
    start = REWARDS["regex"](pattern="yes", mode="start", flags=["IGNORECASE"])
    assert start([sample("Yes, because"), sample("I say yes")]) == [1.0, 0.0]


def test_length_shaping():
    length = REWARDS["length"](target=10, penalty_per_token=0.1, max_penalty=0.5, truncation_penalty=0.2)
    batch = [
        sample("", num_tokens=8),  # under target: 0
        sample("", num_tokens=13),  # -0.1 * (13 - 10) = -0.3
        sample("", num_tokens=30),  # -min(0.5, 0.1 * 20) = -0.5
        sample("", num_tokens=30, finish_reason="length"),  # -0.5 - 0.2 = -0.7
    ]
    assert length(batch) == pytest.approx([0.0, -0.3, -0.5, -0.7])
    # DAPO soft overlong punishment with L_max = 20, L_cache = 5: ((20 - 5) - 17) / 5 = -0.4
    dapo = REWARDS["length"](target=15, penalty_per_token=1 / 5, max_penalty=1.0)
    assert dapo([sample("", num_tokens=17), sample("", num_tokens=25)]) == pytest.approx([-0.4, -1.0])


# --------------------------------------------------------------------------------- user functions


def test_python_sync_functions_get_the_fields_they_name(tmp_path):
    contains = REWARDS["python"](function=f"{USER}:contains_answer")
    assert contains([sample("it is 42", "42"), sample("it is 41", "42")]) == [1.0, 0.0]
    scaled = REWARDS["python"](function=f"{USER}:scaled", kwargs={"scale": 2.5})
    assert scaled([sample("7", "7")]) == [2.5]
    every = REWARDS["python"](function=f"{USER}:field_count")
    assert every([sample("x")]) == [6.0]  # prompt, response, answer, metadata, finish_reason, num_tokens
    meta = REWARDS["python"](function=f"{USER}:from_metadata")
    assert meta([sample("x", metadata={"bonus": 0.25})]) == [0.25]
    file = tmp_path / "my_reward.py"
    file.write_text("def reward(response, num_tokens):\n    return len(response) + num_tokens\n")
    from_file = REWARDS["python"](function=f"{file}:reward")
    assert from_file([sample("abc", num_tokens=4)]) == [7.0]


def test_python_async_function(scorer_of):
    direct = REWARDS["python"](function=f"{USER}:async_len")
    assert direct.is_async and direct([sample("abcd")]) == [4.0]
    scorer = scorer_of(spec("python", function=f"{USER}:async_len"), workers=1)
    user_rewards.ASYNC_IN_FLIGHT["most"] = 0
    results = scorer.score([sample("x" * n) for n in range(40)])
    assert [r.reward for r in results] == [float(n) for n in range(40)]
    # the calls await together on the scorer's event loop, not one by one on the single worker
    assert user_rewards.ASYNC_IN_FLIGHT["most"] > 1


def test_failing_user_function_is_counted_and_scores_zero(scorer_of):
    scorer = scorer_of(spec("python", function=f"{USER}:odd_values"), spec("regex", 0.5, pattern="."))
    results = scorer.score([sample(r) for r in ["nan", "inf", "text", "none", "ok"]])
    assert [r.failed for r in results] == [True, True, True, False, False]  # None is no score, not a failure
    # failed part adds 0; the regex part still counts: 0.5 * 1; None adds nothing and is not in `parts`
    assert [r.reward for r in results] == [0.5, 0.5, 0.5, 0.5, 1.5]
    assert results[0].parts == {"odd_values": 0.0, "regex": 1.0}  # metrics are named after the function
    assert results[3].parts == {"regex": 1.0} and results[3].scored
    assert "non-finite nan" in results[0].error and "expected a number" in results[2].error
    assert all(math.isfinite(r.reward) for r in results)
    raising = scorer_of(spec("python", function=f"{USER}:boom"))
    [r] = raising.score([sample("x")])
    assert r.failed and r.reward == 0.0 and r.error == "boom: ValueError: cannot score 'x'"
    stats = scorer.stats()
    assert stats["reward/nonfinite_total"] == 3 and stats["reward/failed_total"] == 3
    assert stats["reward/odd_values/failed_total"] == 3 and stats["reward/regex/mean"] == 1.0
    assert stats["reward/odd_values/unscored_total"] == 1 and stats["reward/unscored_total"] == 0
    assert stats["reward/odd_values/mean"] == 1.0  # only the sample that did not fail
    assert raising.stats()["reward/errors_total"] == 1


def test_hung_function_times_out_and_the_scorer_keeps_going(scorer_of):
    user_rewards.RELEASE.clear()
    scorer = scorer_of(spec("python", function=f"{USER}:hang_if_asked"), timeout_s=0.2, workers=1)
    t0 = time.monotonic()
    results = scorer.score([sample("a", metadata={"hang": True}), sample("b"), sample("c")])
    elapsed = time.monotonic() - t0
    try:
        assert [r.failed for r in results] == [True, False, False]
        assert [r.reward for r in results] == [0.0, 1.0, 1.0]
        assert results[0].error == "hang_if_asked: timed out after 0.2 s"
        # the one worker was stuck: a replacement scored b and c without waiting for the hung call
        assert elapsed < 2.0
        stats = scorer.stats()
        assert stats["reward/timeouts_total"] == 1 and stats["reward/abandoned_threads"] == 1
        assert [r.reward for r in scorer.score([sample("d"), sample("e")])] == [1.0, 1.0]
    finally:
        user_rewards.RELEASE.set()
    deadline = time.monotonic() + 2
    while scorer.stats()["reward/abandoned_threads"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scorer.stats()["reward/abandoned_threads"] == 0  # the released thread exited


def test_hung_async_function_is_cancelled(scorer_of):
    user_rewards.CANCELLED.clear()
    scorer = scorer_of(spec("python", function=f"{USER}:async_hang_if_asked"), timeout_s=0.2)
    results = scorer.score([sample("stuck", metadata={"hang": True}), sample("fine")])
    assert [r.failed for r in results] == [True, False] and "timed out" in results[0].error
    deadline = time.monotonic() + 2
    while not user_rewards.CANCELLED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert user_rewards.CANCELLED == ["stuck"]
    assert scorer.stats()["reward/abandoned_threads"] == 0  # coroutines hold no thread


def test_failure_policy_zero_or_drop_group(scorer_of):
    group_ok = [sample("1", metadata={"bonus": 1.0}), sample("2", metadata={"bonus": 0.0})]
    group_bad = [sample("3", metadata={"bonus": 1.0}), sample("4", metadata={})]  # KeyError: failed
    for policy, drops in [("zero", False), ("drop_group", True)]:
        scorer = scorer_of(spec("python", function=f"{USER}:from_metadata"), on_failure=policy)
        ok, bad = scorer.score(group_ok), scorer.score(group_bad)
        assert [r.reward for r in bad] == [1.0, 0.0] and bad[1].failed and "KeyError" in bad[1].error
        assert scorer.should_drop(ok) is False
        assert scorer.should_drop(bad) is drops


# ------------------------------------------------------------------------------------ reward model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny Qwen2 sequence classifier (one label) with the project's byte-level tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from fleetrl.learner.init_model import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=256, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm")
    tok.save_pretrained(out)
    Qwen2ForSequenceClassification(config).save_pretrained(out)
    return str(out)


def test_model_reward_equals_a_manual_forward_pass(reward_model_dir, scorer_of):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reward_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()

    def forward(text: str) -> float:  # one unpadded sequence: the logit at its last token
        with torch.no_grad():
            return model(**tok(text, return_tensors="pt")).logits[0, 0].item()

    chat = [{"role": "user", "content": "What is 2+2?"}]
    batch = [sample("4", prompt="2+2="), sample("four, I think", prompt="2+2="), sample("4", prompt=chat)]
    texts = ["2+2=4", "2+2=four, I think", "<|user|>What is 2+2?<eos><|assistant|>4<eos>"]
    expected = [forward(t) for t in texts]
    assert len(set(expected)) == 3
    reward = REWARDS["model"](path=reward_model_dir, batch_size=2)  # 2 + 1: padding and a partial batch
    assert reward(batch) == pytest.approx(expected, abs=1e-5)
    scorer = scorer_of(spec("model", 2.0, path=reward_model_dir), spec("length", target=0, penalty_per_token=0.01))
    results = scorer.score([sample("4", prompt="2+2=", num_tokens=1)])
    assert results[0].parts["model"] == pytest.approx(expected[0], abs=1e-5)
    assert results[0].reward == pytest.approx(2.0 * expected[0] - 0.01, abs=1e-5)


def test_model_reward_rejects_what_is_not_a_reward_model(reward_model_dir, tiny_model_dir, tmp_path):
    with pytest.raises(RewardArgsError, match="is not a model directory"):
        REWARDS["model"](path=str(tmp_path / "missing"))
    with pytest.raises(RewardArgsError, match="not a sequence-classification one"):
        REWARDS["model"](path=tiny_model_dir)  # a causal LM would get a random score head
    with pytest.raises(RewardArgsError, match="label 1 is out of range"):
        REWARDS["model"](path=reward_model_dir, label=1)


# ------------------------------------------------------------------------------- combination, API


def test_weighted_combination(scorer_of):
    scorer = scorer_of(
        spec("math", 1.0),
        spec("regex", 0.5, pattern=r"\\boxed"),
        spec("regex", 0.25, pattern="^The"),
        spec("length", 2.0, target=4, penalty_per_token=0.1),
    )
    [r] = scorer.score([sample("The answer is \\boxed{1/2}", "0.5", num_tokens=7)])
    # 1.0 * 1 + 0.5 * 1 + 0.25 * 1 + 2.0 * (-0.1 * (7 - 4)) = 1.75 - 0.6 = 1.15
    assert r.parts == pytest.approx({"math": 1.0, "regex": 1.0, "regex_2": 1.0, "length": -0.3})
    assert r.reward == pytest.approx(1.15) and not r.failed
    assert isinstance(r, RewardResult)
    assert scorer.score([]) == []
    fut = scorer.submit([sample("\\boxed{3}", "3", num_tokens=1), sample("no", "3", num_tokens=1)])
    assert [x.reward for x in fut.result(timeout=5)] == [1.5, 0.0]
    stats = scorer.stats()
    assert stats["reward/samples_total"] == 3 and stats["reward/regex_2/mean"] == pytest.approx(1 / 3)
    assert "reward/mean" not in scorer.stats()  # window means reset after each stats() call


def test_batch_reward_with_a_plain_factory(scorer_of):
    if "test_count_batch" not in REWARDS:  # a user-registered batch reward: factory -> list -> list

        @REWARDS.register("test_count_batch")
        def count_batch(extra: float = 0.0):
            return lambda batch: [len(batch) + extra] * (len(batch) if extra != -2 else 1)

    scorer = scorer_of(spec("test_count_batch", extra=1))
    assert [r.reward for r in scorer.score([sample("a"), sample("b")])] == [3.0, 3.0]
    nan = scorer_of(spec("test_count_batch", extra=float("nan"))).score([sample("a")])
    assert nan[0].failed and nan[0].error == "test_count_batch: returned non-finite nan"
    short = scorer_of(spec("test_count_batch", extra=-2)).score([sample("a"), sample("b")])
    assert all(r.failed for r in short) and "returned 1 scores for a batch of 2 samples" in short[0].error
    with pytest.raises(RewardArgsError, match=r"rollout.rewards\[0\].args: got an unexpected keyword argument 'extar'"):
        scorer_of(spec("test_count_batch", extar=1))


def test_unknown_reward_name_lists_valid_names():
    with pytest.raises(RegistryError) as e:
        RewardScorer([spec("math"), spec("maht")], timeout_s=1, workers=1, on_failure="zero")
    assert str(e.value) == (
        "rollout.rewards[1].name: unknown reward function 'maht' (did you mean 'math'?); valid names: "
        + ", ".join(REWARDS.names())
    )


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("regex", {"patern": "x"}, "unknown field `patern`; reward 'regex' takes: pattern, mode, flags, hit, miss"),
        ("regex", {}, "missing required field `pattern`"),
        ("regex", {"pattern": "("}, "is not a valid regular expression"),
        ("regex", {"pattern": "x", "flags": ["DOTAL"]}, "at `flags[0]`"),
        ("length", {"target": -1}, "Expected `int` >= 0 - at `target`"),
        ("math", {"strict": "yes"}, "Expected `bool`, got `str` - at `strict`"),
        ("python", {"function": "no_colon"}, "must look like 'pkg.module:function'"),
        ("python", {"function": "tests.rollout.nope:f"}, "cannot import 'tests.rollout.nope'"),
        ("python", {"function": f"{USER}:missing"}, f"module '{USER}' has no attribute 'missing'"),
        ("python", {"function": f"{USER}:NOT_CALLABLE"}, "is a int, not a function"),
        ("python", {"function": f"{USER}:needs_unknown"}, "missing a required argument: 'reference'"),
        ("python", {"function": f"{USER}:scaled", "kwargs": {"answer": 1}}, "clash with the per-sample arguments"),
        ("model", {"path": "/nonexistent/rm"}, "is not a model directory"),
    ],
)
def test_bad_args_fail_at_construction_naming_the_key(name, args, message):
    with pytest.raises(RewardArgsError) as e:
        RewardScorer([spec("length", target=1), RewardSpec(name=name, args=args)], timeout_s=1, workers=1)
    assert str(e.value).startswith("rollout.rewards[1].args: ")
    assert message in str(e.value)


def test_bad_scorer_settings_and_close():
    with pytest.raises(ValueError, match="rollout.rewards is empty"):
        RewardScorer([], timeout_s=1, workers=1)
    with pytest.raises(ValueError, match="rollout.on_reward_failure"):
        RewardScorer([spec("exact")], timeout_s=1, workers=1, on_failure="skip")
    scorer = RewardScorer([spec("exact")], timeout_s=1, workers=1)
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.submit([sample("x", "x")])


def test_importing_rewards_stays_light():
    probe = "import sys, fleetrl.rollout.rewards\nprint(sorted(m for m in ('torch', 'transformers', 'sympy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ batched TRL form and None = no score


def test_a_reward_function_in_trls_documented_batched_form_runs_as_written(scorer_of):
    scorer = scorer_of(spec("python", function=f"{USER}:reward_func"))
    batch = [
        sample(r"so \boxed{4}", metadata={"ground_truth": "4"}),
        sample(r"\boxed{5}", metadata={"ground_truth": "4"}),
        sample("no box", metadata={"ground_truth": "4"}),
    ]
    results = scorer.score(batch)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0] and not any(r.failed for r in results)
    assert results[0].parts == {"reward_func": 1.0}  # named after the function
    assert scorer.parts[0].reward.per_sample is False  # it names `completions`: batched, one call per batch


def test_none_is_no_score_counted_and_skipped_never_zero(scorer_of):
    scorer = scorer_of(spec("python", function=f"{USER}:multi_task_reward_func"), spec("length", 0.5, target=100))
    batch = [sample("2+2=4", metadata={"task": "math"}), sample("def f(): pass", metadata={"task": "code"})]
    math_row, code_row = scorer.score(batch)
    assert math_row.parts["multi_task_reward_func"] == 1.0 and code_row.scored and not code_row.failed
    assert "multi_task_reward_func" not in code_row.parts  # not a 0: absent
    assert code_row.reward == 0.5 * code_row.parts["length"]  # the weighted sum over the parts that scored it
    alone = scorer_of(spec("python", function=f"{USER}:none_per_sample"))
    skipped, kept = alone.score([sample("skip"), sample("keep")])
    assert not skipped.scored and not skipped.failed and kept.scored and kept.reward == 1.0
    stats = alone.stats()
    assert stats["reward/unscored_total"] == 1 and stats["reward/none_per_sample/unscored_total"] == 1
    assert stats["reward/none_per_sample/mean"] == 1.0  # the unscored sample is not averaged in as 0


def test_trls_own_accuracy_reward_with_chat_prompts(scorer_of):
    pytest.importorskip("trl")
    scorer = scorer_of(spec("python", function="trl.rewards:accuracy_reward"))
    chat = [{"role": "user", "content": "What is 1/3 as a fraction?"}]
    batch = [
        sample(r"My answer is \boxed{\frac{1}{3}}", prompt=chat, metadata={"solution": r"\frac{1}{3}"}),
        sample(r"My answer is \boxed{\frac{1}{2}}", prompt=chat, metadata={"solution": r"\frac{1}{3}"}),
        sample(r"\boxed{1}", prompt=chat, metadata={"solution": "no parseable gold here"}),
    ]
    right, wrong, unparseable = scorer.score(batch)
    assert right.reward == 1.0 and wrong.reward == 0.0 and not right.failed and not wrong.failed
    assert not unparseable.scored and not unparseable.failed  # TRL returns None: skipped, not a 0


def test_a_batched_function_missing_its_column_fails_naming_it(scorer_of):
    scorer = scorer_of(spec("python", function=f"{USER}:reward_func"))
    [r] = scorer.score([sample(r"\boxed{1}", metadata={"answer_text": "1"})])
    assert r.failed and "needs the data column(s) ['ground_truth']" in r.error


def test_a_batched_call_missing_a_column_lists_the_columns_the_rows_have():
    from fleetrl.rollout.rewards.python import PythonReward

    reward = PythonReward(function=f"{USER}:reward_func")
    with pytest.raises(ValueError, match=r"\['ground_truth'\].*\(columns: \['answer', 'level'\]\)"):
        reward([RewardInput(prompt="p", response="r", answer="1", metadata={"answer": "1", "level": 2})])
