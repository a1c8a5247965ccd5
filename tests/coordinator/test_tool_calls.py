"""Hermes tool calls in the model's text: read, refused with a reason, and the turn cut
after the first complete call at a token boundary."""

from services.coordinator.generation.tool_calls import parse_tool_calls, tokens_through_first_call
from services.env.types import ToolCall


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text]


def test_a_call_is_read():
    text = 'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    calls, error = parse_tool_calls(text)
    assert calls == [ToolCall("calculator", {"expression": "2*3"})] and error == ""


def test_arguments_given_as_a_json_string_are_read():
    text = (
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == ([ToolCall("calculator", {"expression": "1"})], "")


def test_no_call_is_no_error():
    assert parse_tool_calls("The answer is #### 6") == ([], "")


def test_unreadable_calls_say_why():
    assert parse_tool_calls("<tool_call>{nope</tool_call>")[1].startswith(
        "the tool call is not JSON"
    )
    assert parse_tool_calls('<tool_call>["x"]</tool_call>')[1] == (
        'a tool call needs a JSON object with a "name"'
    )
    assert parse_tool_calls('<tool_call>{"name": "c", "arguments": 3}</tool_call>')[1] == (
        "the tool call's arguments are not a JSON object"
    )
    assert (
        parse_tool_calls('<tool_call>{"name": "c"')[1] == "a <tool_call> without its </tool_call>"
    )


def test_the_turn_ends_with_the_token_that_closes_the_first_call():
    call = '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    ids = _ids("ok " + call + " and more <tool_call>")
    keep = tokens_through_first_call(ids, _decode)
    assert _decode(ids[:keep]) == "ok " + call


def test_a_token_that_spans_the_closing_tag_is_kept_whole():
    # tokens of several characters: the one holding "ll>xy" closes the call and stays whole
    pieces = ["<tool_call>", '{"name": "c"}', "</tool_ca", "ll>xy", "zz"]
    vocab = {i: p for i, p in enumerate(pieces)}
    keep = tokens_through_first_call(list(vocab), lambda ids: "".join(vocab[i] for i in ids))
    assert keep == 4


def test_a_turn_without_a_call_is_kept_whole():
    ids = _ids("#### 42")
    assert tokens_through_first_call(ids, _decode) == len(ids)
