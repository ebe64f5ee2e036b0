"""The OpenAI-compatible endpoint of a rollout server (``rollout.openai``; docs/environments.md).

    GET  /v1/models                       the served model
    POST /v1/chat/completions             messages (+ tools) -> a reply, tool calls parsed
    POST /v1/completions                  prompt text (or token ids) -> a completion
    POST /fleetrl/sessions                a training session for the next waiting task (rollout.env.type: openai)
    POST /fleetrl/sessions/<id>/close     {"reward": r} or {} (then rollout.rewards score the last reply);
                                          + "next": {"wait_s": s} also opens the agent's next session
    POST /fleetrl/sessions/<id>/abandon   the session's tokens are not trained
    GET  /fleetrl/sessions/<id>           the session's state;   GET /fleetrl/health

A call belongs to a training session when it names one: the base URL ``/sessions/<id>/v1``, else the
``rollout.openai.session_header`` header, else the ``user`` field when it names one of this server's
sessions (so an agent written with the official ``openai`` client trains by changing its ``base_url``
and nothing else). A session call is a transaction (``_session_call``): a failed call changes nothing,
a repeat of any earlier call (same body or ``Idempotency-Key``) gets its recorded response. Other calls are
plain inference on the current weights, not trained. In a session the rollout's sampling settings
apply (temperature, top_p, top_k: the learner's log-probs assume them); ``max_tokens`` and ``stop``
are honoured within the budgets of ``rollout.env``. Errors come in OpenAI's format,
``{"error": {"message", "type", "param", "code"}}``, with the matching HTTP status. ``stream: true``
gets server-sent events as the tokens are sampled (``stream.py``). In a session the reply's text is its
sampled tokens decoded *with* their special tokens (only a final stop token is left out), so what the
agent sees is what is trained. Limits on connections, bodies and sessions per client: ``guard.py``.
The app runs on the engine's event loop: a call costs one JSON decode, the chat template and one
``engine.generate``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from fleetrl.common.chat.codec import ChatCodec
from fleetrl.rollout.endpoint import guard
from fleetrl.rollout.endpoint import openai_format as fmt
from fleetrl.rollout.endpoint.openai_format import number
from fleetrl.rollout.endpoint.session_routes import SessionRoutes
from fleetrl.rollout.endpoint.sessions import AgentEnv, ApiError, Session, plain, text_of
from fleetrl.rollout.endpoint.stream import Sender
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation, Request
from fleetrl.rollout.envs.parsers import STREAM_MARKERS, TOOL_PARSERS

log = logging.getLogger("fleetrl.rollout.endpoint")
# on close, calls still in flight (an agent waiting for a task, a generation) get this long to finish, then are
# cancelled (aiohttp waits up to twice this): its default of 60 s outlived close()'s wait and failed the shutdown
SHUTDOWN_GRACE_S = 3.0


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
        self.timing: Counter[str] = Counter()  # seconds: whole calls, building contexts, waiting for the engine
        self._codecs: OrderedDict[str, ChatCodec] = OrderedDict()  # by tools, the 64 most recent
        self.conns = guard.Connections(self.opts.max_connections, self.opts.idle_timeout_s)
        self.runner: Any = None
        self._server: Any = None
        self._reaper: asyncio.Task | None = None
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

        self.runner = web.AppRunner(
            self.app(),
            access_log=None,
            keepalive_timeout=self.opts.idle_timeout_s,
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        await self.runner.setup()
        port = self.opts.port + self.index if self.opts.port else 0
        loop = asyncio.get_running_loop()  # our own listener: every new connection passes the cap (guard.py)
        self._server = await loop.create_server(
            self.conns.factory(self.runner.server), self.opts.host, port, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._reaper = loop.create_task(self.conns.reap())

    async def _stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()

    def close(self) -> None:
        if self.runner is not None and self.engine.loop.loop.is_running():
            self.engine.loop.call(self._stop(), timeout=2 * SHUTDOWN_GRACE_S + 4)
        self.runner = None

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(
            middlewares=[self._errors, self._track, self._auth], client_max_size=self.opts.max_body_bytes
        )
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_get(f"{prefix}/v1/models", self.models)
            app.router.add_post(f"{prefix}/v1/chat/completions", self.chat)
            app.router.add_post(f"{prefix}/v1/completions", self.completions)
        SessionRoutes(self.sessions, self.cfg.rollout.env.type, lambda: self.root, self._body).add_to(app)
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
            except web.HTTPException as e:  # unknown route, wrong method, a body over the limit
                code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
                    e.status, "invalid_request"
                )
                err = ApiError(
                    e.status,
                    f"{request.method} {request.path}: {e.reason}",
                    code,
                    "not_found_error" if e.status == 404 else "invalid_request_error",
                )
                self.counts[f"errors/{code}"] += 1
                return web.json_response(err.body(), status=e.status)
            except ConnectionResetError:  # the client hung up mid-request (an agent stopped): not a server error
                log.info("endpoint: %s %s: the client closed the connection mid-request", request.method, request.path)
                self.counts["errors/client_disconnected"] += 1
                err = ApiError(400, "the client closed the connection mid-request", "client_disconnected")
                return web.json_response(err.body(), status=400)  # nobody reads it; aiohttp drops it quietly
            except Exception as e:  # noqa: BLE001 - a bug or an engine failure: reported, the server goes on
                log.exception("endpoint: %s %s failed", request.method, request.path)
                self.counts["errors/server_error"] += 1
                err = ApiError(500, f"{type(e).__name__}: {e}", "server_error", "server_error")
                return web.json_response(err.body(), status=500)

        return errors

    @property
    def _track(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def track(request: web.Request, handler: Any) -> web.StreamResponse:
            self.conns.begin(request.protocol)  # a connection with a call in progress is never idle
            t0 = time.perf_counter()
            try:
                return await handler(request)
            finally:
                self.conns.end(request.protocol)
                self.timing["call"] += time.perf_counter() - t0

        return track

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
        body = await guard.read_json(request, self.opts.body_timeout_s)
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
            while len(self._codecs) > 64:
                self._codecs.popitem(last=False)
        self._codecs.move_to_end(key)
        return self._codecs[key]

    async def _generate(self, ids: list[int], params: SamplingParams, n: int, out: Sender) -> list[Generation]:
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
            Request(
                ids,
                params if params.seed is None else dataclasses.replace(params, seed=params.seed + j),
                on_token=out.watch(j, params.stop),
            )
            for j in range(n)
        ]
        t0 = time.perf_counter()
        try:
            return await self.engine.generate_many(requests) if n > 1 else [await self.engine.generate(requests[0])]
        finally:
            self.timing["engine"] += time.perf_counter() - t0

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
        guard.check_text_size(sum(len(text_of(x.get("content"))) for x in messages), self._context, "messages")
        tools, n = body.get("tools"), number(body, "n", 1, int, 1, 16)
        session = self._session(request, body)
        codec = self.codec(tools)
        out = self._sender(request, body, "chat", session)
        if session is None:

            async def call() -> dict[str, Any]:
                ids = codec.initial([plain(x) for x in messages])
                gens = await self._generate(ids, fmt.sampling(body, None, self._max_tokens), n, out)
                self.counts["calls_plain"] += 1
                return self._chat_response(
                    out, body, ids, gens, [fmt.reply(g, tools, self.parser, self.counts) for g in gens]
                )

            return await out.respond(call)
        if n != 1:
            raise ApiError(400, "a training session takes n=1 (one reply per call)", "invalid_value", param="n")

        async def turn() -> dict[str, Any]:
            t0 = time.perf_counter()
            ids = session.chat_context(messages, codec)
            self.timing["context"] += time.perf_counter() - t0
            params = fmt.sampling(body, session, self._max_tokens)
            [gen] = await self._generate(ids, params, 1, out)
            gen = fmt.seen(gen, self.engine.tokenizer, params)
            reply = fmt.reply(gen, tools, self.parser, self.counts)
            session.record(gen, reply[0])
            return self._chat_response(out, body, ids, [gen], [reply])

        return await out.respond(lambda: self._session_call(request, body, session, turn))

    @property
    def _context(self) -> int | None:
        return getattr(self.engine, "max_positions", None)

    @property
    def _max_tokens(self) -> int:
        return self.opts.max_tokens or self.cfg.rollout.max_new_tokens

    def _sender(self, request: Any, body: dict[str, Any], kind: str, session: Session | None) -> Sender:
        """How the call's response goes out; a session's streamed text keeps special tokens (``_seen``)."""
        tok = self.engine.tokenizer
        return Sender(
            request,
            body,
            kind,
            body.get("model") or self.opts.model_name,
            lambda ids: tok.decode(ids, skip_special_tokens=session is None),
            STREAM_MARKERS.get(self.cfg.rollout.env.tool.parser),
            on_unconfirmed=lambda reply: self._unconfirmed(session, reply),
        )

    def _unconfirmed(self, session: Session | None, reply: dict[str, Any]) -> None:
        """A streamed reply's tool calls that its finished turn did not confirm: counted, and a session takes the
        reply back as the client assembled it."""
        self.counts["stream_calls_unconfirmed"] += 1
        if session is not None:
            session.accept_as_streamed(reply)

    def _chat_response(
        self,
        out: Sender,
        body: dict[str, Any],
        ids: list[int],
        gens: list[Generation],
        replies: list[tuple[dict[str, Any], str]],
    ) -> dict[str, Any]:
        choices = [
            {
                "index": j,
                "message": message,
                "finish_reason": finish,
                "logprobs": fmt.logprobs(self.engine.tokenizer, gen) if body.get("logprobs") else None,
            }
            for j, (gen, (message, finish)) in enumerate(zip(gens, replies))
        ]
        return {
            "id": out.id,
            "object": "chat.completion",
            "created": out.created,
            "model": out.model,
            "choices": choices,
            "usage": fmt.usage(ids, gens),
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
        n = number(body, "n", 1, int, 1, 16)
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
        if isinstance(prompt, str):
            guard.check_text_size(len(prompt), self._context, "prompt")
        session = self._session(request, body)
        out = self._sender(request, body, "text", session)
        if session is None:

            async def call() -> dict[str, Any]:
                ids = list(prompt) if isinstance(prompt, list) else tok(prompt, add_special_tokens=False)["input_ids"]
                gens = await self._generate(ids, fmt.sampling(body, None, self._max_tokens), n, out)
                self.counts["calls_plain"] += 1
                return self._text_response(out, ids, gens)

            return await out.respond(call)
        if n != 1:
            raise ApiError(400, "a training session takes n=1 (one completion per call)", "invalid_value", param="n")

        async def turn() -> dict[str, Any]:
            ids = session.text_context(prompt, tok)
            params = fmt.sampling(body, session, self._max_tokens)
            [gen] = await self._generate(ids, params, 1, out)
            gen = fmt.seen(gen, self.engine.tokenizer, params)
            session.record(gen, None)
            return self._text_response(out, ids, [gen])

        return await out.respond(lambda: self._session_call(request, body, session, turn))

    def _text_response(self, out: Sender, ids: list[int], gens: list[Generation]) -> dict[str, Any]:
        choices = [
            {"index": j, "text": g.text, "finish_reason": g.finish_reason, "logprobs": None} for j, g in enumerate(gens)
        ]
        return {
            "id": out.id,
            "object": "text_completion",
            "created": out.created,
            "model": out.model,
            "choices": choices,
            "usage": fmt.usage(ids, gens),
        }

    @staticmethod
    def _call_key(request: Any, body: dict[str, Any]) -> str:
        """What makes two calls the same call: the ``Idempotency-Key`` header, else the route and the body's
        content (streaming options aside); hashed, as a session keeps one per call."""
        given = request.headers.get("Idempotency-Key")
        if given:
            return "key:" + hashlib.sha256(given.encode()).hexdigest()
        content = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        text = f"{request.path.rpartition('/v1/')[2]}:{json.dumps(content, sort_keys=True, default=str)}"
        return hashlib.sha256(text.encode()).hexdigest()

    async def _session_call(self, request: Any, body: dict[str, Any], session: Session, turn: Any) -> dict[str, Any]:
        """One call of a session, as a transaction: it extends the session only when it succeeds (a failed
        validation or generation leaves the session as it was), and a repeat of any earlier call that succeeded
        (same content or ``Idempotency-Key``; e.g. a client's retry after a timeout) gets its recorded response."""
        key = self._call_key(request, body)
        if session.lock.locked() and key != session.pending:
            raise ApiError(
                409, f"session {session.id} has a call in progress; one call at a time per session", "session_busy"
            )
        async with session.lock:  # a retry of the call in progress waits for it, then replays it
            if key in session.replays:
                self.counts["calls_replayed"] += 1
                return session.replays[key]
            snap, session.pending = session.snapshot(), key
            try:
                resp = await turn()
            except BaseException:
                session.rollback(snap)
                raise
            finally:
                session.pending = ""
            session.replays[key] = resp
            self.counts["calls_session"] += 1
            return resp

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
        """Counters, and where the calls' time went: ``openai/time_{call,context,engine}_s_total`` (a call's
        handler from its first byte read to its response; the session context's template and tokenizing; the
        wait for the engine), so ``call - engine`` is what the endpoint itself adds."""
        return {
            **{f"openai/{k}_total": float(v) for k, v in self.counts.items()},
            **{f"openai/time_{k}_s_total": round(v, 4) for k, v in self.timing.items()},
        }
