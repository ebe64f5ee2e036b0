"""The demo's agent (scripts/multiturn_agent.py: `openai.AsyncOpenAI`, or plain JSON posts with `--client raw`,
sessions as asyncio tasks on one pooled http client) against the real endpoint and server loop: every session it takes is closed with the reward it
scored, the groups carry those rewards, and its totals and `--out` lines count what the server trained."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from tests.rollout.endpoint.test_endpoint import AgentFleet, G
from tests.rollout.test_server import wait_for

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "multiturn_agent.py"


def load_agent():
    spec = importlib.util.spec_from_file_location("multiturn_agent", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("client", ["openai", "raw"])
def test_the_async_agent_closes_every_session_with_its_reward(engine, tiny_model_dir, tmp_path, monkeypatch, client):
    agent = load_agent()
    real_solve, seen = agent.solve, []

    async def solve(chat, question, max_turns=3):
        """The real agent loop (its calls reach the endpoint), then the right answer for even prompts."""
        answer, stats = await real_solve(chat, question, max_turns)
        n = int(question[:2])
        if n % 2 == 0:
            answer = str(n + 1)  # the task rows are "NN+01=" -> NN + 1 (tests/broker/conftest.py)
        seen.append((question, answer, stats["turns"]))
        return answer, stats

    monkeypatch.setattr(agent, "solve", solve)
    fleet = AgentFleet(engine, tiny_model_dir)
    out = tmp_path / "agent.jsonl"
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.endpoint.port, 20, "the endpoint")
        args = argparse.Namespace(
            server=fleet.server.endpoint.root,
            api_key="none",
            workers=2 * G,
            minutes=0.05,
            server_reward=False,
            http="auto",
            client=client,
            out=str(out),
        )
        totals = asyncio.run(agent.run(args))
        groups = []
        wait_for(lambda: groups.extend(fleet.drain()) or sum(g.num_responses for g in groups) >= G, 30, "groups")
    finally:
        fleet.stop()
    assert totals["sessions"] == len(seen) >= G and totals["turns"] == sum(t for _, _, t in seen) >= len(seen)
    assert totals["correct"] == sum(float(a == str(int(q[:2]) + 1)) for q, a, _ in seen)
    for g in groups:  # the rewards the agent closed its sessions with, as the learner gets them
        q = fleet.prompt_text(g.prompt_id)
        mine = sorted(float(a == str(int(q[:2]) + 1)) for qq, a, _ in seen if qq == q)
        assert sorted(g.rewards) == mine[: g.num_responses] and [p["env"] for p in g.reward_parts] == list(g.rewards)
        if int(q[:2]) % 2 == 0:
            assert list(g.rewards) == [1.0] * G
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["sessions"] == totals["sessions"] and last["correct"] == totals["correct"]
