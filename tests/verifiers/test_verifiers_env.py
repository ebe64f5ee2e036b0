"""`rollout.env.type: verifiers` on its own: the local taskset `fleet_arith` exported as a prompt set, episodes
on a scripted engine (the model's side fixed, so each reward is known) and on the real hf engine, scored by the
taskset's rubric; and the config errors, each naming the key and the fix."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from fleetrl.broker.server.prompts import rows_to_prompts
from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.data.tables import load_rows
from fleetrl.rollout.engines import create_engine
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs import create_env
from fleetrl.rollout.envs.verifiers_env import export
from tests.verifiers.fleet_arith import digit_share

ENV = ["rollout.env.type=verifiers", "rollout.env.verifiers.taskset=fleet_arith", "rollout.env.verifiers.args={n: 8}"]


class Scripted:
    """An engine whose turns are given texts (each ends with eos)."""

    version, max_positions = 0, 512

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.requests = tokenizer, list(texts), []

    async def generate(self, request):
        self.requests.append(request)
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), "stop", self.tokenizer.decode(ids, skip_special_tokens=True))


def cfg_of(tiny_model_dir, data, *overrides):
    return load_config(None, [f"model.path={tiny_model_dir}", f"data.train={data}", *ENV, *overrides])


@pytest.fixture
def exported(tmp_path, tiny_model_dir):
    out = tmp_path / "tasks.jsonl"
    cfg = cfg_of(tiny_model_dir, out)
    assert export(cfg.rollout.env.verifiers, str(out), None) == 8
    prompts = rows_to_prompts(load_rows(out, "data.train", cfg.data), "prompt", "answer", str(out))
    return cfg, prompts, [json.loads(line) for line in out.read_text().splitlines()]


def test_the_export_is_a_prompt_set_that_keeps_each_task(exported):
    _, prompts, rows = exported
    assert len(prompts) == 8 and len({r["vf_key"] for r in rows}) == 8
    first = rows[0]
    a, b = first["prompt"][0]["content"].rstrip("=").split("+")
    assert first["prompt"] == [{"role": "user", "content": f"{a}+{b}="}]
    assert first["answer"] == str(int(a) + int(b)) == first["vf_task"]["answer"]
    assert prompts[0].metadata["vf_task"]["id"] == "sum-0"


def test_episodes_are_scored_by_the_taskset_rubric(exported, tiny_model_dir):
    cfg, prompts, _ = exported
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = create_env(cfg, tok)
    answer = prompts[0].answer
    replies = [answer, "no", f"{answer}x"]  # exact; neither; digits only in part
    engine = Scripted(tok, list(replies))
    eps = [
        asyncio.run(env.episode(engine, env.task(prompts[0]), SamplingParams(max_new_tokens=16), f"r/{i}", None))
        for i in range(3)
    ]
    for ep, reply in zip(eps, replies):
        assert not ep.failure, ep.error
        exact = float(reply == answer)
        assert ep.reward_parts == {"exact": exact, "digits": pytest.approx(digit_share(reply))}
        assert ep.reward == pytest.approx(exact + 0.5 * digit_share(reply))
        assert ep.loss_mask.count(1) == len(tok(reply, add_special_tokens=False)["input_ids"]) + 1
    # the model saw the task's prompt through the chat template, token for token
    expected = tok.apply_chat_template(prompts[0].prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert engine.requests[0].prompt_ids == list(expected)
    metrics = env.metrics()
    assert metrics["reward/exact/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/digits/mean"] == pytest.approx(sum(digit_share(r) for r in replies) / 3)
    assert metrics["verifiers/reply_chars/mean"] == pytest.approx(sum(len(r) for r in replies) / 3)
    assert "reward/exact/mean" not in env.metrics()  # means of the window since the last read


def test_an_episode_on_the_real_engine(exported, tiny_model_dir):
    _, prompts, _ = exported
    cfg = cfg_of(tiny_model_dir, "unused.jsonl", "rollout.max_new_tokens=8")
    engine = create_engine("hf", cfg.model, cfg.rollout, "cpu", 0, num_threads=1)
    try:
        env = create_env(cfg, engine.tokenizer)
        params = SamplingParams(max_new_tokens=8, temperature=1.0)
        ep = engine.loop.call(env.episode(engine, env.task(prompts[1]), params, "r/0", None), timeout=120)
    finally:
        engine.close()
    assert not ep.failure and ep.turns == 1 and 1 <= ep.loss_mask.count(1) <= 8
    reply = ep.text.strip()
    assert ep.reward == pytest.approx(float(reply == prompts[1].answer) + 0.5 * digit_share(reply))


def test_a_row_that_is_not_a_verifiers_task_fails_the_sample(exported, tiny_model_dir):
    cfg, prompts, _ = exported
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env = create_env(cfg, tok)
    prompt = prompts[0]
    prompt.metadata.pop("vf_task")
    ep = asyncio.run(env.episode(Scripted(tok, ["1"]), env.task(prompt), SamplingParams(max_new_tokens=8), "r", None))
    assert ep.failure == "errors" and "fleetrl verifiers-data" in ep.error


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["rollout.env.verifiers.taskset=no_such_taskset"], ["rollout.env.verifiers.taskset='no_such_taskset'"]),
        (["rollout.env.verifiers.args={n: many}"], ["rollout.env.verifiers.args", "ArithConfig", "n:"]),
        (["rollout.env.verifiers.args={n: 0}"], ["rollout.env.verifiers.taskset", "no tasks"]),
        (["rollout.env.verifiers.taskset=fleetrl"], ["rollout.env.verifiers.taskset='fleetrl'", "vf.Taskset"]),
        (
            ["rollout.env.verifiers.taskset=fleet_sync_rubric", "rollout.env.verifiers.args={}"],
            ["exact must be `async"],
        ),
        (
            ["rollout.env.verifiers.taskset=fleet_no_reward", "rollout.env.verifiers.args={}"],
            ["no reward (@vf.reward)"],
        ),
        (
            ["rollout.env.verifiers.args={task: {judges: [{id: reference}]}}"],
            ["'fleet_arith': its tasks are", "judges"],
        ),
        (
            ["rollout.env.verifiers.args={task: {judges: [{id: no_such_judge}]}}"],
            ["rollout.env.verifiers.args", "judge"],
        ),
    ],
)
def test_bad_config_names_the_key_and_the_fix(tmp_path, tiny_model_dir, overrides, says):
    cfg = cfg_of(tiny_model_dir, tmp_path / "x.jsonl", *overrides)
    with pytest.raises(ConfigError) as e:
        create_env(cfg, AutoTokenizer.from_pretrained(tiny_model_dir))
    for part in says:
        assert part in str(e.value), str(e.value)


def test_config_validate_says_how_to_write_the_prompt_set(tmp_path, tiny_model_dir):
    from fleetrl.app.checks import check_env

    missing = tmp_path / "tasks.jsonl"
    assert any(
        "fleetrl verifiers-data" in p and "does not exist" in p for p in check_env(cfg_of(tiny_model_dir, missing))
    )
    other = tmp_path / "arith.jsonl"
    other.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert any("not a verifiers export" in p for p in check_env(cfg_of(tiny_model_dir, other)))
    export(cfg_of(tiny_model_dir, missing).rollout.env.verifiers, str(missing), 4)
    assert check_env(cfg_of(tiny_model_dir, missing)) == []
