"""The endpoint's own routes for training sessions (see ``server.py``'s docstring and docs/environments.md).

POST /fleetrl/sessions                a session for the next waiting task: {"wait_s": 30}
GET  /fleetrl/sessions/<id>           its state; once ended, its fate (trained, dropped + reason, pending)
POST /fleetrl/sessions/<id>/close     {"reward": r} or {} (rollout.rewards score the last reply); with
                                      "next": {"wait_s": 30} it also opens the agent's next session (as
                                      POST /fleetrl/sessions would) and answers it under "next": one
                                      request fewer a session
POST /fleetrl/sessions/<id>/abandon   its tokens are not trained
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fleetrl.rollout.endpoint.openai_format import number
from fleetrl.rollout.endpoint.sessions import ApiError, Session, SessionManager


class SessionRoutes:
    """The handlers; ``root()`` is the endpoint's root URL, ``read_body`` its checked JSON body reader."""

    def __init__(
        self,
        sessions: SessionManager | None,
        env_type: str,
        root: Callable[[], str],
        read_body: Callable[[Any], Awaitable[dict[str, Any]]],
    ):
        self.sessions, self.env_type, self.root, self.read_body = sessions, env_type, root, read_body

    def add_to(self, app: Any) -> None:
        app.router.add_post("/fleetrl/sessions", self.open_session)
        app.router.add_get("/fleetrl/sessions/{sid}", self.session_state)
        app.router.add_post("/fleetrl/sessions/{sid}/close", self.close_session)
        app.router.add_post("/fleetrl/sessions/{sid}/abandon", self.abandon_session)

    def _manager(self) -> SessionManager:
        if self.sessions is None:
            raise ApiError(
                404,
                f"this server's rollout.env.type is {self.env_type!r}: it has no training "
                "sessions (set rollout.env.type=openai)",
                "no_sessions",
                "not_found_error",
            )
        return self.sessions

    def _state(self, session: Session) -> dict[str, Any]:
        task, ep = session.slot.task, session.builder.ep if session.builder else None
        return {
            "session_id": session.id,
            "base_url": f"{self.root()}/sessions/{session.id}/v1",
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

        body = await self.read_body(request) if request.can_read_body else {}
        session = await self._manager().start(number(body, "wait_s", 30.0, float, 0, 3600), request.remote or "")
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

        body = await self.read_body(request) if request.can_read_body else {}
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
        nxt = body.get("next")
        if nxt is not None and not isinstance(nxt, dict):
            raise ApiError(
                400, f'next must be an object ({{"wait_s": 30}}) or null, got {nxt!r}', "invalid_value", param="next"
            )
        wait_s = None if nxt is None else number(nxt, "wait_s", 30.0, float, 0, 3600)
        ep = manager.end(sid, None if reward is None else float(reward))
        fate = manager.fate(sid, ep)
        out = {
            "session_id": sid,
            "reward": ep.reward,
            "turns": ep.turns,
            "tokens": len(ep.token_ids),
            **fate,
            "trained": {"trained": True, "dropped": False}.get(fate["status"]),
        }
        if wait_s is not None:  # the session is closed whatever comes next; a next that fails says why
            try:
                out["next"] = self._state(await manager.start(wait_s, request.remote or ""))
            except ApiError as e:
                out["next"] = None
                out["next_error"] = {**e.body()["error"], "status": e.status}
        return web.json_response(out)

    async def abandon_session(self, request: Any) -> Any:
        from aiohttp import web

        from fleetrl.rollout.envs.base import EnvFailure

        sid = request.match_info["sid"]
        self._manager().end(sid, failure=EnvFailure(f"session {sid} abandoned by the agent"), how="abandoned")
        return web.json_response({"session_id": sid, "trained": False})
