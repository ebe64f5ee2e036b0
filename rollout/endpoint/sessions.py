"""Training sessions of the OpenAI-compatible endpoint: one agent's calls become one sample.

``rollout.env.type: openai`` makes the rollout server's samples come from agents. The server admits
prompts as always; each of a prompt's ``group_size`` samples becomes a *slot* waiting for an agent.
``POST /fleetrl/sessions`` hands the oldest slot out as a session (so the group_size sessions of one
task are handed out together and form its group); the agent's calls in that session extend one
token sequence, token-in/token-out:

- first call: its messages (or prompt text) through the chat template -> the episode's prompt;
- each later call must repeat the conversation so far (the earlier messages and the assistant
  replies it got, compared as role, text, tool calls and tool_call_id) and add new messages; only
  the new ones are rendered and appended as tokens (mask 0); the reply's tokens are appended as
  sampled (mask 1). A call that rewrites the history is refused (400, ``session_history_mismatch``),
  the session stays open; any failed call leaves the session as it was (``snapshot`` / ``rollback``);
- ``POST /fleetrl/sessions/<id>/close`` with ``{"reward": r}`` ends it with that reward, without one
  ``rollout.rewards`` score the last reply (with the task's answer); ``.../abandon`` drops it.

A session idle for ``rollout.openai.session_timeout_s`` (and a slot no agent took for as long) is
closed as failed: its tokens are not trained, and its group follows the group rule
(``rollout/group_rule.py``). Everything here runs on the engine's event loop (one thread).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from fleetrl.common.chat.codec import GENERIC_EXAMPLE, ChatCodec, check_prefix_stable
from fleetrl.rollout.engines.params import SamplingParams
from fleetrl.rollout.engines.records import Generation
from fleetrl.rollout.envs.base import EnvFailure, Environment, EnvTimeout, Episode, Message, Task
from fleetrl.rollout.envs.episode import Budget, EpisodeBuilder

log = logging.getLogger("fleetrl.rollout.endpoint")
REAP_S = 0.5
NO_AGENT = "no agent opened a session for this sample within {:g} s"
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # uuid4().hex


class ApiError(Exception):
    """An OpenAI-format error reply: HTTP status, message, type, code, param."""

    def __init__(
        self, status: int, message: str, code: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.type, self.param = status, code, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def text_of(content: Any) -> str:
    """A message's text: a string, OpenAI content parts ([{type: text, text}...]) joined, or ''."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def plain(msg: Message) -> Message:
    """A request message as the chat template gets it: text content, tool calls with object arguments."""
    out = {k: v for k, v in msg.items() if v is not None}
    out["content"] = text_of(msg.get("content"))
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _args(c["function"].get("arguments"))}}
            for c in msg["tool_calls"]
        ]
    return out


def _args(a: Any) -> Any:
    try:
        return json.loads(a) if isinstance(a, str) else a
    except json.JSONDecodeError:
        return a


def same(a: Message, b: Message) -> bool:
    """Whether two messages are the same turn (role, text, tool calls by name and arguments, tool_call_id)."""
    calls = lambda m: [
        (c["function"]["name"], _args(c["function"].get("arguments"))) for c in m.get("tool_calls") or []
    ]  # noqa: E731
    return (
        a.get("role") == b.get("role")
        and text_of(a.get("content")).strip() == text_of(b.get("content")).strip()
        and calls(a) == calls(b)
        and (a.get("tool_call_id") or "") == (b.get("tool_call_id") or "")
    )


@dataclass
class Slot:
    """One sample waiting for an agent."""

    task: Task
    params: SamplingParams
    request_id: str
    engine: Any
    future: asyncio.Future
    offered: float = field(default_factory=time.monotonic)


