"""The OpenAI-compatible endpoint with the official `openai` client: inference round trips, OpenAI-style
errors, and training sessions through the real server loop and the broker twin (an agent that only
changed its base_url; the groups it produced; a session left open times out and is not trained)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

from fleetrl.common.config import load_config
from fleetrl.rollout.endpoint.server import Endpoint
from tests.rollout.test_server import Fleet, wait_for

KEY = "sekrit"


@pytest.fixture(scope="module")
def plain(engine, tiny_model_dir):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "rollout.openai.enabled=true",
            "rollout.openai.port=0",
            f"rollout.openai.api_key={KEY}",
            "rollout.max_new_tokens=8",
        ],
    )
    ep = Endpoint(cfg, engine)
    ep.start()
    yield ep
    ep.close()


def client(base_url, key=KEY):
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def test_round_trip_with_the_openai_client(plain, engine):
    c = client(plain.base_url)
    assert [m.id for m in c.models.list().data] == ["fleetrl"]
    r = c.chat.completions.create(
        model="fleetrl", messages=[{"role": "user", "content": "12+30="}], max_tokens=5, temperature=0, logprobs=True
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 5 and len(choice.logprobs.content) == r.usage.completion_tokens
    # the same as calling the engine directly with the template's prompt (greedy)
    from fleetrl.rollout.engines.params import SamplingParams

    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+30="}], add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    direct = engine.generate_batch([ids], SamplingParams(temperature=0, max_new_tokens=5), 1)[0][0]
    assert choice.message.content == direct.text and r.usage.prompt_tokens == len(ids)
    t = c.completions.create(model="fleetrl", prompt="07+58=", max_tokens=4, n=2, seed=3)
    assert len(t.choices) == 2 and all(len(x.text) <= 4 for x in t.choices)


def test_streamed_events_add_up_to_the_reply(plain):
    c, messages = client(plain.base_url), [{"role": "user", "content": "12+30="}]
    whole = c.chat.completions.create(model="fleetrl", messages=messages, max_tokens=5, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model="fleetrl",
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == whole.choices[0].message.content and finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    texts = list(c.completions.create(model="fleetrl", prompt="07+58=", max_tokens=4, temperature=0, stream=True))
    assert (
        "".join(t.choices[0].text for t in texts)
        == c.completions.create(model="fleetrl", prompt="07+58=", max_tokens=4, temperature=0).choices[0].text
    )
    assert [t.choices[0].finish_reason for t in texts if t.choices[0].finish_reason] in (["stop"], ["length"])


def test_errors_come_in_openai_format(plain):
    c = client(plain.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="x", messages=[])
    assert e.value.code == "invalid_value" and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="stream"):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], extra_body={"stream": 3})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "a"}], temperature=9)
    with pytest.raises(openai.AuthenticationError):
        client(plain.base_url, key="wrong").models.list()
    r = httpx.post(f"{plain.root}/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(
        f"{plain.base_url}/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{plain.root}/fleetrl/sessions", headers={"Authorization": f"Bearer {KEY}"}, json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_sessions"


# ------------------------------------------------------------------------------ training sessions

G = 2
SESSIONS = [
    "rollout.env.type=openai",
    "rollout.openai.enabled=true",
    "rollout.openai.port=0",
    f"rollout.group_size={G}",
    "rollout.prompts_per_batch=1",
    "rollout.env.max_turns=4",
    "rollout.max_new_tokens=6",
]


class AgentFleet(Fleet):
    def __init__(self, engine, tiny_model_dir, *overrides):
        super().__init__(engine, tiny_model_dir, *SESSIONS, *overrides, n_prompts=8)
        self.server.endpoint = Endpoint(self.cfg, engine, self.server.env)

    @property
    def root(self):
        return self.server.endpoint.root


def agent(task_prompt, base_url):
    """A plain OpenAI-client agent: asks, gets a 'tool' answer from its own code, asks again."""
    c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": task_prompt}]
    replies = []
    for turn in range(3):
        r = c.chat.completions.create(model="fleetrl", messages=messages, max_tokens=5)
        msg = r.choices[0].message
        replies.append(msg.content)
        messages += [msg.model_dump(exclude_none=True), {"role": "tool", "content": f"result {turn}"}]
    return replies


def test_an_openai_client_agent_trains_by_changing_base_url(engine, tiny_model_dir):
    fleet = AgentFleet(engine, tiny_model_dir)
    tok = engine.tokenizer
    done = {}
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        for k in range(2 * G):
            s = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json()
            replies = agent(s["task"]["prompt"], s["base_url"])
            r = httpx.post(f"{fleet.root}/fleetrl/sessions/{s['session_id']}/close", json={"reward": float(k)}).json()
            assert r["status"] == "pending" and r["trained"] is None and r["turns"] == 3  # its group is not complete
            done[float(k)] = (s, replies)
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or len(groups) >= 2, 30, "groups from sessions")
        for s, _ in done.values():  # asked later: the groups were pushed
            fate = httpx.get(f"{fleet.root}/fleetrl/sessions/{s['session_id']}").json()
            assert fate["status"] == "trained" and fate["trained"] is True
    finally:
        fleet.stop()
    for g in groups:
        assert g.num_responses == G and g.metadata["turns"] == [3] * G
        offsets = g.offsets()
        for i in range(G):
            s, replies = done[g.rewards[i]]
            assert g.reward_parts[i] == {"env": g.rewards[i]} and fleet.prompt_text(g.prompt_id) == s["task"]["prompt"]
            tokens, mask = (
                g.token_array()[offsets[i] : offsets[i + 1]],
                g.loss_mask_array()[offsets[i] : offsets[i + 1]],
            )
            # the sampled segments (mask 1) are the replies the agent got, as tokens; the rest is mask 0
            cuts = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
            segments = [tokens[a:b].tolist() for a, b in zip(cuts[::2], cuts[1::2])]
            # as the agent saw them: special tokens included, a final end of turn not shown
            assert [tok.decode(x[:-1] if x[-1] == tok.eos_token_id else x) for x in segments] == replies
            obs = tok.decode(tokens[cuts[1] : cuts[2]].tolist())
            assert obs.endswith("<|tool|>result 0<eos><|assistant|>")


def test_bad_history_is_refused_and_an_idle_session_times_out_untrained(engine, tiny_model_dir):
    fleet = AgentFleet(
        engine, tiny_model_dir, "rollout.openai.session_timeout_s=1.5", "rollout.env.min_group_samples=1"
    )
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        s = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}).json()
        c = client(fleet.server.endpoint.base_url, key="x")
        ask = [{"role": "user", "content": s["task"]["prompt"]}]
        r = c.chat.completions.create(model="m", messages=ask, user=s["session_id"])
        with pytest.raises(openai.BadRequestError) as e:  # the history was rewritten
            c.chat.completions.create(
                model="m",
                user=s["session_id"],
                messages=[
                    {"role": "user", "content": "something else"},
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "more"},
                ],
            )
        assert e.value.code == "session_history_mismatch"
        other = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}).json()  # the group's second
        c2 = openai.OpenAI(base_url=other["base_url"], api_key="x", max_retries=0)
        c2.chat.completions.create(model="m", messages=[{"role": "user", "content": other["task"]["prompt"]}])
        httpx.post(f"{fleet.root}/fleetrl/sessions/{other['session_id']}/close", json={"reward": 1.0})
        time.sleep(3.0)
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model="m", messages=ask, user=s["session_id"])
        assert e.value.code == "session_expired"
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or groups, 20, "the surviving sample's group")
    finally:
        fleet.stop()
    assert len(groups) == 1 and groups[0].num_responses == 1 and groups[0].rewards == [1.0]
    totals = fleet.server.env.stats.totals
    assert totals["timeouts"] >= 1 and totals["samples_dropped"] >= 1
    assert fleet.server.env.sessions.counts["sessions_timed_out"] == 1


def test_a_failed_call_changes_nothing_and_a_retry_gets_the_recorded_reply(engine, tiny_model_dir):
    """Issue 28: a rejected parameter used to leave its new message in the session (the retry got
    session_no_new_message and the learner trained a stray generation prompt); a client's retry of a call
    that already succeeded used to get 'message N differs'; `user` used to override the base URL's session."""
    fleet = AgentFleet(engine, tiny_model_dir, "rollout.env.min_group_samples=1", "rollout.openai.session_timeout_s=4")
    tok = engine.tokenizer
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        s = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json()
        c = openai.OpenAI(base_url=s["base_url"], api_key="x", max_retries=0, timeout=30)
        ask = [{"role": "user", "content": s["task"]["prompt"]}]
        first = c.chat.completions.create(model="m", messages=ask, user="end-user-42")  # `user` is not a session
        ask += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Too low."}]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=ask, max_tokens=0)
        assert e.value.body["param"] == "max_tokens"
        second = c.chat.completions.create(model="m", messages=ask, max_tokens=4)  # the valid retry is accepted
        again = c.chat.completions.create(model="m", messages=ask, max_tokens=4)  # a resend: the recorded reply
        assert again.id == second.id and again.choices[0].message.content == second.choices[0].message.content
        ask += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Guess."}]
        keyed = c.chat.completions.create(model="m", messages=ask, extra_headers={"Idempotency-Key": "k3"})
        ask2 = ask[:-1] + [{"role": "user", "content": "Guess again."}]  # same key, other content: still a replay
        assert (
            c.chat.completions.create(model="m", messages=ask2, extra_headers={"Idempotency-Key": "k3"}).id == keyed.id
        )
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=123, messages=ask2)
        assert e.value.body["param"] == "model"
        state = httpx.get(f"{fleet.root}/fleetrl/sessions/{s['session_id']}").json()
        assert state["turns"] == 3
        httpx.post(f"{fleet.root}/fleetrl/sessions/{s['session_id']}/close", json={"reward": 1.0})
        other = httpx.post(f"{fleet.root}/fleetrl/sessions/{s['session_id']}/close", json={"reward": 1.0})
        assert other.status_code == 404
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or groups, 30, "the session's group")
    finally:
        fleet.stop()
    g = groups[0]
    tokens, mask = g.response_tokens(0), g.loss_mask_array()[: g.lengths[0]]
    cuts = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    observations = [tok.decode(tokens[b:a].tolist()) for b, a in zip(cuts[1::2], cuts[2::2])]
    # each observation is exactly the new user message once: no stray generation prompt, no doubled end of turn
    assert [o.split("<|user|>")[-1] for o in observations] == ["Too low.<eos><|assistant|>", "Guess.<eos><|assistant|>"]
    assert all(o.count("<|assistant|>") == 1 for o in observations)
    assert fleet.server.endpoint.counts["calls_replayed"] == 2 and fleet.server.endpoint.counts["calls_session"] == 3


