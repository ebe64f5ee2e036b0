"""Real streaming, what an agent sees of special tokens, and resends of older calls (issue 28).

- ``stream: true`` sends deltas as the tokens are sampled: the engine is held after its third token
  until the client has received a delta, so a reply sent whole at the end would never get there;
- a special token sampled mid-reply is trained, so the agent sees it too (it used to be stripped: 1,198
  of 3,521 replies of a random model differed from what was trained);
- a resend of an *older* call of a session gets that call's recorded reply (only the last one was kept);
- the vLLM engine's streaming path (cumulative outputs -> ``on_token``), with a stand-in for vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

from fleetrl.common.config import load_config
from fleetrl.rollout.endpoint.server import Endpoint
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Request
from tests.rollout.endpoint.test_endpoint import AgentFleet
from tests.rollout.test_server import wait_for


class Gated:
    """The engine; a streaming request's third token waits until ``seen`` is set (at most 5 s)."""

    def __init__(self, engine):
        self.inner, self.seen, self.waited = engine, threading.Event(), None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        if request.on_token is not None:
            inner, count = request.on_token, [0]

            def on_token(ids):
                count[0] += len(ids)
                if count[0] == 3:  # the decode thread waits: no fourth token before the client saw a delta
                    self.waited = self.seen.wait(5.0)
                inner(ids)

            request.on_token = on_token
        return await self.inner.generate(request)


@pytest.fixture(scope="module")
def gated(engine, tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "rollout.openai.enabled=true", "rollout.openai.port=0"])
    eng = Gated(engine)
    ep = Endpoint(cfg, eng)
    ep.start()
    yield ep, eng
    ep.close()


def test_the_first_delta_arrives_before_the_last_token_is_sampled(gated):
    ep, eng = gated
    c = openai.OpenAI(base_url=ep.base_url, api_key="x", max_retries=0, timeout=60)
    for seed in range(8):  # a seeded reply (the same every run) long enough, whose first token shows text
        eng.seen.clear()
        eng.waited = None
        deltas, finish = [], None
        stream = c.completions.create(
            model="m",
            prompt="Once upon a time",
            max_tokens=24,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                deltas.append(chunk.choices[0].text)
                eng.seen.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage
        eng.seen.set()
        if usage.completion_tokens >= 6 and eng.waited:
            break
    assert eng.waited is True  # the engine was held at token 3 until the client had a delta: it was streamed
    assert len(deltas) >= 2 and finish in ("stop", "length")
    whole = c.completions.create(model="m", prompt="Once upon a time", max_tokens=24, seed=seed)
    assert "".join(deltas) == whole.choices[0].text  # the deltas add up to the reply
    chat = list(
        c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=seed, stream=True
        )
    )
    eng.seen.set()
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason is not None


