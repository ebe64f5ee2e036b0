"""The ``rollout.env`` section (how one sample is produced: the environment) and ``rollout.openai``
(the OpenAI-compatible endpoint of a rollout server). docs/environments.md explains both.

    rollout.env: {type: single_turn}                                   # prompt -> completion -> rewards (default)
    rollout.env: {type: tool, tool: {tools: [mypkg.tools:calc]}, max_turns: 4}
    rollout.env: {type: user, user: {cls: mypkg.envs:Guess, args: {high: 16}}}
    rollout.env: {type: http, http: {url: http://127.0.0.1:9000}}
    rollout.env: {type: openai}      # samples come from external agents through rollout.openai
    rollout.env: {type: verifiers, verifiers: {taskset: my_taskset, args: {...}}}   # a verifiers taskset, in-process

``type`` is looked up in one registry (``rollout/envs``); a test keeps ``EnvType`` equal to it. The
budgets and the group rule are shared by every multi-turn type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import field

from fleetrl.common.config.base import Section, doc

EnvType = Literal["single_turn", "tool", "user", "http", "openai", "verifiers"]
"""The names of the environment registry (``rollout/envs``); a test keeps the two equal."""

ToolParserName = Literal["hermes", "pythonic", "json"]
"""The names of the tool-call parser registry (``rollout/envs/parsers.py``); a test keeps them equal."""


class ToolEnvOptions(Section):
    tools: Annotated[
        list[str],
        doc(
            "Python functions exposed as tools, as `module:function` (their signature and docstring become the "
            "tool's JSON schema)."
        ),
    ] = field(default_factory=list)
    parser: Annotated[
        ToolParserName,
        doc(
            "How tool calls are read from the model's text: `hermes` (<tool_call>{json}</tool_call>, the Qwen2.5 / "
            "Hermes chat templates' format), `pythonic` (name(arg=...) calls, Llama 3.2 style) or `json` (the whole "
            "message is one {name, arguments} object)."
        ),
    ] = "hermes"
    system_prompt: Annotated[
        str | None,
        doc(
            "A system message put before every prompt (null = none; the tool schemas reach the model through the "
            "chat template's `tools` argument either way)."
        ),
    ] = None
    timeout_s: Annotated[
        float, doc("Longest one tool call may run; slower calls fail the sample (counted, dropped).", gt=0)
    ] = 10.0


class UserEnvOptions(Section):
    cls: Annotated[
        str | None,
        doc(
            "The environment class as `module:Class` (the contract is in docs/environments.md: reset(row) -> "
            "messages, step(message) -> (observations, reward, done, info); one instance per episode)."
        ),
    ] = None
    args: Annotated[dict[str, Any], doc("Keyword arguments of the class's constructor.")] = field(default_factory=dict)


class HttpEnvOptions(Section):
    url: Annotated[
        str | None, doc("Base URL of the environment server (POST {url}/reset, {url}/step, {url}/close).")
    ] = None
    timeout_s: Annotated[float, doc("Time limit of one HTTP call; a slower call is retried.", gt=0)] = 30.0
    retries: Annotated[
        int,
        doc(
            "Retries of a call that timed out, failed to connect or got a 5xx; then the sample "
            "fails (counted, dropped).",
            ge=0,
        ),
    ] = 3
    backoff_s: Annotated[float, doc("First pause between retries; it doubles each retry.", ge=0)] = 0.5
    headers: Annotated[dict[str, str], doc("Extra HTTP headers of every call (e.g. an Authorization header).")] = field(
        default_factory=dict
    )


class VerifiersEnvOptions(Section):
    taskset: Annotated[
        str | None,
        doc(
            "The verifiers (0.4, `verifiers.v1`) taskset id: an installed module exporting one `vf.Taskset` subclass "
            "in `__all__` (a built-in under `verifiers.v1.tasksets`, or any importable module, e.g. "
            "`my_pkg.my_taskset`). Needs the `verifiers` extra."
        ),
    ] = None
    args: Annotated[
        dict[str, Any],
        doc(
            "Fields of the taskset's config (its `vf.TasksetConfig` subclass), e.g. {task: {...}, system_prompt: ...}."
        ),
    ] = field(default_factory=dict)
    limit: Annotated[
        int | None,
        doc(
            "Tasks `fleetrl verifiers-data` exports as the prompt set (null = all; an infinite taskset needs a limit)."
        ),
    ] = None
    score_timeout_s: Annotated[
        float, doc("Longest the taskset's rubric may take to score one episode; slower fails the sample.", gt=0)
    ] = 60.0


class EnvConfig(Section):
    type: Annotated[
        EnvType,
        doc(
            "How a sample is produced: `single_turn` (one completion, scored by rollout.rewards), `tool` (Python tools), "
            "`user` (a class), `http` (a remote environment server), `openai` (external agents through the "
            "OpenAI-compatible endpoint, rollout.openai) or `verifiers` (a verifiers taskset run in-process, scored "
            "by its rubric)."
        ),
    ] = "single_turn"
    max_turns: Annotated[
        int, doc("Most assistant turns of one episode; an episode still going then is truncated.", ge=1)
    ] = 8
    max_tokens_per_turn: Annotated[
        int | None,
        doc(
            "Most tokens sampled in one assistant turn (null = rollout.max_new_tokens), like max_tokens of one API "
            "call: a turn cut there ends that turn (counted) and the episode goes on."
        ),
    ] = None
    max_total_tokens: Annotated[
        int,
        doc(
            "Most response tokens of one episode, sampled and appended together (prompt excluded); reaching it "
            "truncates the episode.",
            ge=1,
        ),
    ] = 1024
    on_truncation: Annotated[
        Literal["score", "drop"],
        doc(
            "An episode truncated by a budget is scored as it stands (`score`, finish_reason `length`, counted) or "
            "dropped like a failed one (`drop`)."
        ),
    ] = "score"
    min_group_samples: Annotated[
        int,
        doc(
            "A group that lost samples (a failed environment step, a timed-out session) is pushed with its survivors "
            "when at least this many remain (capped at rollout.group_size), else dropped and its prompt returned.",
            ge=1,
        ),
    ] = 2
    step_timeout_s: Annotated[
        float,
        doc(
            "Time limit of one reset or step of a `user` environment; a slower one fails the sample (counted, "
            "dropped).",
            gt=0,
        ),
    ] = 30.0
    check_template: Annotated[
        bool,
        doc(
            "At start-up, check that the chat template is prefix-stable for the environment's messages (token-in/"
            "token-out needs it) and refuse to start where it is not, naming the first mismatching position."
        ),
    ] = True
    tool: Annotated[ToolEnvOptions, doc("`type: tool` settings.")] = field(default_factory=ToolEnvOptions)
    user: Annotated[UserEnvOptions, doc("`type: user` settings.")] = field(default_factory=UserEnvOptions)
    http: Annotated[HttpEnvOptions, doc("`type: http` settings.")] = field(default_factory=HttpEnvOptions)
    verifiers: Annotated[VerifiersEnvOptions, doc("`type: verifiers` settings.")] = field(
        default_factory=VerifiersEnvOptions
    )

    def __post_init__(self) -> None:
        if self.type == "tool" and not self.tool.tools:
            raise ValueError(
                "rollout.env.type is `tool` but rollout.env.tool.tools is empty; list the tool functions "
                "as module:function, e.g. [fleetrl.rollout.envs.tools:calc]"
            )
        if self.type == "user" and not self.user.cls:
            raise ValueError(
                "rollout.env.type is `user` but rollout.env.user.cls is not set; name the class as module:Class"
            )
        if self.type == "http" and not self.http.url:
            raise ValueError(
                "rollout.env.type is `http` but rollout.env.http.url is not set; give the environment "
                "server's base URL, e.g. http://127.0.0.1:9000"
            )
        if self.type == "verifiers" and not self.verifiers.taskset:
            raise ValueError(
                "rollout.env.type is `verifiers` but rollout.env.verifiers.taskset is not set; name the verifiers "
                "taskset id (an installed module exporting a vf.Taskset), e.g. my_pkg.my_taskset"
            )
        if self.verifiers.limit is not None and self.verifiers.limit < 1:
            raise ValueError("rollout.env.verifiers.limit must be >= 1 (or null for every task)")
        if self.max_tokens_per_turn is not None and self.max_tokens_per_turn < 1:
            raise ValueError("rollout.env.max_tokens_per_turn must be >= 1 (or null for rollout.max_new_tokens)")

    @property
    def multi_turn(self) -> bool:
        return self.type != "single_turn"


class OpenAIConfig(Section):
    enabled: Annotated[
        bool,
        doc(
            "Serve the OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, "
            "/v1/models) on this rollout server."
        ),
    ] = False
    host: Annotated[str, doc("Address the endpoint binds; keep 127.0.0.1 unless agents run on other machines.")] = (
        "127.0.0.1"
    )
    port: Annotated[
        int,
        doc(
            "Port of server 0 (server i uses port + i); 0 = a free port, written to <run dir>/rollout-<i>.openai.json.",
            ge=0,
            le=65535,
        ),
    ] = 8000
    api_key: Annotated[
        str | None, doc("Bearer token every request must carry (null = none; set one whenever host is not loopback).")
    ] = None
    model_name: Annotated[str, doc("The model id /v1/models lists (requests may name any model).")] = "fleetrl"
    session_header: Annotated[
        str,
        doc(
            "Header naming a request's training session (after the session in the base "
            "URL /sessions/<id>/v1; the `user` field only when it names a session). Not "
            "X-Session-Id, which verifiers sends on every call."
        ),
    ] = "X-Fleetrl-Session"
    session_timeout_s: Annotated[
        float,
        doc(
            "A training session without a call or a close for this long is closed as failed: its tokens are not "
            "trained (counted; its group follows rollout.env.min_group_samples).",
            gt=0,
        ),
    ] = 300.0
    max_tokens: Annotated[
        int | None, doc("Longest completion of one call without max_tokens (null = rollout.max_new_tokens).")
    ] = None
    max_body_bytes: Annotated[
        int, doc("Largest request body; a larger one is refused with 413 before it is read whole.", ge=1024)
    ] = 8 * 1024 * 1024
    body_timeout_s: Annotated[
        float,
        doc(
            "A request body not received whole within this long is refused with 408 (a slow sender holds no handler).",
            gt=0,
        ),
    ] = 30.0
    max_connections: Annotated[
        int,
        doc(
            "Open connections at most; a new one beyond it closes the longest-idle one "
            "(a connection with no call in progress).",
            ge=1,
        ),
    ] = 256
    idle_timeout_s: Annotated[
        float,
        doc(
            "A connection with no call in progress for this long is closed; it is also "
            "the time a new connection has to send its first request.",
            gt=0,
        ),
    ] = 15.0
    max_sessions_per_client: Annotated[
        int,
        doc(
            "Training sessions one client (remote address) may hold open at once; more get 429 (0 = no limit). "
            "An agent running N sessions in parallel needs N.",
            ge=0,
        ),
    ] = 128

    def __post_init__(self) -> None:
        if not self.api_key and not is_loopback(self.host):
            raise ValueError(
                f"rollout.openai.host={self.host!r} is not a loopback address and rollout.openai.api_key "
                "is not set: anyone who reaches the port could generate and train; set an api_key, or "
                "bind 127.0.0.1"
            )


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
