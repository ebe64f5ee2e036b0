"""``http``: an environment server elsewhere, with the `user` contract over HTTP (``rollout.env.http``).

The protocol (JSON bodies; docs/environments.md)::

    POST {url}/reset  {"episode_id": str, "row": {...}}                        -> {"messages": [...]}
    POST {url}/step   {"episode_id": str, "turn": int, "message": {...}}       -> {"observations": [...],
                                                                                   "reward": float | null,
                                                                                   "done": bool, "info": {...}}
    POST {url}/close  {"episode_id": str}                                      -> {}

Each call has ``timeout_s``; a call that times out, cannot connect or gets a 5xx is retried
``retries`` times with doubling pauses from ``backoff_s``, so a server must answer a repeated
``(episode_id, turn)`` with the reply it gave the first time (``serve`` below does). A 4xx, an
answer that is not the contract's JSON, or the last retry failing fails the sample (dropped,
counted). ``serve(cls, args)`` exposes any `user` class this way::

    python -m fleetrl.rollout.envs.http mypkg.envs:GuessNumber --port 9000 [--args '{"high": 16}']
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from fleetrl.rollout.envs.base import EnvFailure, EnvSession, EnvTimeout, Message, StepResult, Task, check_messages
from fleetrl.rollout.envs.multi import MultiTurnEnvironment

log = logging.getLogger("fleetrl.rollout.envs")


class HttpEnv(MultiTurnEnvironment):
    def __init__(self, cfg: Any, tokenizer: Any):
        self.opts = cfg.rollout.env.http
        self.url = self.opts.url.rstrip("/")
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        super().__init__(cfg, tokenizer)

    def session(self, task: Task) -> EnvSession:
        return HttpSession(self)

    async def client(self) -> Any:
        """One aiohttp ClientSession, made on the engine's loop the first time an episode needs it."""
        if self._client is None:
            import aiohttp

            self._client = aiohttp.ClientSession(headers=self.opts.headers)
            self._loop = asyncio.get_running_loop()
        return self._client

    async def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST with the timeout and retries of ``rollout.env.http``; the decoded JSON reply."""
        import aiohttp

        client, last = await self.client(), ""
        for attempt in range(self.opts.retries + 1):
            if attempt:
                await asyncio.sleep(self.opts.backoff_s * 2 ** (attempt - 1))
            try:
                async with client.post(
                    f"{self.url}/{route}", json=body, timeout=aiohttp.ClientTimeout(total=self.opts.timeout_s)
                ) as r:
                    text = await r.text()
                    if r.status >= 500:
                        last = f"HTTP {r.status}: {text[:200]}"
                        continue
                    if r.status >= 400:
                        raise EnvFailure(f"the environment server answered {route} with HTTP {r.status}: {text[:200]}")
                    try:
                        out = json.loads(text)
                    except json.JSONDecodeError:
                        raise EnvFailure(
                            f"the environment server's {route} reply is not JSON: {text[:200]!r}"
                        ) from None
                    if not isinstance(out, dict):
                        raise EnvFailure(f"the environment server's {route} reply is not an object: {text[:200]!r}")
                    return out
            except asyncio.TimeoutError:
                last = f"no reply within {self.opts.timeout_s:g} s"
            except aiohttp.ClientError as e:
                last = f"{type(e).__name__}: {e}"
        error = EnvTimeout if last.startswith("no reply") else EnvFailure
        raise error(
            f"{self.url}/{route} failed {self.opts.retries + 1} time(s), last: {last} "
            "(rollout.env.http.timeout_s / retries)"
        )

    def close(self) -> None:
        if self._client is not None and self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result(5)
        self._client = None


class HttpSession(EnvSession):
    def __init__(self, env: HttpEnv):
        self.env, self.id, self.turn = env, uuid.uuid4().hex, 0
        self.opened = False

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        out = await self.env.post("reset", {"episode_id": self.id, "row": row})
        self.opened = True
        return check_messages(out.get("messages"), "the environment server's reset")

    async def step(self, message: Message) -> StepResult:
        out = await self.env.post("step", {"episode_id": self.id, "turn": self.turn, "message": message})
        self.turn += 1
        return StepResult.coerce(out, "the environment server's step")

    async def close(self) -> None:
        if self.opened:
            await self.env.post("close", {"episode_id": self.id})


# ------------------------------------------------------------------------- a server for any user class


def make_app(cls: type, args: dict[str, Any]) -> Any:
    """An aiohttp application serving ``cls`` (the `user` contract) with the protocol above."""
    from aiohttp import web

    from fleetrl.rollout.envs.multi import call_with_timeout

    episodes: dict[str, Any] = {}
    replies: dict[tuple[str, int], dict[str, Any]] = {}

    async def reset(request: web.Request) -> web.Response:
        body = await request.json()
        env = episodes.get(body["episode_id"]) or cls(**args)
        episodes[body["episode_id"]] = env
        messages = await call_with_timeout(env.reset, body["row"], timeout_s=3600, what="reset")
        return web.json_response({"messages": check_messages(messages, "reset")})

    async def step(request: web.Request) -> web.Response:
        body = await request.json()
        key = (body["episode_id"], int(body["turn"]))
        if key not in replies:  # a retried step gets the first reply again
            env = episodes.get(body["episode_id"])
            if env is None:
                return web.json_response({"error": "unknown episode_id; call /reset first"}, status=404)
            out = StepResult.coerce(
                await call_with_timeout(env.step, body["message"], timeout_s=3600, what="step"), "step"
            )
            replies[key] = {"observations": out.observations, "reward": out.reward, "done": out.done, "info": out.info}
        return web.json_response(replies[key])

    async def close(request: web.Request) -> web.Response:
        body = await request.json()
        env = episodes.pop(body["episode_id"], None)
        for key in [k for k in replies if k[0] == body["episode_id"]]:
            del replies[key]
        if env is not None and callable(getattr(env, "close", None)):
            await call_with_timeout(env.close, timeout_s=3600, what="close")
        return web.json_response({})

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.Response:
        try:
            return await handler(request)
        except EnvFailure as e:
            return web.json_response({"error": str(e)}, status=500)
        except (KeyError, ValueError, TypeError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)

    app = web.Application(middlewares=[errors])
    app.add_routes([web.post("/reset", reset), web.post("/step", step), web.post("/close", close)])
    return app


def main(argv: list[str] | None = None) -> int:
    import argparse

    from aiohttp import web

    from fleetrl.rollout.rewards.python import load_function

    p = argparse.ArgumentParser(description="Serve a `user` environment class over HTTP for rollout.env.type=http.")
    p.add_argument("cls", metavar="module:Class")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--args", default="{}", help="JSON keyword arguments of the class")
    a = p.parse_args(argv)
    web.run_app(make_app(load_function(a.cls), json.loads(a.args)), host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
