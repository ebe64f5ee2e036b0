"""Reading a hermes tool call's name and arguments from a reply still being sampled (rollout/endpoint/tool_stream.py)."""

from __future__ import annotations

import json

from fleetrl.rollout.endpoint.tool_stream import PartialCall, partial_calls

M = "<tool_call>"
ARGS = '{"q": "a } and a \\" and a {", "deep": {"x": [1, {"y": 2}]}}'
TEXT = f'Hi.\n{M}\n{{"name": "search", "arguments": {ARGS}}}\n</tool_call>\n{M}{{"name": "f.v-2", "arguments": {{}}}}</tool_call>'


def test_every_prefix_reads_a_prefix_of_the_finished_calls():
    final = partial_calls(TEXT, M)
    assert final == [PartialCall("search", ARGS, True), PartialCall("f.v-2", "{}", True)]
    assert json.loads(final[0].arguments)["q"] == 'a } and a " and a {'  # braces and quotes inside strings
    for n in range(len(TEXT) + 1):
        for k, call in enumerate(partial_calls(TEXT[:n], M)):
            assert call.name == final[k].name and final[k].arguments.startswith(call.arguments)
            assert call.closed == (call.arguments == final[k].arguments)


def test_a_call_shows_once_its_name_and_the_arguments_brace_are_sampled():
    assert partial_calls(f'{M}{{"name": "sea', M) == []
    assert partial_calls(f'{M}{{"name": "search", "argu', M) == []
    assert partial_calls(f'{M}{{"name": "search", "arguments": ', M) == []
    assert partial_calls(f'{M}{{"name": "search", "arguments": {{"q', M) == [PartialCall("search", '{"q', False)]


def test_calls_written_another_way_do_not_stream():
    assert partial_calls(f'{M}{{"arguments": {{}}, "name": "f"}}</tool_call>', M) == []  # keys the other way
    assert partial_calls(f'{M}{{"name": "f", "parameters": {{}}}}</tool_call>', M) == []
    assert partial_calls(f'{M}{{"name": "f", "arguments": "{{}}"}}</tool_call>', M) == []  # arguments as a string
    # a call that cannot stream ends the list: the ones after it cannot be numbered
    later = f'{M}{{"name": "g", "arguments": {{}}}}</tool_call>'
    assert partial_calls(f'{M}{{"arguments": {{}}, "name": "f"}}</tool_call>{later}', M) == []
    assert partial_calls("no call here", M) == []
