"""The OpenAI-compatible endpoint of a rollout server (``rollout.openai``; docs/environments.md).

    GET  /v1/models                       the served model
    POST /v1/chat/completions             messages (+ tools) -> a reply, tool calls parsed
    POST /v1/completions                  prompt text (or token ids) -> a completion
    POST /fleetrl/sessions                a training session for the next waiting task (rollout.env.type: openai)
    POST /fleetrl/sessions/<id>/close     {"reward": r} or {} (then rollout.rewards score the last reply)
    POST /fleetrl/sessions/<id>/abandon   the session's tokens are not trained
    GET  /fleetrl/sessions/<id>           the session's state;   GET /fleetrl/health

A call belongs to a training session when it names one: the base URL ``/sessions/<id>/v1``, else the
``rollout.openai.session_header`` header, else the ``user`` field when it names one of this server's
sessions (so an agent written with the official ``openai`` client trains by changing its ``base_url``
and nothing else). A session call is a transaction (``_session_call``): a failed call changes nothing,
a repeat of the last call (same body or ``Idempotency-Key``) gets the recorded response. Other calls are
plain inference on the current weights, not trained. In a session the rollout's sampling settings
apply (temperature, top_p, top_k: the learner's log-probs assume them); ``max_tokens`` and ``stop``
are honoured within the budgets of ``rollout.env``. Errors come in OpenAI's format,
``{"error": {"message", "type", "param", "code"}}``, with the matching HTTP status. ``stream: true``
gets the finished reply as server-sent events (``stream.py``). The app runs on the engine's event
loop: a call costs one JSON decode, the chat template and one ``engine.generate``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from fleetrl.common.chat.codec import ChatCodec
from fleetrl.rollout.endpoint import stream
from fleetrl.rollout.endpoint.sessions import AgentEnv, ApiError, Session, plain
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.envs.parsers import TOOL_PARSERS

log = logging.getLogger("fleetrl.rollout.endpoint")


def _number(body: dict[str, Any], key: str, default: Any, kind: type, lo: float, hi: float) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ApiError(
            400, f"{key} must be a{'n integer' if kind is int else ' number'}, got {value!r}", "invalid_type", param=key
        )
    if not lo <= value <= hi:
        raise ApiError(400, f"{key}={value} is out of range [{lo:g}, {hi:g}]", "invalid_value", param=key)
    return kind(value)


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "invalid_value", param="stop")
    return tuple(stops)


class Endpoint:
    """The aiohttp app over one engine (see the module docstring); ``start()`` / ``close()`` from any thread."""

    def __init__(
        self, cfg: Any, engine: Any, env: Any = None, server_index: int = 0, run_dir: str | Path | None = None
    ):
        self.cfg, self.engine, self.index, self.run_dir = cfg, engine, server_index, run_dir
        self.opts = cfg.rollout.openai
        self.sessions = env.sessions if isinstance(env, AgentEnv) else None
        self.parser = TOOL_PARSERS[cfg.rollout.env.tool.parser]
        self.counts: Counter[str] = Counter()
        self._codecs: dict[str, ChatCodec] = {}
        self.runner: Any = None
        self.port = 0

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Serve on the engine's loop; returns the base URL (…/v1) and writes rollout-<i>.openai.json."""
        self.engine.loop.call(self._start(), timeout=30)
        if self.run_dir is not None:
            path = Path(self.run_dir) / f"rollout-{self.index}.openai.json"
            path.write_text(json.dumps({"base_url": self.base_url, "host": self.opts.host, "port": self.port}))
        log.info(
            "OpenAI-compatible endpoint at %s (%s)",
            self.base_url,
            "training sessions: POST /fleetrl/sessions" if self.sessions else "inference only: not trained",
        )
        return self.base_url

    @property
    def root(self) -> str:
        return f"http://{self.opts.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    async def _start(self) -> None:
        from aiohttp import web

        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        port = self.opts.port + self.index if self.opts.port else 0
        site = web.TCPSite(self.runner, self.opts.host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self.runner is not None and self.engine.loop.loop.is_running():
            self.engine.loop.call(self.runner.cleanup(), timeout=10)
        self.runner = None

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 * 1024 * 1024)
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_get(f"{prefix}/v1/models", self.models)
            app.router.add_post(f"{prefix}/v1/chat/completions", self.chat)
            app.router.add_post(f"{prefix}/v1/completions", self.completions)
        app.router.add_post("/fleetrl/sessions", self.open_session)
        app.router.add_get("/fleetrl/sessions/{sid}", self.session_state)
        app.router.add_post("/fleetrl/sessions/{sid}/close", self.close_session)
        app.router.add_post("/fleetrl/sessions/{sid}/abandon", self.abandon_session)
        app.router.add_get("/fleetrl/health", self.health)
        return app

    # ------------------------------------------------------------------------------ middleware

    @property
    def _errors(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as e:
                self.counts[f"errors/{e.code}"] += 1
                return web.json_response(e.body(), status=e.status)
            except web.HTTPException as e:  # unknown route, wrong method
                err = ApiError(
                    e.status,
                    f"{request.method} {request.path}: {e.reason}",
                    "not_found" if e.status == 404 else "method_not_allowed",
                    "not_found_error" if e.status == 404 else "invalid_request_error",
                )
                return web.json_response(err.body(), status=e.status)
            except Exception as e:  # noqa: BLE001 - a bug or an engine failure: reported, the server goes on
                log.exception("endpoint: %s %s failed", request.method, request.path)
                self.counts["errors/server_error"] += 1
                err = ApiError(500, f"{type(e).__name__}: {e}", "server_error", "server_error")
                return web.json_response(err.body(), status=500)

        return errors

    @property
    def _auth(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.opts.api_key and request.headers.get("Authorization", "") != f"Bearer {self.opts.api_key}":
                raise ApiError(
                    401,
                    "missing or wrong bearer token (Authorization: Bearer <rollout.openai.api_key>)",
                    "invalid_api_key",
                    "authentication_error",
                )
            return await handler(request)

        return auth

    # ------------------------------------------------------------------------------ helpers

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_json")
        if body.get("stream") not in (None, False, True):
            raise ApiError(400, "stream must be true or false", "invalid_value", param="stream")
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise ApiError(
                400,
                f"model must be a string (the served model is {self.opts.model_name!r}), got {body['model']!r}",
                "invalid_type",
                param="model",
            )
        return body

    def _session(self, request: Any, body: dict[str, Any]) -> Session | None:
        sid = request.match_info.get("sid") or request.headers.get(self.opts.session_header)
        user = body.get("user")
        if (
            not sid
            and isinstance(user, str)
            and self.sessions is not None
            and (user in self.sessions.open or user in self.sessions.ended)
        ):
            sid = user  # the `user` field is a fallback, only when it names one of this server's sessions
        if not sid:
            return None
        if self.sessions is None:  # inference only: a session header is routing affinity, nothing to train
            if request.match_info.get("sid"):
                raise ApiError(
                    400,
                    "this server has no training sessions (rollout.env.type is "
                    f"{self.cfg.rollout.env.type!r}; sessions need rollout.env.type=openai)",
                    "no_sessions",
                )
            return None
        return self.sessions.get(sid)

    def codec(self, tools: Any) -> ChatCodec:
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "tools must be a list of tool objects", "invalid_value", param="tools")
        key = json.dumps(tools, sort_keys=True)
        if key not in self._codecs:
            self._codecs[key] = ChatCodec(self.engine.tokenizer, tools)
        return self._codecs[key]

    def _params(self, body: dict[str, Any], session: Session | None) -> SamplingParams:
        default = self.opts.max_tokens or self.cfg.rollout.max_new_tokens
        requested = _number(body, "max_completion_tokens", None, int, 1, 1 << 20) or _number(
            body, "max_tokens", default, int, 1, 1 << 20
        )
        stops = _stops(body)
        if session is not None:  # the rollout's sampling: the learner's log-probs assume it
            base = session.slot.params
            return dataclasses.replace(base, max_new_tokens=session.room(requested), stop=base.stop + stops)
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, 0, 2),
            top_p=_number(body, "top_p", 1.0, float, 1e-9, 1),
            max_new_tokens=requested,
            stop=stops,
            seed=_number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1),
        )

    async def _generate(self, ids: list[int], params: SamplingParams, n: int) -> list[Generation]:
        limit = getattr(self.engine, "max_positions", None)
        if limit is not None and len(ids) + 1 >= limit:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context is {limit}",
                "context_length_exceeded",
                param="messages",
            )
        if limit is not None:
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, limit - 1 - len(ids)))
        requests = [
            Request(ids, params if params.seed is None else dataclasses.replace(params, seed=params.seed + j))
            for j in range(n)
        ]
        return await self.engine.generate_many(requests) if n > 1 else [await self.engine.generate(requests[0])]

    def _logprobs(self, gen: Generation) -> dict[str, Any]:
        tok = self.engine.tokenizer
        return {
            "content": [
                {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode([t]).encode()), "top_logprobs": []}
                for t, lp in zip(gen.token_ids, gen.logprobs)
            ]
        }

    def _reply(self, gen: Generation, tools: Any) -> tuple[dict[str, Any], str]:
        """The assistant message of a generation (tool calls parsed when the call has tools) and its finish reason."""
        finish = gen.finish_reason
        if tools:
            params = {
                t["function"]["name"]: list(t["function"].get("parameters", {}).get("properties", {}))
                for t in tools
                if isinstance(t.get("function"), dict) and "name" in t["function"]
            }
            parsed = self.parser(gen.text, params)
            if parsed.malformed:
                self.counts["malformed_tool_calls"] += len(parsed.malformed)
            if parsed.calls:
                self.counts["tool_calls"] += len(parsed.calls)
                calls = [c.openai() for c in parsed.calls]
                return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, (
                    "tool_calls" if finish == "stop" else finish
                )
        return {"role": "assistant", "content": gen.text}, finish

    @staticmethod
    def _usage(ids: list[int], gens: list[Generation]) -> dict[str, int]:
        done = sum(len(g.token_ids) for g in gens)
        return {"prompt_tokens": len(ids), "completion_tokens": done, "total_tokens": len(ids) + done}

    # ------------------------------------------------------------------------------ OpenAI routes

    async def models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.opts.model_name, "object": "model", "created": 0, "owned_by": "fleetrl"}],
            }
        )

    async def chat(self, request: Any) -> Any:
        body = await self._body(request)
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(x, dict) and isinstance(x.get("role"), str) for x in messages)
        ):
            raise ApiError(
                400, "messages must be a non-empty list of {role, content} objects", "invalid_value", param="messages"
            )
        tools, n = body.get("tools"), _number(body, "n", 1, int, 1, 16)
        session = self._session(request, body)
        codec = self.codec(tools)
        if session is None:
            ids = codec.initial([plain(x) for x in messages])
            gens = await self._generate(ids, self._params(body, None), n)
            replies = [self._reply(g, tools) for g in gens]
            self.counts["calls_plain"] += 1
        else:
            if n != 1:
                raise ApiError(400, "a training session takes n=1 (one reply per call)", "invalid_value", param="n")

            async def turn() -> dict[str, Any]:
                ids = session.chat_context(messages, codec)
                gens = await self._generate(ids, self._params(body, session), 1)
                replies = [self._reply(gens[0], tools)]
                session.record(gens[0], replies[0][0])
                return self._chat_response(body, ids, gens, replies)

            return await stream.send(request, body, await self._session_call(request, body, session, turn))
        return await stream.send(request, body, self._chat_response(body, ids, gens, replies))

    def _chat_response(
        self, body: dict[str, Any], ids: list[int], gens: list[Generation], replies: list[tuple[dict[str, Any], str]]
    ) -> dict[str, Any]:
        choices = [
            {
                "index": j,
                "message": message,
                "finish_reason": finish,
                "logprobs": self._logprobs(gen) if body.get("logprobs") else None,
            }
            for j, (gen, (message, finish)) in enumerate(zip(gens, replies))
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.opts.model_name,
            "choices": choices,
            "usage": self._usage(ids, gens),
        }

    async def completions(self, request: Any) -> Any:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ApiError(
                400,
                "prompt must be a non-empty string or a list of token ids (one prompt per call)",
                "invalid_value",
                param="prompt",
            )
        n = _number(body, "n", 1, int, 1, 16)
        tok = self.engine.tokenizer
        vocab = len(tok)
        if isinstance(prompt, list) and not all(0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ApiError(
                400,
                f"prompt token id {bad} is outside the model's vocabulary [0, {vocab})",
                "invalid_value",
                param="prompt",
            )
        session = self._session(request, body)
        if session is None:
            ids = list(prompt) if isinstance(prompt, list) else tok(prompt, add_special_tokens=False)["input_ids"]
            gens = await self._generate(ids, self._params(body, None), n)
            self.counts["calls_plain"] += 1
        else:
            if n != 1:
                raise ApiError(
                    400, "a training session takes n=1 (one completion per call)", "invalid_value", param="n"
                )

            async def turn() -> dict[str, Any]:
                ids = session.text_context(prompt, tok)
                gens = await self._generate(ids, self._params(body, session), 1)
                session.record(gens[0], None)
                return self._text_response(body, ids, gens)

            return await stream.send(request, body, await self._session_call(request, body, session, turn))
        return await stream.send(request, body, self._text_response(body, ids, gens))

    def _text_response(self, body: dict[str, Any], ids: list[int], gens: list[Generation]) -> dict[str, Any]:
        choices = [
            {"index": j, "text": g.text, "finish_reason": g.finish_reason, "logprobs": None} for j, g in enumerate(gens)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.opts.model_name,
            "choices": choices,
            "usage": self._usage(ids, gens),
        }

    @staticmethod
    def _call_key(request: Any, body: dict[str, Any]) -> str:
        """What makes two calls the same call: the ``Idempotency-Key`` header, else the route and the body's
        content (streaming options aside)."""
        given = request.headers.get("Idempotency-Key")
        if given:
            return f"key:{given}"
        content = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        return f"{request.path.rpartition('/v1/')[2]}:{json.dumps(content, sort_keys=True, default=str)}"

    async def _session_call(self, request: Any, body: dict[str, Any], session: Session, turn: Any) -> dict[str, Any]:
        """One call of a session, as a transaction: it extends the session only when it succeeds (a failed
        validation or generation leaves the session as it was), and a repeat of the last call (same content
        or ``Idempotency-Key``; e.g. a client's retry after a timeout) gets the recorded response again."""
        key = self._call_key(request, body)
        if session.lock.locked() and key != session.pending:
            raise ApiError(
                409, f"session {session.id} has a call in progress; one call at a time per session", "session_busy"
            )
        async with session.lock:  # a retry of the call in progress waits for it, then replays it
            if session.replay is not None and session.replay[0] == key:
                self.counts["calls_replayed"] += 1
                return session.replay[1]
            snap, session.pending = session.snapshot(), key
            try:
                resp = await turn()
            except BaseException:
                session.rollback(snap)
                raise
            finally:
                session.pending = ""
            session.replay = (key, resp)
            self.counts["calls_session"] += 1
            return resp

    # ------------------------------------------------------------------------------ fleetrl routes

    def _manager(self) -> Any:
        if self.sessions is None:
            raise ApiError(
                404,
                f"this server's rollout.env.type is {self.cfg.rollout.env.type!r}: it has no training "
                "sessions (set rollout.env.type=openai)",
                "no_sessions",
                "not_found_error",
            )
        return self.sessions

    def _state(self, session: Session) -> dict[str, Any]:
        task, ep = session.slot.task, session.builder.ep if session.builder else None
        return {
            "session_id": session.id,
            "base_url": f"{self.root}/sessions/{session.id}/v1",
            "task": {
                "prompt_id": task.prompt.prompt_id,
                "prompt": task.prompt.prompt,
                "answer": task.prompt.answer,
                "metadata": dict(task.prompt.metadata),
            },
            "group": session.slot.request_id.rpartition("/")[0],
            "turns": ep.turns if ep else 0,
            "tokens": len(ep.token_ids) if ep else 0,
        }

    async def open_session(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request) if request.can_read_body else {}
        session = await self._manager().start(_number(body, "wait_s", 30.0, float, 0, 3600))
        return web.json_response(self._state(session))

    async def session_state(self, request: Any) -> Any:
        from aiohttp import web

        manager, sid = self._manager(), request.match_info["sid"]
        if sid in manager.ended and sid not in manager.open:  # an ended session: what happens to its tokens
            fate = manager.fate(sid)
            return web.json_response(
                {
                    "session_id": sid,
                    "ended": manager.ended[sid],
                    **fate,
                    "trained": {"trained": True, "dropped": False}.get(fate["status"]),
                }
            )
        return web.json_response(self._state(manager.get(sid)))

    async def close_session(self, request: Any) -> Any:
        from aiohttp import web

        body = await self._body(request) if request.can_read_body else {}
        reward = body.get("reward")
        if reward is not None and (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or reward != reward
            or abs(reward) == float("inf")
        ):
            raise ApiError(
                400, f"reward must be a finite number or null, got {reward!r}", "invalid_value", param="reward"
            )
        manager, sid = self._manager(), request.match_info["sid"]
        session = manager.get(sid)
        if session.lock.locked():
            raise ApiError(
                409, f"session {sid} has a call in progress; close it after the call returns", "session_busy"
            )
        ep = manager.end(sid, None if reward is None else float(reward))
        fate = manager.fate(sid, ep)
        return web.json_response(
            {
                "session_id": sid,
                "reward": ep.reward,
                "turns": ep.turns,
                "tokens": len(ep.token_ids),
                **fate,
                "trained": {"trained": True, "dropped": False}.get(fate["status"]),
            }
        )

    async def abandon_session(self, request: Any) -> Any:
        from aiohttp import web

        from fleetrl.rollout.envs.base import EnvFailure

        sid = request.match_info["sid"]
        self._manager().end(sid, failure=EnvFailure(f"session {sid} abandoned by the agent"), how="abandoned")
        return web.json_response({"session_id": sid, "trained": False})

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "ok": True,
                "model": self.opts.model_name,
                "version": self.engine.version,
                **({} if self.sessions is None else self.sessions.metrics()),
            }
        )

    def metrics(self) -> dict[str, float]:
        return {f"openai/{k}_total": float(v) for k, v in self.counts.items()}