class Session:
    """One agent's calls as one growing token sequence (see the module docstring)."""

    def __init__(self, sid: str, slot: Slot, budget: Budget, client: str = ""):
        self.id, self.slot, self.budget, self.client = sid, slot, budget, client
        self.builder: EpisodeBuilder | None = None
        self.codec: ChatCodec | None = None
        self.kind = ""  # "chat" | "completion", fixed by the first call
        self.conv: list[Message] = []  # the conversation as the agent sends it back (chat)
        self.as_streamed: dict[int, Message] = {}  # reply index -> the reply as a stream's client assembled it
        self.text = ""  # the text so far (completions)
        self.last: Generation | None = None
        self.lock = asyncio.Lock()
        self.last_active = time.monotonic()
        self.truncated = ""
        self.replays: dict[str, dict[str, Any]] = {}  # call key -> its response, for every call that succeeded
        self.pending = ""  # the key of the call in progress

    def snapshot(self) -> tuple:
        """What a call may change, to put back when it fails (a session is a transaction per call)."""
        ep = self.builder.ep if self.builder else None
        return (
            self.builder,
            self.codec,
            self.kind,
            list(self.conv),
            self.text,
            self.truncated,
            self.last,
            len(ep.token_ids) if ep else 0,
            ep.turns if ep else 0,
            len(ep.messages) if ep else 0,
        )

    def rollback(self, snap: tuple) -> None:
        """Undo a failed call: the session is as it was before it (``snapshot``)."""
        (self.builder, self.codec, self.kind, self.conv, self.text, self.truncated, self.last, n, turns, m) = snap
        if self.builder is not None:
            ep = self.builder.ep
            for name in ("token_ids", "logprobs", "versions", "loss_mask"):
                del getattr(ep, name)[n:]
            del ep.messages[m:]
            ep.turns = turns

    def _kind(self, kind: str) -> None:
        if self.kind and self.kind != kind:
            raise ApiError(
                400,
                f"session {self.id} is a {self.kind} session; keep to one endpoint per session",
                "session_kind_mismatch",
            )
        self.kind = kind

    def chat_context(self, messages: list[Message], codec: ChatCodec) -> list[int]:
        """The token context of a chat call (extends the sequence; raises ApiError on a rewritten history)."""
        self._kind("chat")
        msgs = [plain(x) for x in messages]
        if self.builder is None:
            self.codec, self.conv = codec, msgs
            self.builder = EpisodeBuilder(codec.initial(msgs), msgs)
            return self.builder.context()
        n = len(self.conv)
        bad = next((i for i in range(n) if i >= len(msgs) or not self._same(i, msgs[i])), None)
        if bad is not None:
            raise ApiError(
                400,
                f"session {self.id}: message {bad} differs from the conversation so far (token-in/"
                "token-out needs every call to repeat the earlier messages and replies unchanged, then add "
                "new ones)",
                "session_history_mismatch",
                param="messages",
            )
        if len(msgs) == n:
            raise ApiError(
                400,
                f"session {self.id}: the call adds no message after the last reply",
                "session_no_new_message",
                param="messages",
            )
        try:
            obs = self.codec.turn_tail(self.last) + self.codec.observation(msgs[:n], msgs[n:])
        except EnvFailure as e:
            raise ApiError(400, str(e), "template_mismatch") from None
        self.builder.appended(obs, self.slot.engine.version)
        self.conv = msgs
        return self.builder.context()

    def _same(self, i: int, msg: Message) -> bool:
        """Whether ``msg`` repeats message ``i``: as recorded or, for a streamed reply whose tool calls the finished
        turn did not confirm (``stream.Sender``), as the client assembled it."""
        return same(msg, self.conv[i]) or (i in self.as_streamed and same(msg, self.as_streamed[i]))

    def accept_as_streamed(self, reply: Message) -> None:
        """The last reply may come back as ``reply``: what a streaming client assembled of it."""
        if self.conv and self.conv[-1].get("role") == "assistant":
            self.as_streamed[len(self.conv) - 1] = plain(reply)

    def text_context(self, prompt: str | list[int], tokenizer: Any) -> list[int]:
        """The token context of a completions call: the new prompt must extend the session's text (or tokens)."""
        self._kind("completion")
        if self.builder is None:
            ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
            self.builder = EpisodeBuilder(list(ids), [])
            self.text = prompt if isinstance(prompt, str) else ""
            return self.builder.context()
        if isinstance(prompt, list):
            ctx = self.builder.context()
            if prompt[: len(ctx)] != ctx or len(prompt) == len(ctx):
                raise ApiError(
                    400,
                    f"session {self.id}: the prompt's tokens must extend the session's tokens",
                    "session_history_mismatch",
                    param="prompt",
                )
            extra = prompt[len(ctx) :]
        else:
            if not prompt.startswith(self.text) or len(prompt) == len(self.text):
                at = next(
                    (i for i, (a, b) in enumerate(zip(prompt, self.text)) if a != b), min(len(prompt), len(self.text))
                )
                raise ApiError(
                    400,
                    f"session {self.id}: the prompt must extend the session's text (prompt so far + "
                    f"completions) with new text; it differs at character {at}",
                    "session_history_mismatch",
                    param="prompt",
                )
            extra = tokenizer(prompt[len(self.text) :], add_special_tokens=False)["input_ids"]
            self.text = prompt
        self.builder.appended(list(extra), self.slot.engine.version)
        return self.builder.context()

    def room(self, requested: int) -> int:
        """Tokens the next reply may have; raises ApiError (and marks the session truncated) when a budget is spent."""
        ep = self.builder.ep
        if ep.turns >= self.budget.max_turns:
            self.truncated = "turns"
            raise ApiError(
                400,
                f"session {self.id} used its {self.budget.max_turns} calls (rollout.env.max_turns); close it",
                "session_budget_exceeded",
            )
        room, limit = self.budget.room(len(ep.prompt_ids), len(ep.token_ids))
        if room < 1:
            self.truncated = limit
            raise ApiError(
                400,
                f"session {self.id} has no tokens left ({limit} budget, rollout.env.max_total_tokens); close it",
                "context_length_exceeded",
            )
        return min(room, requested)

    def record(self, gen: Generation, reply: Message | None) -> None:
        self.builder.sampled(gen, self.slot.engine.version)
        self.last, self.last_active = gen, time.monotonic()
        if reply is not None:
            self.conv.append(plain(reply))
        else:
            self.text += gen.text
        if gen.finish_reason == "length":
            self.builder.ep.counts["turns_cut"] += 1

    def episode(self, reward: float | None) -> Episode:
        if self.builder is None or not self.builder.ep.turns:
            return EpisodeBuilder([], []).finish(failure=EnvFailure(f"session {self.id} closed before any call"))
        ep = self.builder.finish(truncated=self.truncated)
        ep.reward = reward
        return ep


