"""The endpoint under abuse (issue 31, "the OpenAI endpoint"): each attack of the round-two report, then a
normal call that must still be served. Before: a non-loopback bind without a key served anyone; one 20 MiB
body held the engine loop 20 s (64 MiB accepted); 1,100 idle sockets locked agents out for >= 90 s; deep
JSON and malformed ids were 500s; one client could take every waiting session."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from fleetrl.common.config import ConfigError, load_config
from fleetrl.rollout.endpoint.server import Endpoint
from fleetrl.rollout.endpoint.sessions import ApiError, SessionManager
from tests.rollout.endpoint.test_endpoint import AgentFleet
from tests.rollout.test_server import wait_for


@pytest.fixture(scope="module")
def guarded(engine, tiny_model_dir):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "rollout.openai.enabled=true",
            "rollout.openai.port=0",
            "rollout.max_new_tokens=4",
            "rollout.openai.max_connections=64",
            "rollout.openai.idle_timeout_s=1.5",
            "rollout.openai.body_timeout_s=1.5",
        ],
    )
    ep = Endpoint(cfg, engine)
    ep.start()
    yield ep
    ep.close()


def served(ep, timeout=10.0):
    c = openai.OpenAI(base_url=ep.base_url, api_key="x", max_retries=0, timeout=timeout)
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1="}], max_tokens=2)
    return r.choices[0].message.role == "assistant"


def test_a_non_loopback_bind_needs_an_api_key():
    with pytest.raises(ConfigError, match="api_key"):
        load_config(None, ["rollout.openai.host=0.0.0.0"])
    assert load_config(None, ["rollout.openai.host=0.0.0.0", "rollout.openai.api_key=k"]).rollout.openai.api_key == "k"
    assert load_config(None, ["rollout.openai.host=localhost"]).rollout.openai.api_key is None


def test_a_body_over_the_limit_is_413_and_bad_json_is_400(guarded):
    url = f"{guarded.base_url}/chat/completions"
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (9 << 20) + b'"}]}'
    r = httpx.post(url, content=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"a": ' + b'{"b": ' * 40 + b"1" + b"}" * 41, b"\xff\xfe{"):
        r = httpx.post(url, content=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", body[:20]
    huge_text = {"model": "m", "messages": [{"role": "user", "content": "7" * (4 << 20)}]}  # > 32 chars x context
    r = httpx.post(url, json=huge_text, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert served(guarded)


def test_idle_sockets_cannot_lock_agents_out_and_a_slowloris_is_cut(guarded):
    idle = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(1100)]
    try:
        slow = socket.create_connection(("127.0.0.1", guarded.port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert served(guarded, timeout=10.0)  # 1,100 idle sockets: a normal call is still served
        assert guarded.conns.open <= 64 and guarded.conns.evicted >= 1100 - 64
        slow.settimeout(10.0)
        t0 = time.monotonic()
        try:
            data = slow.recv(1024)
        except ConnectionResetError:
            data = b""
        assert data == b"" and time.monotonic() - t0 < 8.0  # closed by the idle timeout, not held open
        trickle = socket.create_connection(("127.0.0.1", guarded.port))
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        trickle.settimeout(10.0)
        answer = trickle.recv(4096)  # a body that never arrives whole: 408 after body_timeout_s
        assert answer.startswith(b"HTTP/1.1 408"), answer[:60]
        trickle.close()
        slow.close()
    finally:
        for s in idle:
            s.close()
    assert served(guarded)


def test_malformed_ids_are_400_and_one_client_cannot_take_every_session(engine, tiny_model_dir):
    fleet = AgentFleet(engine, tiny_model_dir, "rollout.openai.max_sessions_per_client=2")
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        root = fleet.server.endpoint.root
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for url, headers in (
            (f"{root}/sessions/not-an-id/v1/chat/completions", {}),
            (f"{root}/v1/chat/completions", {"X-Fleetrl-Session": "x" * 5000}),
        ):
            r = httpx.post(url, json=ask, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id"
        assert httpx.get(f"{root}/fleetrl/sessions/%2e%2e").status_code in (400, 404)
        assert httpx.get(f"{root}/fleetrl/sessions/zz").json()["error"]["code"] == "invalid_session_id"
        first = [httpx.post(f"{root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30) for _ in range(2)]
        assert all(r.status_code == 200 for r in first)
        r = httpx.post(f"{root}/fleetrl/sessions", json={"wait_s": 1}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))  # another client's address
        r = other.post(f"{root}/fleetrl/sessions", json={"wait_s": 20}, timeout=30)
        assert r.status_code == 200
        other.close()
        for s in [x.json() for x in first] + [r.json()]:
            httpx.post(f"{root}/fleetrl/sessions/{s['session_id']}/abandon")
    finally:
        fleet.stop()


def test_while_clients_wait_a_slot_goes_to_the_one_holding_fewest():
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(
            openai=SimpleNamespace(session_timeout_s=60.0, max_sessions_per_client=0),
            env=SimpleNamespace(max_turns=2, max_tokens_per_turn=None, max_total_tokens=64),
            max_new_tokens=4,
        )
    )

    async def scenario():
        manager = SessionManager(cfg, stats=None)
        engine = SimpleNamespace(version=0, max_positions=128)
        loop = asyncio.get_running_loop()
        offered = []
        offer = lambda: offered.append(loop.create_task(manager.offer(None, None, f"g/{len(offered)}", engine)))  # noqa: E731
        offer()
        await asyncio.sleep(0)
        await manager.start(1.0, "greedy")  # greedy holds one; both wait for the next slot
        greedy = loop.create_task(manager.start(2.0, "greedy"))
        await asyncio.sleep(0.05)
        fair = loop.create_task(manager.start(2.0, "other"))
        await asyncio.sleep(0.05)
        offer()
        session = await fair  # the slot went to the client that held none
        assert session.client == "other" and not greedy.done()
        offer()
        assert (await greedy).client == "greedy"
        with pytest.raises(ApiError):
            await manager.start(0.01, "nobody")
        manager.fail_waiting("test over")

    asyncio.run(scenario())


def test_close_returns_while_an_agent_still_waits_for_a_task(engine, tiny_model_dir):
    """The endpoint demo's rollout server exited 1 at the end: close() waited 10 s for aiohttp's shutdown, which
    gives calls in flight (an agent waiting 30 s for a task) 60 s. Now they get a short grace, then are cancelled."""
    from fleetrl.rollout.endpoint.sessions import AgentEnv

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "rollout.env.type=openai",
            "rollout.openai.enabled=true",
            "rollout.openai.port=0",
        ],
    )
    ep = Endpoint(cfg, engine, AgentEnv(cfg, engine.tokenizer))
    ep.start()
    outcome: list[object] = []

    def wait_for_a_task():
        try:
            outcome.append(httpx.post(f"{ep.root}/fleetrl/sessions", json={"wait_s": 60}, timeout=90).status_code)
        except httpx.HTTPError as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait_for_a_task, daemon=True)
    waiter.start()
    wait_for(lambda: any(ep.conns.busy.values()), 10, "the waiting agent's call in progress")
    started = time.monotonic()
    ep.close()  # raised TimeoutError after 10 s before
    assert time.monotonic() - started < 10
    waiter.join(15)
    assert outcome and outcome[0] != 200  # the waiting call ended (cut or refused), it did not get a session
    with pytest.raises(httpx.HTTPError):  # and nothing is served any more
        httpx.get(f"{ep.root}/fleetrl/sessions/x", timeout=2)


def test_a_client_that_hangs_up_mid_body_is_counted_not_logged_as_a_server_error(guarded, caplog):
    """Before: an agent stopped while sending a body (the benchmark's end) gave a traceback at ERROR,
    "POST /fleetrl/sessions failed ... ConnectionResetError", counted as a server error."""
    before = dict(guarded.counts)
    with caplog.at_level("INFO", logger="fleetrl"):
        s = socket.create_connection(("127.0.0.1", guarded.port))
        s.sendall(
            b"POST /fleetrl/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        time.sleep(0.3)
        s.close()
        assert wait_for(
            lambda: guarded.counts["errors/client_disconnected"] > before.get("errors/client_disconnected", 0), 10.0
        )
    assert guarded.counts["errors/server_error"] == before.get("errors/server_error", 0)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    assert "closed the connection mid-request" in caplog.text
    assert served(guarded)