def test_out_of_vocabulary_token_ids_are_a_400(plain, engine):
    c = client(plain.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="fleetrl", prompt=[1, 2, len(engine.tokenizer) + 5], max_tokens=2)
    assert e.value.body["param"] == "prompt" and "vocabulary" in e.value.message
    assert c.completions.create(model="fleetrl", prompt=[1, 2, 3], max_tokens=2).choices


def test_close_says_when_the_group_rule_drops_the_session(engine, tiny_model_dir):
    """Issue 28: closing one session of a group whose sibling is abandoned used to answer trained: true."""
    fleet = AgentFleet(engine, tiny_model_dir)  # min_group_samples defaults to the group size here
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        a, b = (httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json() for _ in range(G))
        assert a["group"] == b["group"]
        openai.OpenAI(base_url=a["base_url"], api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": a["task"]["prompt"]}]
        )
        closed = httpx.post(f"{fleet.root}/fleetrl/sessions/{a['session_id']}/close", json={"reward": 1.0}).json()
        assert closed["status"] == "pending" and closed["ask"] == f"GET /fleetrl/sessions/{a['session_id']}"
        assert httpx.post(f"{fleet.root}/fleetrl/sessions/{b['session_id']}/abandon").json()["trained"] is False
        fates = []
        wait_for(
            lambda: (
                fates.append(httpx.get(f"{fleet.root}/fleetrl/sessions/{a['session_id']}").json())
                or fates[-1]["status"] != "pending"
            ),
            20,
            "the group's fate",
        )
    finally:
        fleet.stop()
    assert fates[-1]["status"] == "dropped" and fates[-1]["trained"] is False
    assert "too few" in fates[-1]["reason"] and not fleet.drain()