class SessionManager:
    """Slots waiting for agents and the open sessions (see the module docstring)."""

    def __init__(self, cfg: Any, stats: Any):
        self.cfg, self.stats = cfg, stats
        self.timeout_s = cfg.rollout.openai.session_timeout_s
        self.per_client = cfg.rollout.openai.max_sessions_per_client
        self.held: Counter[str] = Counter()  # client -> its open sessions
        self.asking: Counter[str] = Counter()  # client -> its calls waiting in start()
        self.waiting: deque[Slot] = deque()
        self.open: dict[str, Session] = {}
        self.ended: dict[str, str] = {}  # session id -> how it ended (expired, closed...), for clear errors
        self.groups: dict[str, str] = {}  # ended session id -> its group (request id prefix)
        self.fates: dict[str, tuple[bool, str]] = {}  # group -> (pushed, reason), set by the server (settled)
        self.counts: Counter[str] = Counter()
        self._ready: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None

    def _loop_state(self) -> asyncio.Event:
        if self._ready is None:
            self._ready = asyncio.Event()
            self.loop = asyncio.get_running_loop()
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return self._ready

    async def offer(self, task: Task, params: SamplingParams, request_id: str, engine: Any) -> Episode:
        """One sample of ``task``, produced by whichever agent opens its session; returns when it closes."""
        ready = self._loop_state()
        slot = Slot(task, params, request_id, engine, asyncio.get_running_loop().create_future())
        self.waiting.append(slot)
        ready.set()
        return await slot.future

    async def start(self, wait_s: float, client: str = "") -> Session:
        """The oldest waiting slot as a new session for ``client``; ApiError 503 when none comes within ``wait_s``,
        429 when the client holds ``max_sessions_per_client`` already. While several clients wait, a slot goes to
        the one holding the fewest sessions (one client cannot take every task while others wait)."""
        if self.per_client and self.held[client] >= self.per_client:
            self.counts["sessions_refused_client_limit"] += 1
            raise ApiError(
                429,
                f"this client ({client}) holds {self.held[client]} open sessions, the most one client may "
                "(rollout.openai.max_sessions_per_client); close one first",
                "too_many_sessions",
            )
        ready = self._loop_state()
        deadline = time.monotonic() + wait_s
        self.asking[client] += 1
        try:
            while not self.waiting or self._yields(client):
                ready.clear()
                try:
                    await asyncio.wait_for(ready.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise ApiError(
                        503,
                        f"no task is waiting for an agent (waited {wait_s:g} s); the server may be "
                        "paused or between leases: try again",
                        "no_task",
                        "server_error",
                    ) from None
        finally:
            self.asking[client] -= 1
            if not self.asking[client]:
                del self.asking[client]
        slot = self.waiting.popleft()
        if self.waiting:
            ready.set()  # the other waiters look again
        sid = uuid.uuid4().hex
        self.open[sid] = Session(sid, slot, Budget.from_config(self.cfg, slot.engine), client)
        self.held[client] += 1
        self.counts["sessions_opened"] += 1
        return self.open[sid]

    def _yields(self, client: str) -> bool:
        """Whether ``client`` lets another waiting client that holds fewer sessions take the next slot."""
        mine = self.held[client]
        return any(self.held[other] < mine for other in self.asking if other != client)

    def get(self, sid: str) -> Session:
        if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid):
            raise ApiError(
                400,
                f"{str(sid)[:80]!r} is not a session id (32 hexadecimal digits, as POST /fleetrl/sessions gives)",
                "invalid_session_id",
            )
        session = self.open.get(sid)
        if session is None:
            how = self.ended.get(sid)
            raise ApiError(
                404,
                f"session {sid} {how}" if how else f"unknown session {sid}; open one with POST /fleetrl/sessions",
                "session_expired" if how == "timed out" else "session_not_found",
                "not_found_error",
            )
        return session

    def end(
        self, sid: str, reward: float | None = None, failure: EnvFailure | None = None, how: str = "closed"
    ) -> Episode:
        session = self.get(sid)
        del self.open[sid]
        self.held[session.client] -= 1
        if self.held[session.client] <= 0:
            del self.held[session.client]
        self.ended[sid] = how
        self.groups[sid] = session.slot.request_id.rpartition("/")[0]
        while len(self.ended) > 10000:
            old = next(iter(self.ended))
            self.ended.pop(old)
            self.fates.pop(self.groups.pop(old, ""), None)
        ep = session.episode(reward) if failure is None else EpisodeBuilder([], []).finish(failure=failure)
        self.counts[f"sessions_{how.replace(' ', '_')}"] += 1
        if not session.slot.future.done():
            session.slot.future.set_result(ep)
        return ep

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            now = time.monotonic()
            for sid, s in list(self.open.items()):
                if not s.lock.locked() and now - s.last_active > self.timeout_s:
                    log.warning(
                        "session %s idle for %.0f s: closed, its tokens are not trained", sid, now - s.last_active
                    )
                    self.end(
                        sid,
                        failure=EnvTimeout(
                            f"session idle for more than {self.timeout_s:g} s (rollout.openai.session_timeout_s)"
                        ),
                        how="timed out",
                    )
            while self.waiting and now - self.waiting[0].offered > self.timeout_s:
                slot = self.waiting.popleft()
                self.counts["slots_expired"] += 1
                if self.counts["slots_expired"] == 1:
                    log.warning(
                        "no agent took a task within %g s (rollout.openai.session_timeout_s): is an agent "
                        "opening sessions (POST /fleetrl/sessions)? Its group goes back to the broker; later "
                        "ones are counted in openai/slots_expired_total, not logged",
                        self.timeout_s,
                    )
                slot.future.set_result(
                    EpisodeBuilder([], []).finish(failure=EnvTimeout(NO_AGENT.format(self.timeout_s)))
                )

    def fail_waiting(self, reason: str) -> None:
        """Every slot no agent took yet fails (the server is stopping); open sessions may still finish."""
        while self.waiting:
            self.waiting.popleft().future.set_result(EpisodeBuilder([], []).finish(failure=EnvFailure(reason)))
            self.counts["slots_expired"] += 1

    def fate(self, sid: str, ep: Episode | None = None) -> dict[str, Any]:
        """What happens to an ended session's tokens: ``{"status": "trained" | "dropped" | "pending", "reason"}``.
        "trained" means its group was pushed to the learners' queue (the broker may still drop a group that
        grew too stale); "pending" means its group waits for sibling sessions: ask again with
        GET /fleetrl/sessions/<id>."""
        if ep is not None and ep.failed:
            return {"status": "dropped", "reason": ep.error or ep.failure}
        fate = self.fates.get(self.groups.get(sid, ""))
        if fate is None:
            if self.ended.get(sid, "closed") != "closed":
                return {"status": "dropped", "reason": f"the session {self.ended[sid]}"}
            return {
                "status": "pending",
                "reason": "the group waits for its other sessions to end",
                "ask": f"GET /fleetrl/sessions/{sid}",
            }
        return {"status": "trained", "reason": ""} if fate[0] else {"status": "dropped", "reason": fate[1]}

    def metrics(self) -> dict[str, float]:
        out = {f"openai/{k}_total": float(v) for k, v in self.counts.items()}
        out["openai/sessions_open"] = float(len(self.open))
        out["openai/tasks_waiting"] = float(len(self.waiting))
        return out


