"""``tool``: Python functions exposed as tools (``rollout.env.tool``).

Each function's signature and docstring become its JSON schema, handed to the chat template as
``tools``. An episode: the prompt as a user message (after ``system_prompt``, if set) -> the model
writes text; calls in it are parsed (``rollout.env.tool.parser``) -> each call runs and its result
goes back as a ``tool`` message -> the model goes on, until a turn has no call (its text is the
answer, scored by ``rollout.rewards``) or a budget ends the episode.

What is counted (``env/...`` metrics), and what becomes of the sample:

- a well-formed call: ``tool_calls``; a call that cannot be read, names no known tool or has
  arguments the function does not take: ``malformed_tool_calls``, and the model gets an error
  message as the tool's answer (the episode goes on; it is the policy's mistake, it is trained);
- a tool that raises: ``tool_errors``, its error text is the tool's answer (also the policy's doing);
- a tool slower than ``rollout.env.tool.timeout_s``: ``timeouts``, the sample is dropped (the
  environment failed, nobody's answer is known).
"""

from __future__ import annotations

import inspect
import typing
from collections import Counter
from collections.abc import Callable
from typing import Any

from fleetrl.common.config import ConfigError
from fleetrl.rollout.envs.base import EnvFailure, EnvSession, EnvTimeout, Message, StepResult, Task
from fleetrl.rollout.envs.multi import MultiTurnEnvironment, call_with_timeout
from fleetrl.rollout.envs.parsers import TOOL_PARSERS, Parsed, ToolCall
from fleetrl.rollout.rewards.python import load_function

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style function schema of ``fn``: its name, the docstring's first paragraph, and one
    property per parameter (typed from the annotation; required when it has no default)."""
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = typing.get_origin(hints.get(name)) or hints.get(name)
        props[name] = {"type": JSON_TYPES.get(tp, "string")}
        if p.default is p.empty:
            required.append(name)
    doc = inspect.getdoc(fn) or ""
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": doc.split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def load_tools(refs: list[str]) -> tuple[dict[str, Callable[..., Any]], list[str]]:
    """(name -> function, one problem per entry that does not import, is not a function, has no JSON schema
    or repeats a name), as `fleetrl config validate` and the environment's start both check them."""
    tools: dict[str, Callable[..., Any]] = {}
    problems = []
    for i, ref in enumerate(refs):
        key = f"rollout.env.tool.tools[{i}]"
        try:
            fn = load_function(ref)
        except ValueError as e:
            problems.append(f"{key}: {e}")
            continue
        if not callable(fn):
            problems.append(
                f"{key}: {ref!r} is a {type(fn).__name__}, not a function; name a function (module:function)"
            )
            continue
        try:
            tool_schema(fn)
        except Exception as e:  # an annotation that does not resolve, a signature inspect cannot read
            problems.append(
                f"{key}: {ref!r} has no tool schema ({type(e).__name__}: {e}); fix its signature or annotations"
            )
            continue
        if fn.__name__ in tools:
            problems.append(
                f"{key}: {ref!r} has the same name as another tool ({fn.__name__!r}); the model calls "
                "tools by name, so give each a name of its own"
            )
            continue
        tools[fn.__name__] = fn
    return tools, problems


def tool_problems(cfg: Any) -> list[str]:
    """`config validate`'s check of rollout.env.tool.tools (nothing for other environment types)."""
    return load_tools(cfg.rollout.env.tool.tools)[1] if cfg.rollout.env.type == "tool" else []


class ToolEnv(MultiTurnEnvironment):
    def __init__(self, cfg: Any, tokenizer: Any):
        opts = cfg.rollout.env.tool
        self.tools, problems = load_tools(opts.tools)
        if problems:
            raise ConfigError(problems[0])
        self.params = {name: list(inspect.signature(fn).parameters) for name, fn in self.tools.items()}
        self.parser = TOOL_PARSERS[opts.parser]
        self.opts = opts
        super().__init__(cfg, tokenizer)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool_schema(fn) for fn in self.tools.values()]

    def session(self, task: Task) -> EnvSession:
        return ToolSession(self)

    def example_messages(self) -> list[Message]:
        name = next(iter(self.tools))
        return [
            *([{"role": "system", "content": self.opts.system_prompt}] if self.opts.system_prompt else []),
            {"role": "user", "content": "a question"},
            {"role": "assistant", "content": f"a call of {name}"},
            {"role": "tool", "name": name, "content": "its result"},
            {"role": "assistant", "content": "another call"},
            {"role": "tool", "name": name, "content": "1"},
            {"role": "assistant", "content": "the answer"},
        ]


class ToolSession(EnvSession):
    def __init__(self, env: ToolEnv):
        self.env = env

    async def reset(self, row: dict[str, Any]) -> list[Message]:
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        system = self.env.opts.system_prompt
        return ([{"role": "system", "content": system}] if system else []) + messages

    async def step(self, message: Message) -> StepResult:
        parsed: Parsed = self.env.parser(str(message.get("content") or ""), self.env.params)
        counts: Counter[str] = Counter(malformed_tool_calls=len(parsed.malformed))
        if not parsed.calls and not parsed.malformed:
            return StepResult(done=True, info={"_counts": counts})
        observations = [
            {"role": "tool", "content": f"error: malformed tool call: {reason}"} for reason in parsed.malformed
        ]
        for call in parsed.calls:
            observations.append(await self.run(call, counts))
        return StepResult(observations, info={"_counts": counts})

    async def run(self, call: ToolCall, counts: Counter[str]) -> Message:
        fn = self.env.tools.get(call.name)
        reply = {"role": "tool", "name": call.name, "tool_call_id": call.id}
        if fn is None:
            counts["malformed_tool_calls"] += 1
            return {**reply, "content": f"error: unknown tool {call.name!r}; tools: {', '.join(self.env.tools)}"}
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            counts["malformed_tool_calls"] += 1
            return {**reply, "content": f"error: bad arguments for {call.name}: {e}"}
        counts["tool_calls"] += 1
        try:
            result = await call_with_timeout(
                lambda: fn(**call.arguments), timeout_s=self.env.opts.timeout_s, what=f"tool {call.name}"
            )
        except EnvTimeout:
            raise  # the environment failed: the sample is dropped
        except EnvFailure as e:  # the tool raised: its error is its answer
            counts["tool_errors"] += 1
            cause = e.__cause__ or e
            return {**reply, "content": f"error: {type(cause).__name__}: {cause}"}
        return {**reply, "content": str(result)}
