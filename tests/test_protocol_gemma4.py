"""Gemma-4's chat protocol with plain strings: the streaming parser (content, reasoning, tool calls, failure modes),
the request side (OpenAI messages -> template inputs), family detection. No torch, no model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.protocol import PlainProtocol, ProtocolError, collect, detect_protocol
from server.protocol.gemma4 import MARKERS, QUOTE, Gemma4Protocol, format_value, parse_arguments, parse_call

Q = QUOTE
SPECIALS = frozenset(MARKERS) | {"<eos>", "<bos>", "<pad>", "<unused7>"}


def parse(*chunks: str, tool_names: tuple[str, ...] = (), parse_tool_calls: bool = True):
    ids = iter(f"call_{i}" for i in range(100))
    parser = Gemma4Protocol(SPECIALS).parser(tool_names=tool_names, parse_tool_calls=parse_tool_calls,
                                             new_id=lambda: next(ids))
    return collect(parser, *chunks)


def every_split(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut at every single position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def calls(message) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in message.tool_calls]


# --------------------------------------------------------------------- answers, thoughts, calls


def test_plain_answer_is_content() -> None:
    for chunks in every_split("Paris is the capital of France."):
        message = parse(*chunks)
        assert (message.content, message.reasoning, message.tool_calls, message.called_tools) == \
            ("Paris is the capital of France.", "", [], False)


def test_thought_then_answer() -> None:
    text = "<|channel>thought\nThe user wants a capital.\nIt is Paris.<channel|>Paris."
    for chunks in every_split(text):
        message = parse(*chunks)
        assert message.reasoning == "The user wants a capital.\nIt is Paris."
        assert message.content == "Paris."


def test_reasoning_streams_as_it_arrives() -> None:
    parser = Gemma4Protocol().parser()
    assert parser.feed("<|channel>thought\nfirst ").reasoning == "first "
    assert parser.feed("second").reasoning == "second"
    delta = parser.feed("<channel|>answer")
    assert (delta.reasoning, delta.content) == ("", "answer")


def test_one_call() -> None:
    text = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},n:42,flag:true,ratio:-1.5e3}}<tool_call|>"
    for chunks in every_split(text):
        message = parse(*chunks, tool_names=("get_weather",))
        assert calls(message) == [("get_weather", {"city": "Paris", "n": 42, "flag": True, "ratio": -1500.0})]
        assert message.content == "" and message.called_tools
        assert [(c.index, c.id) for c in message.tool_calls] == [(0, "call_0")]


def test_two_calls_nested_values() -> None:
    text = (f"<|tool_call>call:search{{query:{Q}a, b: {{c}}{Q},filters:{{lang:[{Q}en{Q},{Q}fr{Q}],max:null}}}}"
            f"<tool_call|><|tool_call>call:clock{{}}<tool_call|>")
    for chunks in every_split(text):
        message = parse(*chunks)
        assert calls(message) == [("search", {"query": "a, b: {c}", "filters": {"lang": ["en", "fr"], "max": None}}),
                                  ("clock", {})]
        assert [c.index for c in message.tool_calls] == [0, 1]


def test_call_after_a_thought_and_text() -> None:
    text = f"<|channel>thought\nI need the weather.<channel|>Let me check.<|tool_call>call:w{{c:{Q}X{Q}}}<tool_call|>"
    message = parse(text)
    assert (message.reasoning, message.content) == ("I need the weather.", "Let me check.")
    assert calls(message) == [("w", {"c": "X"})]


def test_arguments_are_the_final_json_string() -> None:
    message = parse(f"<|tool_call>call:f{{s:{Q}quote \" and \\ and é{Q}}}<tool_call|>")
    assert json.loads(message.tool_calls[0].arguments) == {"s": 'quote " and \\ and é'}


# --------------------------------------------------------------------- failure modes


def test_string_delimiter_never_reaches_content_or_arguments() -> None:
    for text in (f"He said {Q}hi{Q}.", f"<|channel>thought\n{Q}x{Q}<channel|>ok",
                 f"<|tool_call>call:f{{a:{Q}b{Q}}}<tool_call|>", f"<|tool_call>call:f{{a:{Q}unterminated}}<tool_call|>",
                 f"call:f{{a:{Q}b", f"<|tool_call>call:f{{a:{Q}b"):
        for chunks in every_split(text):
            message = parse(*chunks)
            everything = message.content + message.reasoning + "".join(c.arguments for c in message.tool_calls)
            assert Q not in everything, (text, chunks)
    assert parse(f"He said {Q}hi{Q}.").content == 'He said "hi".'


def test_call_without_the_call_prefix_is_parsed() -> None:
    message = parse(f"<|tool_call>get_weather{{city:{Q}Oslo{Q}}}<tool_call|>")
    assert calls(message) == [("get_weather", {"city": "Oslo"})]


def test_call_without_the_opening_token_is_parsed_when_closed() -> None:
    text = f"Checking. call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>"
    for chunks in every_split(text):
        message = parse(*chunks)
        assert calls(message) == [("get_weather", {"city": "Oslo"})], chunks
        assert message.content == "Checking. "


def test_unclosed_call_without_opening_token_is_a_call_only_to_a_declared_tool() -> None:
    text = f"call:get_weather{{city:{Q}Oslo{Q}}}"
    assert calls(parse(text, tool_names=("get_weather",))) == [("get_weather", {"city": "Oslo"})]
    undeclared = parse(text, tool_names=("other",))
    assert (undeclared.tool_calls, undeclared.content) == ([], 'call:get_weather{city:"Oslo"}')


def test_words_like_call_stay_content() -> None:
    for text in ("Please call: 555-1234.", "recall:this", "call:me maybe", "call:f{not gemma}", "call:"):
        for chunks in every_split(text):
            message = parse(*chunks)
            assert (message.content, message.tool_calls) == (text, []), chunks


def test_what_does_not_parse_as_a_call_comes_back_as_content() -> None:
    for body in ("call:f{a:}", "call:f{a b}", "call:{x:1}", "call:f{a:1}trailing", "just text"):
        message = parse(f"Before <|tool_call>{body}<tool_call|> after")
        assert message.tool_calls == [] and not message.called_tools
        assert message.content == f"Before {body} after"


def test_call_to_an_undeclared_tool_is_content() -> None:
    message = parse(f"<|tool_call>call:rm_rf{{path:{Q}/{Q}}}<tool_call|>", tool_names=("get_weather",))
    assert message.tool_calls == [] and message.content == 'call:rm_rf{path:"/"}'


def test_stream_cut_mid_call_sends_no_partial_call() -> None:
    text = f"Sure.<|tool_call>call:get_weather{{city:{Q}Par"
    for chunks in every_split(text):
        parser = Gemma4Protocol().parser()
        streamed = [parser.feed(chunk) for chunk in chunks]
        assert not any(delta.tool_calls for delta in streamed)
        end = parser.finish()
        assert not end.called_tools and end.delta.tool_calls == () and end.cut_call
        content = "".join(delta.content for delta in streamed) + end.delta.content
        assert content == "Sure."  # the cut call is dropped: none of its syntax is text


def test_cut_after_one_complete_call_keeps_it() -> None:
    message = parse("<|tool_call>call:a{}<tool_call|><|tool_call>call:b{x:")
    assert calls(message) == [("a", {})] and message.called_tools and message.cut_call
    assert message.content == ""


def test_a_bare_call_cut_short_is_dropped_when_it_names_a_declared_tool() -> None:
    """A call whose `<|tool_call>` is missing, cut: dropped when its name is (or may still become) a declared tool's;
    any other `call:` text stays content."""
    tools = ("get_weather",)
    for text, content in ((f"Sure. call:get_weather{{city:{Q}Pa", "Sure. "), ("Sure. call:get_wea", "Sure. "),
                          (f"call:other{{city:{Q}Pa", 'call:other{city:"Pa'), ("call:me maybe", "call:me maybe")):
        for chunks in every_split(text):
            message = parse(*chunks, tool_names=tools)
            assert (message.content, message.tool_calls) == (content, []), chunks
            assert message.cut_call == (content == "Sure. ")


def test_a_whole_block_that_is_no_call_stays_content() -> None:
    """Only a call the text ended inside is dropped: a closed block that does not parse is still the model's text."""
    message = parse("<|tool_call>call:f{not gemma}<tool_call|>after")
    assert (message.content, message.cut_call) == ("call:f{not gemma}after", False)


