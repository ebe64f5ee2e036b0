"""Environments inside the real server loop (broker twin): the group rule for failed samples, and the
`http` environment against a real environment server on loopback (retries, failures)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from fleetrl.rollout.envs.http import make_app
from tests.conftest import free_port
from tests.rollout.envs import envs_for_tests
from tests.rollout.envs.envs_for_tests import Chatter
from tests.rollout.test_server import Fleet, wait_for

FLAKY = [
    "rollout.env.type=user",
    "rollout.env.user.cls=tests.rollout.envs.envs_for_tests:Flaky",
    "rollout.env.user.args={mode: raise, at: 2, every: 3}",
    "rollout.env.max_tokens_per_turn=4",
    "rollout.group_size=2",
    "rollout.prompts_per_batch=2",
]


def run_fleet(engine, tiny_model_dir, *overrides, n_groups=3, n_prompts=6):
    fleet = Fleet(engine, tiny_model_dir, *overrides, n_prompts=n_prompts)
    groups = []
    try:
        fleet.start_thread()
        wait_for(lambda: groups.extend(fleet.drain()) or len(groups) >= n_groups, 90, "groups")
    finally:
        fleet.stop()
    return fleet, groups


def test_groups_that_lost_samples_are_dropped_and_their_prompts_return(engine, tiny_model_dir):
    envs_for_tests.Flaky.calls = 0
    fleet, groups = run_fleet(
        engine, tiny_model_dir, *FLAKY, "rollout.env.min_group_samples=2", n_groups=1, n_prompts=20
    )
    env = fleet.server.env.stats.totals
    assert env["errors"] >= 1 and env["samples_dropped"] == env["errors"] and env["groups_dropped"] >= 1
    assert fleet.server.stats.totals["prompts_returned"] >= env["groups_dropped"]
    for g in groups:  # every pushed group is whole, and no sample of it was scored by a failure
        assert g.num_responses == 2 and g.metadata["turns"] == [3, 3]
        assert all(parts == {"env": r} for parts, r in zip(g.reward_parts, g.rewards))


def test_groups_keep_their_survivors_when_enough_remain(engine, tiny_model_dir):
    envs_for_tests.Flaky.calls = 0
    fleet, groups = run_fleet(engine, tiny_model_dir, *FLAKY, "rollout.env.min_group_samples=1", n_groups=3)
    env = fleet.server.env.stats.totals
    assert env["groups_partial"] >= 1 and env["groups_dropped"] == 0
    partial = [g for g in groups if g.num_responses == 1]
    assert partial and all(g.metadata["turns"] == [3] for g in partial)


class ServerThread:
    """An aiohttp app on loopback in a thread of its own; stopped by the test that started it."""

    def __init__(self, app):
        self.port, self.loop = free_port(), asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self):
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def env_server():
    calls = {"step": 0, "failed": 0}
    seen: set[bytes] = set()
    app = make_app(Chatter, {"turns": 3})

    @web.middleware
    async def flaky(request, handler):  # every third distinct step fails once with a 503: retried, same reply
        if request.path == "/step":
            calls["step"] += 1
            body = await request.read()
            if body not in seen:
                seen.add(body)
                if len(seen) % 3 == 0:  # by distinct body, not call count: concurrent retries in lockstep
                    calls["failed"] += 1  # would otherwise hit the failing slot every time
                    return web.json_response({"error": "busy"}, status=503)
        return await handler(request)

    app.middlewares.insert(0, flaky)
    server = ServerThread(app)
    yield server, calls
    server.stop()


def test_http_environment_with_retries(engine, tiny_model_dir, env_server):
    server, calls = env_server
    fleet, groups = run_fleet(
        engine,
        tiny_model_dir,
        "rollout.env.type=http",
        f"rollout.env.http.url={server.url}",
        "rollout.env.http.backoff_s=0.01",
        "rollout.env.max_tokens_per_turn=4",
        "rollout.group_size=2",
        "rollout.prompts_per_batch=2",
        n_groups=2,
    )
    assert calls["failed"] >= 1 and calls["step"] >= 9 and fleet.server.env.stats.totals["errors"] == 0
    for g in groups:
        assert g.metadata["turns"] == [3, 3] and all(parts == {"env": r} for parts, r in zip(g.reward_parts, g.rewards))
        assert g.loss_mask_array().min() == 0  # observations are in the response with mask 0


def test_http_environment_unreachable_fails_samples(engine, tiny_model_dir):
    fleet = Fleet(
        engine,
        tiny_model_dir,
        "rollout.env.type=http",
        f"rollout.env.http.url=http://127.0.0.1:{free_port()}",
        "rollout.env.http.retries=1",
        "rollout.env.http.backoff_s=0.01",
        "rollout.group_size=2",
        "rollout.prompts_per_batch=1",
        n_prompts=2,
    )
    try:
        fleet.start_thread()
        wait_for(lambda: fleet.server.env.stats.totals["groups_dropped"] >= 1, 30, "a dropped group")
    finally:
        fleet.stop()
    totals = fleet.server.env.stats.totals
    assert totals["errors"] >= 2 and not fleet.drain()  # nothing was pushed: no failure is ever scored
