"""Issue 26's peer gaps and model names, through live servers (vLLM's and llama.cpp's suites fail on these):

- `/v1/responses` takes vLLM's `top_k`, `min_p`, `repetition_penalty` and `seed`, checked as chat checks them, with
  chat's meaning: on the tiny random Gemma-4 (a real model, so sampling has something to choose from) a seeded
  response is reproducible and equals the chat answer with that seed, `top_k=1` and `min_p=1` sample the greedy answer,
  and `repetition_penalty` changes the greedy answer exactly as it changes chat's.
- `/tokenize` with `messages` + `tools` (+ `chat_template_kwargs`), vLLM's TokenizeChatRequest: the ids are the prompt
  a chat request with those fields submits to the engine, token for token (and so its usage.prompt_tokens).
- `--served-model-name` lists aliases: the first is the id; every alias is accepted by every route that takes a
  `model`, and answered as the first; any other name stays a 404; an empty or repeated name stops the start.
- `--allow-credentials` is in tests/test_cors.py (headers) and tests/test_cors_browser.py (chromium).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from server.__main__ import main
from server.app.runtime import Host, graph_loader
from server.config import Settings, served_names
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.gemma4_app import MODEL, gemma4_server
from tests.support.gemma4_app import Prompts as RecordedPrompts
from tests.test_api_gemma4 import TOOLS

ALIASES = ("claude-sonnet-4-5", "claude-haiku-4-5")
SERVED = ",".join((MODEL, *ALIASES))
# The random model's greedy answer to this is visible text that repeats tokens (to others it is unused tokens, skipped
# in the text), so greedy and repetition-penalised answers can be told apart by their text.
ASK = [{"role": "user", "content": "Hi"}]
TOKENS = 12


host, recorded = gemma4_app.host, gemma4_app.prompts  # shared fixtures (pytest finds them by name)


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[LiveServer]:
    # The host as `serve --served-model-name a,b,c` loads it (gemma4_host names it MODEL alone).
    aliased = dataclasses.replace(host, aliases=served_names(SERVED)[1:])
    graph = graph_loader(aliased)()
    with gemma4_server(aliased, graph, settings(served_model_name=SERVED), wait_grammar=False) as live:
        yield live


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def chat_answer(server: LiveServer, **fields: Any) -> tuple[str, str]:
    """(thought, text) of a chat completion of ASK."""
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": TOKENS, **fields})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    return message.get("reasoning_content") or "", message["content"] or ""


def response_answer(server: LiveServer, **fields: Any) -> tuple[str, str]:
    """(thought, text) of a response to ASK, from its output items."""
    r = post(server, "/v1/responses", {"model": MODEL, "input": ASK, "max_output_tokens": TOKENS, "store": False,
                                       **fields})
    assert r.status_code == 200, r.text
    thought = text = ""
    for item in r.json()["output"]:
        if item["type"] == "reasoning":
            thought += "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
    return thought, text


# ------------------------------------------------------------------ /v1/responses: vLLM's sampling fields


def test_a_seeded_response_is_reproducible_and_is_the_chat_answer_with_that_seed(server: LiveServer) -> None:
    seeded = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 1234}
    first = response_answer(server, **seeded)
    assert first[1]
    assert first == response_answer(server, **seeded)
    assert first == chat_answer(server, **seeded)
    # The seed is what made them equal: other seeds draw other answers.
    others = {response_answer(server, **{**seeded, "seed": seed}) for seed in (1, 2, 3)}
    assert others - {first}, others


def test_top_k_1_and_min_p_1_sample_the_greedy_answer(server: LiveServer) -> None:
    greedy = response_answer(server, temperature=0.0)
    assert greedy[1]
    assert greedy == chat_answer(server, temperature=0.0)
    unseeded_draws = {response_answer(server, temperature=1.0, top_k=0, top_p=1.0, seed=seed) for seed in (5, 6)}
    assert unseeded_draws - {greedy}, "sampling at temperature 1 must differ from greedy somewhere, or this proves nothing"
    assert response_answer(server, temperature=1.0, top_k=1, seed=5) == greedy
    assert response_answer(server, temperature=1.0, top_k=0, top_p=1.0, min_p=1.0, seed=6) == greedy


def test_repetition_penalty_changes_the_answer_as_on_chat(server: LiveServer) -> None:
    plain = response_answer(server, temperature=0.0)
    penalised = response_answer(server, temperature=0.0, repetition_penalty=2.0)
    assert penalised != plain
    assert penalised == chat_answer(server, temperature=0.0, repetition_penalty=2.0)


@pytest.mark.parametrize(("field", "value"), [("top_k", -2), ("top_k", 1.5), ("min_p", 1.5), ("min_p", -0.1),
                                              ("repetition_penalty", 0), ("repetition_penalty", 2.5),
                                              ("seed", 2**63), ("seed", "seven")])
def test_the_sampling_fields_are_checked_as_chat_checks_them(server: LiveServer, field: str, value: Any) -> None:
    responses = post(server, "/v1/responses", {"model": MODEL, "input": "hi", field: value})
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, field: value})
    assert responses.status_code == chat.status_code == 400, (responses.text, chat.text)
    assert responses.json()["error"]["param"] == chat.json()["error"]["param"] == field
    assert responses.json()["error"]["message"] == chat.json()["error"]["message"]


def test_the_openai_sdk_sends_them_as_extra_body(server: LiveServer) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=TOKENS, temperature=1.0, top_p=1.0,  # type: ignore[arg-type]
                                store=False, extra_body={"top_k": 1, "seed": 9, "min_p": 0.0, "repetition_penalty": 1.0})
    assert r.output_text == response_answer(server, temperature=0.0)[1]


# ------------------------------------------------------------------ /tokenize with tools


def test_tokenize_with_tools_is_the_prompt_a_chat_with_those_tools_prefills(server: LiveServer,
                                                                           recorded: RecordedPrompts) -> None:
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "You help with the weather."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}},
                   {"chat_template_kwargs": {"enable_thinking": True}}, {}):
        tokenized = post(server, "/tokenize", {"model": MODEL, "messages": conversation, **fields})
        assert tokenized.status_code == 200, tokenized.text
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": conversation, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        assert tuple(tokenized.json()["tokens"]) == recorded.last, fields  # token for token what the engine ran
        assert tokenized.json()["count"] == r.json()["usage"]["prompt_tokens"]
    bare = post(server, "/tokenize", {"messages": conversation}).json()["count"]
    with_tools = post(server, "/tokenize", {"messages": conversation, "tools": TOOLS}).json()["count"]
    assert with_tools > bare  # the declarations are in the prompt


@pytest.mark.parametrize("fields", [
    {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]},
    {"tools": [{"type": "retrieval"}]},
    {"chat_template_kwargs": {"tools": []}},
    {"chat_template_kwargs": {"enable_thinking": "yes"}},
])
def test_tokenize_refuses_what_chat_refuses_naming_the_same_field(server: LiveServer, fields: dict[str, Any]) -> None:
    tokenized = post(server, "/tokenize", {"messages": ASK, **fields})
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 1, **fields})
    assert tokenized.status_code == chat.status_code == 400, (tokenized.text, chat.text)
    assert tokenized.json()["error"]["param"] == chat.json()["error"]["param"]
    assert tokenized.json()["error"]["message"] == chat.json()["error"]["message"]


@pytest.mark.parametrize("field", ["tools", "chat_template_kwargs"])
def test_tokenize_takes_tools_and_template_variables_only_with_messages(server: LiveServer, field: str) -> None:
    value = TOOLS if field == "tools" else {"enable_thinking": True}
    r = post(server, "/tokenize", {"prompt": "Hello", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_tokenize_tools_on_a_model_without_a_tool_format_is_a_400() -> None:
    with live_server(settings()) as plain:  # the demo host's plain protocol
        r = post(plain, "/tokenize", {"messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


# ------------------------------------------------------------------ model names


def test_v1_models_shows_the_first_name_and_answers_for_every_alias(server: LiveServer) -> None:
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in listed] == [MODEL]
    for name in (MODEL, *ALIASES):
        card = httpx.get(f"{server.url}/v1/models/{name}", timeout=10)
        assert card.status_code == 200, card.text
        assert card.json()["id"] == name and card.json()["root"] == MODEL
    missing = httpx.get(f"{server.url}/v1/models/claude-opus-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_every_route_that_takes_a_model_takes_every_alias_and_answers_with_the_first(server: LiveServer) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for alias in ALIASES:
        chat = client.chat.completions.create(model=alias, messages=ASK, max_tokens=2)  # type: ignore[arg-type]
        assert chat.model == MODEL
        completion = client.completions.create(model=alias, prompt="Hello", max_tokens=2)
        assert completion.model == MODEL
        response = client.responses.create(model=alias, input="Hello", max_output_tokens=2, store=False)
        assert response.model == MODEL
        assert post(server, "/tokenize", {"model": alias, "prompt": "Hello"}).status_code == 200
        assert post(server, "/detokenize", {"model": alias, "tokens": [2]}).status_code == 200
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/responses", {"input": "Hi"}), ("/tokenize", {"prompt": "Hi"}),
                       ("/detokenize", {"tokens": [2]})):
        r = post(server, path, {"model": "claude-opus-4", "max_tokens": 1, **body} if path.startswith("/v1/c")
                 else {"model": "claude-opus-4", **body})
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert all(f"`{name}`" in error["message"] for name in (MODEL, *ALIASES)), error["message"]


@pytest.mark.parametrize(("value", "why"), [("a,,b", "an empty name"), ("a,", "an empty name"), (" ", "an empty name"),
                                            ("a,b,a", "'a' is given twice"), ("a, a", "'a' is given twice")])
def test_an_empty_or_repeated_name_stops_the_start(value: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=why):
        Settings(served_model_name=value)
    assert main(["serve"], {"SERVED_MODEL_NAME": value}) == 2  # before the port is bound or a file read
    assert f"error: SERVED_MODEL_NAME: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse names the flag
        main(["serve", "--served-model-name", value])
    assert "--served-model-name" in capsys.readouterr().err


def test_names_are_trimmed_and_the_first_is_the_id() -> None:
    assert served_names("gemma-4, claude-sonnet-4-5 ,claude-haiku-4-5") == ("gemma-4", "claude-sonnet-4-5",
                                                                              "claude-haiku-4-5")
    assert served_names("gemma-4") == ("gemma-4",)