def test_next_call_opening_closes_an_unclosed_call() -> None:
    message = parse("<|tool_call>call:a{x:1}<|tool_call>call:b{y:2}<tool_call|>")
    assert calls(message) == [("a", {"x": 1}), ("b", {"y": 2})]


def test_tool_parsing_off_everything_is_content() -> None:
    message = parse(f"<|tool_call>call:f{{a:{Q}b{Q}}}<tool_call|>", parse_tool_calls=False)
    assert message.tool_calls == [] and message.content == 'call:f{a:"b"}'


def test_other_special_tokens_are_removed_but_lookalikes_stay() -> None:
    message = parse("a<eos>b<unused7>c <b>bold</b> <turn|>")
    assert message.content == "abc <b>bold</b> "


def test_stray_channel_close_is_dropped() -> None:
    assert parse("thought text<channel|>answer").content == "thought textanswer"


def test_channel_cut_short_is_reasoning() -> None:
    message = parse("<|channel>thought\nhalf a thou")
    assert (message.reasoning, message.content) == ("half a thou", "")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", " ", "call:", "f", "{", "}", ":", ",", "x", "1", "<", "|", ">", Q, "<eos>",
                                 "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>", "\n", "thought"]),
                max_size=30),
       st.data())
def test_any_output_in_any_split_never_leaks_the_delimiter_and_parses_the_same(pieces: list[str], data) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole, split = parse(text), parse(*chunks)
    assert (whole.content, whole.reasoning, calls(whole)) == (split.content, split.reasoning, calls(split))
    for message in (whole, split):
        assert Q not in message.content + message.reasoning
        for call in message.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)