def test_no_agent_is_logged_once_as_such_and_the_header_does_not_collide_with_verifiers(engine, tiny_model_dir, caplog):
    fleet = AgentFleet(engine, tiny_model_dir, "rollout.openai.session_timeout_s=0.6")
    assert fleet.cfg.rollout.openai.session_header.lower() != "x-session-id"  # verifiers sends X-Session-ID
    try:
        with caplog.at_level("WARNING", logger="fleetrl"):
            fleet.start_thread()
            wait_for(lambda: fleet.server.env.sessions.counts["slots_expired"] >= 2 * G, 20, "slots to expire")
            time.sleep(0.5)
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    finally:
        fleet.stop()
    assert sum("no agent took a task" in w for w in warnings) == 1
    assert not any("lost too many samples" in w for w in warnings)


def test_close_with_next_opens_the_agents_next_session(engine, tiny_model_dir):
    """Issue 28 (CPU per session): ``close`` with ``"next": {"wait_s": ...}`` also opens the next session, as
    POST /fleetrl/sessions would, so an agent makes one request a session fewer; a bad ``next`` closes nothing."""
    fleet = AgentFleet(engine, tiny_model_dir)
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        s = httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json()
        agent(s["task"]["prompt"], s["base_url"])
        url = f"{fleet.root}/fleetrl/sessions/{s['session_id']}"
        bad = httpx.post(f"{url}/close", json={"reward": 1.0, "next": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "next"
        assert httpx.get(url).json()["turns"] == 3  # still open: the refused close changed nothing
        closed = httpx.post(f"{url}/close", json={"reward": 1.0, "next": {"wait_s": 20}}, timeout=30).json()
        assert closed["session_id"] == s["session_id"] and closed["turns"] == 3 and closed["status"] == "pending"
        nxt = closed["next"]
        assert nxt["session_id"] != s["session_id"] and nxt["base_url"].endswith(f"/sessions/{nxt['session_id']}/v1")
        assert nxt["task"]["prompt"] and nxt["turns"] == 0
        assert len(agent(nxt["task"]["prompt"], nxt["base_url"])) == 3  # a live session, as an opened one
        assert httpx.get(f"{fleet.root}/fleetrl/sessions/{nxt['session_id']}").json()["turns"] == 3
        plain = httpx.post(f"{fleet.root}/fleetrl/sessions/{nxt['session_id']}/close", json={"reward": 0.0}).json()
        assert "next" not in plain and plain["turns"] == 3
    finally:
        fleet.stop()


def test_sessions_cut_short_by_the_servers_stop_are_returned_without_a_warning_each(engine, tiny_model_dir, caplog):
    """The endpoint demo's normal end logged "prompt ... lost too many samples" at WARNING for each of the 24
    groups whose sessions timed out while the stop drained them. Those prompts go back to the broker as before,
    quietly."""
    fleet = AgentFleet(engine, tiny_model_dir, "rollout.openai.session_timeout_s=1")
    with caplog.at_level("DEBUG", logger="fleetrl"):
        try:
            fleet.start_thread()
            wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
            opened = [
                httpx.post(f"{fleet.root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30).json() for _ in range(G)
            ]
            openai.OpenAI(base_url=opened[0]["base_url"], api_key="x", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": opened[0]["task"]["prompt"]}]
            )
        finally:
            fleet.stop()
    lost = [r for r in caplog.records if "lost too many samples" in r.getMessage()]
    assert lost and all(r.levelname == "DEBUG" for r in lost)  # the group was cut short, and said so quietly
    assert fleet.server.stats.heartbeat()["rollout/prompts_returned"] >= 1
