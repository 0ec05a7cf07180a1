"""Real answers: the Gemma-3 270M (the `hf` graph on CPU) behind the live server.

Greedy decoding is deterministic, so the API must give exactly what the engine gives for the same tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from server.app.runtime import build_engine
from server.engine.types import Completion, GenerationRequest
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import LiveServer, hf_host, live_server, metric, settings

MODEL = "gemma-test"
QUESTION = "Question: What is the capital of France?\nAnswer:"


@pytest.fixture(scope="module")
def real() -> Iterator[LiveServer]:
    host = hf_host()
    config = settings(graph="hf", lazy_grammar=False)  # the default: the grammar vocabulary starts with the server
    with live_server(config, build_engine(host, config), host) as live:
        assert live.app.state.grammar.started  # before any request asked for it
        live.app.state.grammar.wait(600)  # the grammar vocabulary (structured output), built once, up front
        yield live


@pytest.fixture(scope="module")
def client(real: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_completion_knows_paris(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, temperature=0)
    assert "Paris" in r.choices[0].text, r.choices[0].text


def test_chat_through_the_api_equals_the_engine_directly(real: LiveServer, client: OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    api_text = r.choices[0].message.content

    tokenizer = real.host.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # type: ignore[arg-type]
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))

    async def direct() -> Completion:
        return await real.engine.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=6,
                                                                     sampling=SamplingParams(temperature=0.0))).result()

    completion = asyncio.run(direct())
    engine_text, finish = completion.text, completion.finish
    assert api_text == engine_text and r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (finish.prompt_tokens, finish.completion_tokens)
    # and streaming gives the same text too
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == engine_text


def test_n_seeded_choices_differ_and_run_no_second_prefill(real: LiveServer, client: OpenAI) -> None:
    """n=3 at temperature 1 with a seed: three different answers, the same three again for the same seed, and the
    prompt prefilled once (the server's own counters: choices 2..n reused the whole prompt)."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a word."}]
    fields = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 1.0, "seed": 42, "n": 3,
              "extra_body": {"ignore_eos": True}}
    calls, reused = metric(real.url, "gemma4_graph_calls_total"), metric(real.url, "gemma4_prefix_cache_hit_tokens_total")
    r = client.chat.completions.create(**fields)  # type: ignore[call-overload]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3, texts
    assert r.usage is not None and r.usage.completion_tokens == 15
    prompt = r.usage.prompt_tokens
    assert prompt <= real.host.spec.prefill_bucket  # the first choice's prefill is one call
    # Side by side (issue 35): 1 prefill call, its slot copied into choices 2 and 3, then 4 decode steps of the three
    # rows together (the 5th token is never fed back). The counter counts a batched step once for each of its rows.
    assert metric(real.url, "gemma4_graph_calls_total") - calls == 1 + 3 * 4
    assert metric(real.url, "gemma4_prefix_cache_hit_tokens_total") - reused >= 2 * prompt
    again = client.chat.completions.create(**fields)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == texts


def test_stop_string_on_real_text(client: OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, temperature=0).choices[0].text
    stop = "Paris"
    assert stop in full
    expected = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=4, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_generate_route_is_greedy_chat(real: LiveServer, client: OpenAI) -> None:
    body = httpx.post(f"{real.url}/generate", json={"prompt": "Name three colours.", "max_new_tokens": 6},
                      timeout=120).json()
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "Name three colours."}])
    assert body["response"] == chat.choices[0].message.content and body["response"]
    assert body["finish_reason"] == chat.choices[0].finish_reason
    assert body["gen_tokens"] == chat.usage.completion_tokens  # type: ignore[union-attr]


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 40}}}
EXTRACTIONS = [
    "Alice is 31 years old and lives in Lisbon.",
    "Meet Bob, a 45-year-old carpenter from Oslo.",
    "Chen (age 27) moved to Toronto last spring.",
    "The 62-year-old Maria has always lived in Naples.",
    "Kwame, 19, studies in Accra.",
]


@pytest.mark.parametrize("text", EXTRACTIONS)
def test_structured_output_extraction_validates(client: OpenAI, text: str) -> None:
    """The real 270M, greedy, with a JSON schema: every answer parses and validates (the mask enforces it)."""
    import json

    import jsonschema

    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": f"Extract the person's name, age and city as JSON.\n\n{text}"}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), PERSON)


def test_tools_on_the_demo_model_are_a_clear_400(client: OpenAI) -> None:
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       tools=[tool])  # type: ignore[list-item]
    assert refused.value.body["param"] == "tools" and "no native tool-call format" in refused.value.body["message"]  # type: ignore[index]