# --------------------------------------------------------------------- Gemma's argument syntax


def test_format_and_parse_round_trip() -> None:
    value = {"s": "text, with: {braces} [and] commas", "n": 42, "f": 0.5, "t": True, "z": None,
             "list": [1, "two", {"three": [3]}], "nested": {"deeper": {"deepest": False}}, "empty": {}, "none": []}
    assert parse_arguments(format_value(value)) == value
    assert parse_call("call:fn" + format_value(value)) == ("fn", value)


def test_parse_rejects_infinite_numbers() -> None:
    assert parse_call("call:f{x:1e999}") is None


# --------------------------------------------------------------------- request side


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def test_prompt_inputs_convert_openai_tool_round_trip() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 15}'},
        {"role": "tool", "tool_call_id": "c1", "content": "plain text result"},
    ]
    inputs = Gemma4Protocol().prompt_inputs(messages, tools=TOOLS)
    assistant, tool, text_tool = inputs.messages[1:]
    assert "content" not in assistant and assistant["reasoning_content"] == "Use the tool."
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert (tool["name"], tool["content"]) == ("get_weather", {"temperature": 15})
    assert (text_tool["name"], text_tool["content"]) == ("get_weather", "plain text result")
    assert inputs.tools == TOOLS and inputs.template_kwargs == {"enable_thinking": False} and not inputs.thinking


@pytest.mark.parametrize(("kwargs", "effort", "thinking"), [
    (None, None, False), ({"enable_thinking": True}, None, True), (None, "high", True), (None, "none", False),
    ({"enable_thinking": False}, "none", False), ({"other": 1}, "low", True),
])
def test_thinking_from_chat_template_kwargs_and_reasoning_effort(kwargs, effort, thinking) -> None:
    inputs = Gemma4Protocol().prompt_inputs([{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs,
                                            reasoning_effort=effort)
    assert inputs.thinking is thinking and inputs.template_kwargs["enable_thinking"] is thinking
    if kwargs:
        assert inputs.template_kwargs.items() >= {k: v for k, v in kwargs.items() if k != "enable_thinking"}.items()


@pytest.mark.parametrize(("messages", "kwargs", "param"), [
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"enable_thinking": True},
                                          "reasoning_effort": "none"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{not json"}}]}], {},
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}], {},
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "tool", "tool_call_id": "nope", "content": "x"}], {}, "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x"}], {"tools": [{"type": "retrieval"}]}, "tools[0]"),
])
def test_bad_requests_are_protocol_errors(messages, kwargs, param) -> None:
    with pytest.raises(ProtocolError) as caught:
        Gemma4Protocol().prompt_inputs(messages, **kwargs)
    assert caught.value.param == param


def test_plain_protocol_refuses_tools_and_thinking() -> None:
    plain = PlainProtocol()
    assert not plain.keep_special_tokens and not plain.supports_tools
    for kwargs in ({"tools": TOOLS}, {"reasoning_effort": "high"}, {"chat_template_kwargs": {"enable_thinking": True}}):
        with pytest.raises(ProtocolError):
            plain.prompt_inputs([{"role": "user", "content": "x"}], **kwargs)
    with pytest.raises(ProtocolError):
        plain.prompt_inputs([{"role": "tool", "tool_call_id": "a", "content": "x"}])
    inputs = plain.prompt_inputs([{"role": "user", "content": "x"}], reasoning_effort="none")
    assert inputs.messages == [{"role": "user", "content": "x"}]
    text = "raw <|tool_call>call:f{}<tool_call|> text"
    assert collect(plain.parser(), text).content == text


def test_detection_by_vocabulary() -> None:
    gemma4 = detect_protocol({**{m: i for i, m in enumerate(MARKERS)}, "a": 99}, ["<eos>"])
    assert isinstance(gemma4, Gemma4Protocol) and gemma4.keep_special_tokens and "<eos>" in gemma4.special_tokens
    assert isinstance(detect_protocol({"<start_of_turn>": 105, "<end_of_turn>": 106}), PlainProtocol)
    assert isinstance(detect_protocol({m: i for i, m in enumerate(MARKERS[:-1])}), PlainProtocol)


def test_protocol_modules_import_no_torch() -> None:
    code = "import sys, server.protocol.gemma4, server.protocol; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
