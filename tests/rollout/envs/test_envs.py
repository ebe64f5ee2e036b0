"""Environments one by one, with a scripted engine (the model's side is fixed text, so each outcome is
known): tool calls, malformed calls, tool errors and timeouts, budgets, user-class failures, the
registry, the template check. Each outcome is counted; none is scored silently."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from fleetrl.common import messages as m
from fleetrl.common.chat.codec import ChatCodec, check_prefix_stable
from fleetrl.common.config import ConfigError, load_config
from fleetrl.common.config.env import EnvType, ToolParserName
from fleetrl.common.plugins.registry import RegistryError
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs import ENVS, Episode, create_env
from fleetrl.rollout.envs.base import TemplateMismatch
from fleetrl.rollout.envs.parsers import TOOL_PARSERS
from fleetrl.rollout.envs.tools import calc

PARAMS = SamplingParams(max_new_tokens=64)


class Scripted:
    """An engine whose turns are given texts (each ends with eos unless cut by max_new_tokens)."""

    version, max_positions = 0, 512

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.requests = tokenizer, list(texts), []

    async def generate(self, request):
        self.requests.append(request)
        text = self.texts.pop(0) if self.texts else "done"
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        cut = len(ids) > request.params.max_new_tokens
        ids = ids[: request.params.max_new_tokens]
        return Generation(
            ids, [-0.5] * len(ids), "length" if cut else "stop", self.tokenizer.decode(ids, skip_special_tokens=True)
        )


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def slow_tool(x: str) -> str:
    """Sleeps."""
    time.sleep(1.0)
    return x


def broken_tool(x: str) -> str:
    """Raises."""
    raise ZeroDivisionError("division by zero")


def cfg_of(tiny_model_dir, *overrides):
    return load_config(None, [f"model.path={tiny_model_dir}", *overrides])


def run(env, tok, texts, prompt="12*34=", answer="408"):
    engine = Scripted(tok, texts)
    task = env.task(m.Prompt("0:1", prompt, answer))
    ep = asyncio.run(env.episode(engine, task, PARAMS, "r/0", None))
    return ep, engine


TOOLS = [
    "rollout.env.type=tool",
    "rollout.env.tool.parser=pythonic",
    f"rollout.env.tool.tools=[fleetrl.rollout.envs.tools:calc, {__name__}:slow_tool, {__name__}:broken_tool]",
    "rollout.env.tool.timeout_s=0.3",
    "rollout.env.max_turns=4",
]


def test_tool_calls_run_and_the_answer_ends_the_episode(tiny_model_dir, tok):
    env = create_env(cfg_of(tiny_model_dir, *TOOLS), tok)
    ep, engine = run(env, tok, ['calc("12*34")', "408"])
    assert isinstance(ep, Episode) and not ep.failed and not ep.truncated and ep.finish_reason == "stop"
    assert ep.turns == 2 and ep.text == "408" and ep.reward is None  # scored by rollout.rewards
    assert ep.messages[2]["role"] == "tool" and ep.messages[2]["content"] == "408"
    # the second request's context = the first + its sampled tokens + the tool message as tokens
    first, second = engine.requests
    sampled = tok('calc("12*34")', add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = tok("<|tool|>408<eos><|assistant|>", add_special_tokens=False)["input_ids"]
    assert second.prompt_ids == first.prompt_ids + sampled + obs
    assert ep.loss_mask == [1] * len(sampled) + [0] * len(obs) + [1] * 4
    stats = env.metrics()
    assert stats["env/tool_calls_total"] == 1 and stats["env/tool_calls_wellformed_frac"] == 1.0
    assert stats["env/turns_mean"] == 2


def test_malformed_calls_and_tool_errors_are_answered_and_counted(tiny_model_dir, tok):
    env = create_env(cfg_of(tiny_model_dir, *TOOLS), tok)
    ep, _ = run(env, tok, ['calc("12*34"', "nosuch(x=1)", 'broken_tool("x")', "calc(1, 2)", "408"])
    assert not ep.failed and ep.turns == 4 and ep.truncated == "turns"  # max_turns=4 ends it, counted
    assert "malformed tool call" in ep.messages[2]["content"] and "unknown tool" in ep.messages[4]["content"]
    assert ep.messages[6]["content"] == "error: ZeroDivisionError: division by zero"
    assert "bad arguments" in ep.messages[8]["content"] or "positional" in ep.messages[8]["content"]
    stats = env.metrics()
    assert stats["env/malformed_tool_calls_total"] == 3 and stats["env/tool_errors_total"] == 1
    assert stats["env/tool_calls_total"] == 1 and stats["env/tool_calls_wellformed_frac"] == 0.25
    assert stats["env/truncated_total"] == 1 and stats["env/truncated/turns_total"] == 1


def test_a_tool_timeout_fails_the_sample(tiny_model_dir, tok):
    env = create_env(cfg_of(tiny_model_dir, *TOOLS), tok)
    ep, _ = run(env, tok, ['slow_tool("x")', "408"])
    assert ep.failed and ep.failure == "timeouts" and "slow_tool" in ep.error
    assert env.metrics()["env/timeouts_total"] == 1


def test_budgets_end_episodes_and_are_counted(tiny_model_dir, tok):
    env = create_env(
        cfg_of(tiny_model_dir, *TOOLS, "rollout.env.max_total_tokens=30", "rollout.env.max_tokens_per_turn=14"), tok
    )
    # 12 sampled + 11 observation tokens, then 7 left: the second call is cut by the episode's budget
    ep, engine = run(env, tok, ['calc("1+1")', 'calc("2+2")', "4"])
    assert [r.params.max_new_tokens for r in engine.requests] == [14, 7]
    assert ep.truncated == "total_tokens" and ep.finish_reason == "length" and not ep.failed
    assert len(ep.token_ids) == 30 and sum(ep.loss_mask) == 12 + 7
    # a turn cut by max_tokens_per_turn ends that turn only: the environment answers it as it stands
    short = create_env(cfg_of(tiny_model_dir, *TOOLS, "rollout.env.max_tokens_per_turn=5"), tok)
    ep, _ = run(short, tok, ["hello world"])
    assert ep.text == "hello" and ep.truncated == "" and ep.turns == 1
    assert env.metrics()["env/truncated/total_tokens_total"] == 1 and short.metrics()["env/turns_cut_total"] == 1


USER = ["rollout.env.type=user", "rollout.env.step_timeout_s=0.5"]
CHATTER = "tests.rollout.envs.envs_for_tests:Chatter"


@pytest.mark.parametrize(
    "mode,kind", [("raise", "errors"), ("sleep", "timeouts"), ("bad", "errors"), ("nan", "errors")]
)
def test_user_env_failures_drop_the_sample_and_are_counted(tiny_model_dir, tok, mode, kind):
    env = create_env(
        cfg_of(
            tiny_model_dir,
            *USER,
            "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:Flaky",
            f"rollout.env.user.args={{mode: {mode}, at: 2, every: 1}}",
        ),
        tok,
    )
    ep, _ = run(env, tok, ["a", "b", "c"])
    assert ep.failed and ep.failure == kind and ep.reward is None
    assert env.metrics()[f"env/{kind}_total"] == 1


def test_user_env_async_and_rewards(tiny_model_dir, tok):
    env = create_env(
        cfg_of(
            tiny_model_dir,
            *USER,
            "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:AsyncChatter",
            "rollout.env.user.args={turns: 3}",
        ),
        tok,
    )
    ep, _ = run(env, tok, ["1", "x", "2"])
    assert not ep.failed and ep.turns == 3 and ep.reward == 2.0  # two of the three turns had a digit
    assert env.metrics()["env/info/steps_total"] == 3


def test_an_environment_reward_keeps_its_named_parts(tiny_model_dir, tok):
    from fleetrl.rollout import group_rule

    env = create_env(
        cfg_of(
            tiny_model_dir,
            *USER,
            "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:PartsChatter",
            "rollout.env.user.args={turns: 3}",
        ),
        tok,
    )
    ep, _ = run(env, tok, ["1", "x", "2"])
    assert not ep.failed and ep.reward_parts == {"digit": 2.0, "turn": 3.0}  # summed over the steps, per name
    assert ep.reward == pytest.approx(2.3)
    (result,) = group_rule.score(None, [None], [ep]).result()  # the environment's reward: no scorer asked
    assert result.reward == pytest.approx(2.3) and result.parts == {"digit": 2.0, "turn": 3.0}
    chatter = cfg_of(tiny_model_dir, *USER, f"rollout.env.user.cls={CHATTER}", "rollout.env.user.args={turns: 3}")
    plain, _ = run(create_env(chatter, tok), tok, ["1", "x", "2"])
    assert plain.reward == 2.0 and plain.reward_parts == {}
    assert group_rule.score(None, [None], [plain]).result()[0].parts == {"env": plain.reward}  # no parts: one


def test_config_errors_name_the_key(tiny_model_dir, tok):
    with pytest.raises(ConfigError, match=r"rollout.env.user.cls.*must be a class"):
        create_env(
            cfg_of(
                tiny_model_dir,
                "rollout.env.type=user",
                "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:NoClass",
            ),
            tok,
        )
    with pytest.raises(ConfigError, match=r"rollout.env.user.args"):
        create_env(
            cfg_of(
                tiny_model_dir,
                "rollout.env.type=user",
                "rollout.env.user.args={nope: 1}",
                "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:Chatter",
            ),
            tok,
        )
    with pytest.raises(ConfigError, match=r"rollout.env.tool.tools\[0\]"):
        create_env(cfg_of(tiny_model_dir, "rollout.env.type=tool", "rollout.env.tool.tools=[nowhere.mod:fn]"), tok)
    with pytest.raises(RegistryError, match="valid names"):
        ENVS["nope"]


def test_registries_match_the_config_literals():
    assert sorted(ENVS.names()) == sorted(EnvType.__args__)
    assert sorted(TOOL_PARSERS.names()) == sorted(ToolParserName.__args__)


def test_parsers():
    params = {"calc": ["expression"]}
    h = TOOL_PARSERS["hermes"]('ok <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>', params)
    assert h.content == "ok" and h.calls[0].name == "calc" and h.calls[0].arguments == {"expression": "1+2"}
    assert TOOL_PARSERS["hermes"]("<tool_call>{bad</tool_call>", params).malformed
    assert TOOL_PARSERS["hermes"]('<tool_call>{"name": "calc"', params).malformed
    p = TOOL_PARSERS["pythonic"]('[calc("1+2"), calc(expression="3")]', params)
    assert [c.arguments for c in p.calls] == [{"expression": "1+2"}, {"expression": "3"}]
    assert TOOL_PARSERS["pythonic"]("calc(x + 1)", params).malformed  # not a literal
    assert TOOL_PARSERS["pythonic"]("the answer is 3", params).content == "the answer is 3"
    j = TOOL_PARSERS["json"]('{"name": "calc", "arguments": "{\\"expression\\": \\"2\\"}"}', params)
    assert j.calls[0].arguments == {"expression": "2"}
    assert calc("12*34") == "408" and calc("7/2") == "3.5"


class QwenLike:
    """A tokenizer stand-in whose template drops earlier assistant reasoning (<think>...</think>), the
    classic template that is not prefix-stable."""

    chat_template = "x"
    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kw):
        out = ""
        last_user = max(i for i, x in enumerate(messages) if x["role"] != "assistant")
        for i, x in enumerate(messages):
            content = x["content"]
            if x["role"] == "assistant" and i < last_user:
                content = content.split("</think>")[-1]
            out += f"<{x['role']}>{content}</end>"
        return out + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_prefix_check_names_the_first_mismatching_position(tok):
    check_prefix_stable(
        ChatCodec(tok),
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "t"},
            {"role": "assistant", "content": "b"},
        ],
    )
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>hm</think>a"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "b"},
    ]
    with pytest.raises(TemplateMismatch, match=r"character 24 \(token 24\)"):
        check_prefix_stable(ChatCodec(QwenLike()), conv)
