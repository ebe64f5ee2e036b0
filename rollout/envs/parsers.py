"""Tool-call parsers, looked up by ``rollout.env.tool.parser``: the model's text -> (content, calls, malformed).

    hermes     <tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>   (Qwen2.5, Hermes)
    pythonic   calc("2+3")  or  [calc(expression="2+3"), other(x=1)]                     (Llama 3.2 style)
    json       {"name": "calc", "arguments": {"expression": "2+3"}}                      (the whole message)

Every parser has one signature: ``parse(text, params) -> Parsed``, where ``params`` maps each known
tool to its parameter names in order (pythonic maps positional arguments with it). Text that
*tries* to be a call and is not one (bad JSON, an unclosed tag, a non-literal argument) is
``malformed``, with the reason; it is never silently taken as plain content. The OpenAI endpoint
uses the same parsers to return ``tool_calls``.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.common.plugins.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")

    def openai(self) -> dict[str, Any]:
        """As an OpenAI ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass
class Parsed:
    content: str  # the text without the calls
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # one reason per call that could not be read


Parser = Callable[[str, dict[str, list[str]]], Parsed]
TOOL_PARSERS: Registry[Parser] = Registry("tool-call parser", config_key="rollout.env.tool.parser")


def _call_from_json(obj: Any) -> ToolCall | str:
    """A ToolCall from {"name", "arguments" | "parameters"}, or the reason it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f"a tool call must be an object with a string `name`, got {str(obj)[:80]!r}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return f"arguments of {obj['name']!r} are not JSON: {e}"
    if not isinstance(args, dict):
        return f"arguments of {obj['name']!r} must be an object, got {type(args).__name__}"
    return ToolCall(obj["name"], args)


HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

# The text that opens a tool call, for the parsers whose calls follow free text: a streamed reply (the
# endpoint's ``stream: true`` with ``tools``) may send the text before it as it is sampled. The other parsers
# read the whole turn as one call or as content, so their replies stream at the end.
STREAM_MARKERS: dict[str, str] = {"hermes": "<tool_call>"}


@TOOL_PARSERS.register("hermes")
def hermes(text: str, params: dict[str, list[str]]) -> Parsed:
    out = Parsed(content="")
    for block in HERMES.findall(text):
        try:
            call = _call_from_json(json.loads(block))
        except json.JSONDecodeError as e:
            call = f"the tool call is not JSON ({e.msg})"
        (out.calls if isinstance(call, ToolCall) else out.malformed).append(call)
    rest = HERMES.sub("", text)
    if "<tool_call>" in rest:
        out.malformed.append("a <tool_call> tag is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    out.content = rest.strip()
    return out


LOOKS_LIKE_CALL = re.compile(r"^\s*\[?\s*[A-Za-z_][A-Za-z_0-9]*\s*\(")


def _literal(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _pythonic_call(node: ast.AST, params: dict[str, list[str]]) -> ToolCall | str:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return "expected name(arguments)"
    name = node.func.id
    try:
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        positional = [_literal(a) for a in node.args]
    except (ValueError, SyntaxError):
        return f"arguments of {name!r} must be literals (numbers, strings, lists...)"
    if positional:
        names = params.get(name)
        if names is None or len(positional) > len(names):
            return f"{name!r} got {len(positional)} positional argument(s); name them"
        for key, value in zip(names, positional):
            if key in args:
                return f"{name!r} got argument {key!r} twice"
            args[key] = value
    return ToolCall(name, args)


@TOOL_PARSERS.register("pythonic")
def pythonic(text: str, params: dict[str, list[str]]) -> Parsed:
    stripped = text.strip()
    if not LOOKS_LIKE_CALL.match(stripped):
        return Parsed(content=stripped)
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError as e:
        return Parsed(content="", malformed=[f"not a Python call ({e.msg})"])
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    out = Parsed(content="")
    for node in nodes:
        call = _pythonic_call(node, params)
        (out.calls if isinstance(call, ToolCall) else out.malformed).append(call)
    return out


@TOOL_PARSERS.register("json")
def json_call(text: str, params: dict[str, list[str]]) -> Parsed:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return Parsed(content=stripped)
    try:
        call = _call_from_json(json.loads(stripped))
    except json.JSONDecodeError as e:
        call = f"the tool call is not JSON: {e}"
    return Parsed(content="", calls=[call]) if isinstance(call, ToolCall) else Parsed(content="", malformed=[call])