class AgentEnv(Environment):
    """``rollout.env.type: openai``: each sample is a training session of an external agent."""

    def __init__(self, cfg: Any, tokenizer: Any):
        super().__init__(cfg, tokenizer)
        self.sessions = SessionManager(cfg, self.stats)

    async def episode(
        self, engine: Any, task: Task, params: SamplingParams, request_id: str, trace: dict[str, str] | None
    ) -> Episode:
        ep = await self.sessions.offer(task, params, request_id, engine)
        self.stats.episode(ep)
        return ep

    def settled(self, group: str, pushed: bool, reason: str) -> None:
        self.sessions.fates[group] = (pushed, reason)

    def begin_stop(self) -> None:
        loop = self.sessions.loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self.sessions.fail_waiting, "the rollout server is stopping")

    def check(self) -> None:
        if self.env_cfg.check_template and getattr(self.tokenizer, "chat_template", None):
            from fleetrl.common.config import ConfigError

            try:
                check_prefix_stable(ChatCodec(self.tokenizer), GENERIC_EXAMPLE)
            except EnvFailure as e:
                raise ConfigError(f"rollout.env (openai): {e} (or rollout.env.check_template=false)") from None

    def metrics(self) -> dict[str, float]:
        return {**self.stats.take(), **self.sessions.metrics()}
