"""A hermes tool call's name and arguments read from a reply that is still being sampled.

``partial_calls(text, marker)`` finds each ``<tool_call>`` in the text so far whose JSON opens as
``{"name": "<name>", "arguments": {`` (whitespace allowed) and returns, per call, its name, the text of
its ``arguments`` object as far as it has been sampled, and whether that object has closed. The arguments
text is the model's own, a growing prefix of what the finished reply holds, so a streamed call can send
it in pieces as it grows (`stream.Sender`). A call written another way (keys in the other order, a
``parameters`` key, arguments as a string) is not found here; it goes out whole at the end, parsed from
the finished turn like every call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z_][A-Za-z0-9_.\-]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class PartialCall:
    name: str
    arguments: str  # the arguments object's text so far
    closed: bool  # its closing brace has been sampled


def object_prefix(text: str, start: int) -> tuple[str, bool]:
    """The JSON object opening at ``text[start]`` (a ``{``) as far as ``text`` goes, and whether it closed."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[start : i + 1], True
    return text[start:], False


def partial_calls(text: str, marker: str) -> list[PartialCall]:
    """The calls of ``text`` (a reply so far) that can stream, in order; see the module docstring. A call whose
    head is not complete yet ends the list (the ones after it cannot be numbered)."""
    calls: list[PartialCall] = []
    at = text.find(marker)
    while at >= 0:
        head = HEAD.match(text, at + len(marker))
        if head is None:
            break
        arguments, closed = object_prefix(text, head.end())
        calls.append(PartialCall(head.group(1), arguments, closed))
        if not closed:
            break
        at = text.find(marker, head.end() + len(arguments))
    return calls
