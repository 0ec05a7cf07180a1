"""The Gemma-4-format test tokenizer (tests/support/gemma4_tokenizer.py) and its chat template: single-token markers inside
the 262,144 logits, the format rendered as Gemma-4 defines it, the same text through transformers (the reference)
and through HostTokenizer, and a round trip through the protocol."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.model.tokenizer import HostTokenizer
from server.protocol import Gemma4Protocol, PlainProtocol, collect, detect_protocol
from tests.support.gemma4_tokenizer import GEMMA4_TOKENS, STOP_IDS, gemma4_cfg_dir
from tests.support.models import gemma_tokenizer_json

Q = '<|"|>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}]
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 15, "sky": "clear"}'},
]


@pytest.fixture(scope="module")
def cfg() -> Path:
    return gemma4_cfg_dir()


@pytest.fixture(scope="module")
def tokenizer(cfg: Path) -> HostTokenizer:
    return HostTokenizer.from_dir(cfg)


def render(tokenizer: HostTokenizer, messages: list[dict], **kwargs: object) -> str:
    protocol = detect_protocol(tokenizer.get_vocab())
    inputs = protocol.prompt_inputs(messages, tools=kwargs.pop("tools", None), **kwargs)  # type: ignore[arg-type]
    return tokenizer.apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=True,
                                         **inputs.template_kwargs)


def test_markers_are_single_tokens_inside_the_logits(tokenizer: HostTokenizer, cfg: Path) -> None:
    assert tokenizer.backend_tokenizer.get_vocab_size() == 262_144
    for text, token_id in GEMMA4_TOKENS.items():
        assert tokenizer.encode(text, add_special_tokens=False) == [token_id]
        assert tokenizer.decode([token_id]) == text
        assert tokenizer.decode([token_id], skip_special_tokens=True) == ""
    assert json.loads((cfg / "generation_config.json").read_text())["eos_token_id"] == list(STOP_IDS)
    assert [tokenizer.convert_ids_to_tokens(i) for i in STOP_IDS] == ["<eos>", "<turn|>", "<|tool_response>"]
    # Ordinary text tokenizes as in the original tokenizer.
    original = HostTokenizer.from_dir(gemma_tokenizer_json().parent)
    sample = "Weather in Paris? 15 °C, {\"a\": [1, 2]}"
    assert tokenizer.encode(sample) == original.encode(sample)


def test_family_detection(tokenizer: HostTokenizer) -> None:
    assert isinstance(detect_protocol(tokenizer.get_vocab()), Gemma4Protocol)
    original = HostTokenizer.from_dir(gemma_tokenizer_json().parent)
    assert isinstance(detect_protocol(original.get_vocab()), PlainProtocol)


def test_turns_and_thinking_off(tokenizer: HostTokenizer) -> None:
    prompt = render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!",
                                                                    "reasoning_content": "greet back"},
                                {"role": "user", "content": "Bye"}])
    assert prompt == ("<bos><|turn>user\nHi<turn|>\n<|turn>model\nHello!<turn|>\n<|turn>user\nBye<turn|>\n"
                      "<|turn>model\n<|channel>thought\n<channel|>")  # earlier thoughts dropped, empty channel


def test_thinking_on(tokenizer: HostTokenizer) -> None:
    prompt = render(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                    reasoning_effort="high")
    assert prompt == "<bos><|turn>system\n<|think|>Be brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    alone = render(tokenizer, [{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": True})
    assert alone.startswith("<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n")


def test_tools_calls_and_responses_in_one_model_turn(tokenizer: HostTokenizer) -> None:
    prompt = render(tokenizer, ROUND_TRIP, tools=TOOLS)
    assert prompt == (
        "<bos><|turn>system\nBe brief."
        f"<|tool>declaration:get_weather{{description:{Q}Current weather{Q},parameters:{{properties:{{"
        f"city:{{description:{Q}City name{Q},type:{Q}STRING{Q}}},days:{{type:{Q}INTEGER{Q}}}}},"
        f"required:[{Q}city{Q}],type:{Q}OBJECT{Q}}}}}<tool|><turn|>\n"
        "<|turn>user\nWeather in Paris?<turn|>\n"
        "<|turn>model\n<|channel>thought\nI should call the tool.<channel|>"
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"
        f"<|tool_response>response:get_weather{{sky:{Q}clear{Q},temperature:15}}<tool_response|>")
    # The model's answer continues the same turn; the next user message closes it.
    later = render(tokenizer, [*ROUND_TRIP, {"role": "assistant", "content": "15 °C and clear."},
                               {"role": "user", "content": "Thanks"}], tools=TOOLS)
    assert "temperature:15}<tool_response|>15 °C and clear.<turn|>\n<|turn>user\nThanks<turn|>\n" in later
    assert "I should call the tool." not in later  # a thought of an earlier turn


def test_transformers_renders_the_same(tokenizer: HostTokenizer, cfg: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(cfg)
    protocol = Gemma4Protocol()
    for messages, kwargs in ((ROUND_TRIP, {"tools": TOOLS}), (ROUND_TRIP[:2], {"reasoning_effort": "low"}),
                             ([*ROUND_TRIP, {"role": "assistant", "content": "ok"}], {"tools": TOOLS})):
        inputs = protocol.prompt_inputs(messages, **kwargs)  # type: ignore[arg-type]
        for add in (True, False):
            ours = tokenizer.apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=add,
                                                 **inputs.template_kwargs)
            theirs = reference.apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=add,
                                                   tokenize=False, **inputs.template_kwargs)
            assert ours == theirs


def test_a_rendered_call_parses_back(tokenizer: HostTokenizer) -> None:
    prompt = render(tokenizer, ROUND_TRIP[:3], tools=TOOLS)
    model_turn = prompt.split("<|turn>model\n")[1].split("<turn|>")[0]
    ids = tokenizer.encode(model_turn, add_special_tokens=False)
    text = tokenizer.decode(ids)  # as the detokenizer hands it over for Gemma-4: special tokens kept
    message = collect(Gemma4Protocol().parser(tool_names=["get_weather"]), text)
    assert message.reasoning == "I should call the tool."
    assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                                "days": 2})]