def test_special_tokens_sampled_mid_reply_are_seen_and_an_older_call_is_replayed(engine, tiny_model_dir):
    fleet = AgentFleet(
        engine,
        tiny_model_dir,
        "rollout.env.min_group_samples=1",
        "rollout.env.max_turns=3",
        "rollout.max_new_tokens=16",
        "rollout.openai.session_timeout_s=3",
    )
    tok = engine.tokenizer
    specials = [t for t in tok.all_special_tokens if t != tok.eos_token]
    found = None
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        root = fleet.server.endpoint.root
        for k in range(40):  # a random model samples a special token in ~2% of its tokens
            s = httpx.post(f"{root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json()
            c = openai.OpenAI(base_url=s["base_url"], api_key="x", max_retries=0, timeout=30)
            ask = [{"role": "user", "content": s["task"]["prompt"]}]
            first = c.chat.completions.create(model="m", messages=ask)
            later = ask + [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
            second = c.chat.completions.create(model="m", messages=later)
            again = c.chat.completions.create(model="m", messages=ask)  # a resend of the *first* call
            assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
            replies = [first.choices[0].message.content, second.choices[0].message.content]
            httpx.post(f"{root}/fleetrl/sessions/{s['session_id']}/close", json={"reward": float(k)})
            if any(sp in r for r in replies for sp in specials):
                found = (float(k), replies)
                break
        assert found is not None, "no special token sampled in 40 sessions"
        groups = []
        wait_for(
            lambda: groups.extend(fleet.drain()) or any(found[0] in g.rewards for g in groups),
            30,
            "the session's group",
        )
    finally:
        fleet.stop()
    assert fleet.server.endpoint.counts["calls_replayed"] >= 1
    g = next(g for g in groups if found[0] in g.rewards)
    i = g.rewards.index(found[0])
    tokens, mask = g.response_tokens(i).tolist(), g.loss_mask_array()[g.offsets()[i] : g.offsets()[i + 1]]
    cuts = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    segments = [tokens[a:b] for a, b in zip(cuts[::2], cuts[1::2])]
    shown = [tok.decode(x[:-1] if x[-1] == tok.eos_token_id else x, skip_special_tokens=False) for x in segments]
    assert shown == found[1]  # what the agent got is what is trained, special tokens and all


def test_the_vllm_engine_streams_cumulative_outputs(monkeypatch):
    from fleetrl.rollout.engines import vllm as vllm_engine

    def output(ids, finish=None):
        lp = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        return SimpleNamespace(
            outputs=[SimpleNamespace(token_ids=list(ids), logprobs=lp, finish_reason=finish, text="x" * len(ids))]
        )

    class FakeLLM:  # vLLM's AsyncLLM.generate with output_kind CUMULATIVE: every output holds all tokens so far
        def __init__(self):
            self.params = None

        async def generate(self, prompt, params, request_id, **kw):
            self.params = params
            for k in (1, 3, 3, 5):
                yield output([7, 8, 9, 10, 11][:k], "stop" if k == 5 else None)

    monkeypatch.setattr(vllm_engine, "to_vllm_params", lambda params, stream=False: {"stream": stream})
    monkeypatch.setattr(vllm_engine, "check_params_fit", lambda params, mode: None)
    eng = vllm_engine.VllmEngine.__new__(vllm_engine.VllmEngine)
    eng._llm, eng.version, eng.mode = FakeLLM(), 0, "raw_logprobs"
    got = []
    gen = asyncio.run(eng.generate(Request([1, 2], SamplingParams(), on_token=got.append)))
    assert got == [[7], [8, 9], [10, 11]] and gen.token_ids == [7, 8, 9, 10, 11]
    assert eng._llm.params == {"stream": True}
    asyncio.run(eng.generate(Request([1, 2], SamplingParams())))
    assert eng._llm.params == {"stream": False}  # rollouts do not stream: only the final output


class Scripted:
    """The engine, replaying a fixed reply token by token through ``on_token``; the token at ``hold`` (an index
    into the reply) waits until ``seen`` is set (at most ``patience`` s), and ``waited`` says whether it was."""

    def __init__(self, engine, text: str, hold: int, patience: float = 5.0):
        tok = engine.tokenizer
        self.inner, self.text = engine, text
        self.ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        self.hold, self.patience, self.seen, self.waited = hold, patience, threading.Event(), None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        from fleetrl.rollout.engines.records import Generation

        tok, stops = self.inner.tokenizer, request.params.stop or []
        out: list[int] = []

        def emit():  # like the engines: a stop string ends the reply, its text cut before it
            for k, t in enumerate(self.ids):
                if k == self.hold and request.on_token is not None:
                    self.waited = self.seen.wait(self.patience)
                out.append(t)
                if request.on_token is not None:
                    request.on_token([t])
                if any(stop in tok.decode(out) for stop in stops):
                    return

        await asyncio.get_running_loop().run_in_executor(None, emit)
        text = tok.decode(out, skip_special_tokens=True)
        cut = [i for i in (text.find(stop) for stop in stops) if i >= 0]
        return Generation(out, [-0.5] * len(out), "stop", text[: min(cut)] if cut else self.text)


GUESS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the number",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    }
]
CALL = '<tool_call>{"name": "guess", "arguments": {"n": 7}}</tool_call>'


def scripted_endpoint(engine, tiny_model_dir, text, *overrides, patience=5.0):
    cfg = load_config(
        None,
        [f"model.path={tiny_model_dir}", "rollout.openai.enabled=true", "rollout.openai.port=0", *overrides],
    )
    prefix = engine.tokenizer.encode(text[: text.find("<tool_call>")], add_special_tokens=False)
    eng = Scripted(engine, text, hold=len(prefix) + 3, patience=patience)  # inside the tool call's marker
    ep = Endpoint(cfg, eng)
    ep.start()
    return ep, eng


def stream_call(ep, eng):
    """(content deltas, the tool_calls deltas, finish reason, whether a delta came before the call's tokens)."""
    c = openai.OpenAI(base_url=ep.base_url, api_key="x", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Guess a number from 1 to 10."}]
    content, calls, finish = [], [], None
    for chunk in c.chat.completions.create(model="m", messages=ask, tools=GUESS, stream=True):
        choice = chunk.choices[0]
        if choice.delta.content:
            content.append(choice.delta.content)
            eng.seen.set()
        calls.extend(choice.delta.tool_calls or [])
        finish = choice.finish_reason or finish
    eng.seen.set()
    whole = c.chat.completions.create(model="m", messages=ask, tools=GUESS)
    return content, calls, finish, eng.waited, whole.choices[0].message


def test_a_reply_with_a_tool_call_streams_its_text_before_the_call(engine, tiny_model_dir):
    ep, eng = scripted_endpoint(engine, tiny_model_dir, f"Let me think: seven.\n{CALL}")
    try:
        content, calls, finish, waited, whole = stream_call(ep, eng)
    finally:
        ep.close()
    assert waited is True  # the engine was held inside the call's tokens until the client had the text
    assert "".join(content) == "Let me think: seven." == whole.content  # the deltas add up to the reply's content
    assert not any("<" in d for d in content)  # no part of the marker was sent as text
    assert assemble(calls) == [(calls[0].id, "guess", '{"n": 7}')] and calls[0].function.name == "guess"
    assert json.loads(assemble(calls)[0][2]) == json.loads(whole.tool_calls[0].function.arguments)
    assert finish == "tool_calls"


def test_a_tool_reply_that_cannot_stream_comes_whole_at_the_end(engine, tiny_model_dir):
    # a reply opening with whitespace (its content is stripped only when it holds a call: the text waits) ...
    ep, eng = scripted_endpoint(engine, tiny_model_dir, f"  Seven.\n{CALL}", patience=1.0)
    try:
        content, calls, finish, waited, whole = stream_call(ep, eng)
    finally:
        ep.close()
    assert waited is False and "".join(content) == "Seven." == whole.content and finish == "tool_calls"
    assert [name for _, name, _ in assemble(calls)] == ["guess"]  # its text at the end; the call streams
    # ... and a parser that reads the whole turn as one call (pythonic: the engine is not asked to stream)
    ep, eng = scripted_endpoint(engine, tiny_model_dir, "guess(n=7)", "rollout.env.tool.parser=pythonic")
    try:
        content, calls, finish, waited, whole = stream_call(ep, eng)
    finally:
        ep.close()
    assert waited is None and content == [] and whole.content is None and finish == "tool_calls"
    assert [(d.function.name, d.function.arguments) for d in calls] == [("guess", '{"n": 7}')]


def assemble(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from streamed ``tool_calls`` deltas, as an OpenAI client accumulates them."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, ["", "", ""])
        call[0] += d.id or ""
        call[1] += (d.function.name or "") if d.function else ""
        call[2] += (d.function.arguments or "") if d.function else ""
    return [tuple(calls[k]) for k in sorted(calls)]


def stream_arguments(ep, eng):
    """The streamed call deltas (the engine released once an arguments piece arrived), the finish reason, and a
    non-streamed reply to the same call."""
    c = openai.OpenAI(base_url=ep.base_url, api_key="x", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "Guess a number from 1 to 10."}]
    calls, finish, content = [], None, ""
    for chunk in c.chat.completions.create(model="m", messages=ask, tools=GUESS, stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            calls.append(d)
            if d.function and d.function.arguments:
                eng.seen.set()
        finish = choice.finish_reason or finish
    eng.seen.set()
    whole = c.chat.completions.create(model="m", messages=ask, tools=GUESS)
    return calls, finish, content, whole.choices[0].message


LONG = '{"n": 7, "why": "seven is a lucky number, and lucky numbers win guessing games"}'


def test_a_tool_calls_arguments_stream_in_pieces_as_they_are_sampled(engine, tiny_model_dir):
    # two calls; the engine is held at the token of "games" (inside the first call's arguments) until the client
    # has a piece of those arguments: a call sent whole at the end would never get there
    text = f'Two tries.\n<tool_call>{{"name": "guess", "arguments": {LONG}}}</tool_call>\n{CALL}'
    ep, eng = scripted_endpoint(engine, tiny_model_dir, text)
    tok = engine.tokenizer
    eng.hold = len(tok.encode(text[: text.find("games")], add_special_tokens=False))
    try:
        calls, finish, content, whole = stream_arguments(ep, eng)
        unconfirmed = ep.counts["stream_calls_unconfirmed"]
    finally:
        ep.close()
    assert eng.waited is True and finish == "tool_calls" and content == "Two tries." and unconfirmed == 0
    got = assemble(calls)
    assert [(name, args) for _, name, args in got] == [("guess", LONG), ("guess", '{"n": 7}')]
    assert [json.loads(a) for _, _, a in got] == [json.loads(c.function.arguments) for c in whole.tool_calls]
    first = [d for d in calls if d.index == 0]
    assert first[0].id and first[0].type == "function" and first[0].function.name == "guess"
    assert all(d.id is None and d.function.name is None for d in first[1:])  # id and name once, first
    pieces = [d.function.arguments for d in first if d.function.arguments]
    assert len(pieces) >= 2 and "games" not in pieces[0]  # a piece went out before "games" was sampled


UNCLOSED = 'Hm.\n<tool_call>{"name": "guess", "arguments": {"n": 7, "why": "no end in sight'


def test_a_streamed_call_the_turn_does_not_confirm_is_counted_and_the_client_keeps_it(engine, tiny_model_dir):
    ep, eng = scripted_endpoint(engine, tiny_model_dir, UNCLOSED, patience=0.5)
    try:
        calls, finish, content, whole = stream_arguments(ep, eng)
        unconfirmed = ep.counts["stream_calls_unconfirmed"]
    finally:
        ep.close()
    assert whole.tool_calls is None and whole.content == UNCLOSED  # not a call once parsed: the raw text
    assert content == UNCLOSED and finish == "stop" and unconfirmed == 1
    [(_, name, args)] = assemble(calls)
    assert name == "guess" and args == '{"n": 7, "why": "no end in sight'


def test_a_session_takes_a_streamed_reply_back_as_its_client_assembled_it(engine, tiny_model_dir):
    # the first reply's call never closes (not a call once parsed), yet the client holds the call it streamed;
    # an agent sending that back must not find its session stuck on "message 1 differs"
    eng = Scripted(engine, UNCLOSED, hold=-1)
    fleet = AgentFleet(eng, tiny_model_dir, "rollout.env.min_group_samples=1", "rollout.openai.session_timeout_s=5")
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        s = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json()
        c = openai.OpenAI(base_url=s["base_url"], api_key="x", max_retries=0, timeout=30)
        ask = [{"role": "user", "content": s["task"]["prompt"]}]
        content, deltas = "", []
        for chunk in c.chat.completions.create(model="m", messages=ask, tools=GUESS, stream=True):
            content += chunk.choices[0].delta.content or "" if chunk.choices else ""
            deltas += (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []
        [(cid, name, args)] = assemble(deltas)
        assembled = {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}],
        }
        later = ask + [assembled, {"role": "tool", "tool_call_id": cid, "content": "bad arguments"}]
        second = c.chat.completions.create(model="m", messages=later, tools=GUESS)  # 400 before
        assert second.choices[0].message.content == UNCLOSED
        wrong = dict(
            assembled, tool_calls=[{**assembled["tool_calls"][0], "function": {"name": name, "arguments": "{}"}}]
        )
        with pytest.raises(openai.BadRequestError, match="message 1 differs"):  # another call is still refused
            c.chat.completions.create(model="m", messages=ask + [wrong, later[2]], tools=GUESS)
    finally:
        fleet.stop()
    assert fleet.server.endpoint.counts["stream_calls_unconfirmed"] == 1


def test_a_stop_string_inside_a_calls_arguments_ends_what_streams_of_them(engine, tiny_model_dir):
    text = f'<tool_call>{{"name": "guess", "arguments": {LONG}}}</tool_call>'
    ep, eng = scripted_endpoint(engine, tiny_model_dir, text, patience=0.5)
    try:
        c = openai.OpenAI(base_url=ep.base_url, api_key="x", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Guess."}]
        deltas, content = [], ""
        for chunk in c.chat.completions.create(model="m", messages=ask, tools=GUESS, stop=["lucky"], stream=True):
            content += chunk.choices[0].delta.content or ""
            deltas += chunk.choices[0].delta.tool_calls or []
    finally:
        ep.close()
    [(_, name, args)] = assemble(deltas)
    # the reply ends before "lucky": no piece of the arguments past it went out, and the cut call is content
    assert name == "guess" and args == '{"n": 7, "why": "seven is a ' and content == text[: text.find("lucky")]
