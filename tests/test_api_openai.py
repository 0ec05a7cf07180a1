"""The OpenAI-compatible routes through the official `openai` client (and raw httpx where the client would not
send the request), against a live uvicorn server: the real app, the real engine, the real Gemma tokenizer and
chat template, and the null graph (fixed logits favouring " a", so greedy text is " a a a ...").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.support.api_fixtures import API_KEY, LiveServer, live_server, null_host, settings

MODEL = "gemma-test"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(settings()) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: LiveServer, path: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ chat


def test_chat_non_stream_stops_at_exactly_max_tokens(client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=7, temperature=0, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content == " a" * 7
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 7
    assert all(e.token == " a" and e.bytes == [32, 97] and e.logprob < 0 for e in entries)
    assert [len(e.top_logprobs) for e in entries] == [3] * 7
    assert entries[0].top_logprobs[0].token == " a"
    assert entries[0].top_logprobs[0].logprob == pytest.approx(entries[0].logprob)


def test_chat_prompt_uses_the_chat_template_without_a_second_bos(server: LiveServer, client: OpenAI) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(server.host.artifacts.cfg)  # the reference, not our own
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert expected.count(tokenizer.bos_token_id) == 1
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.usage is not None and r.usage.prompt_tokens == len(expected)
    # /tokenize of the same messages agrees, token for token
    tokens = post(server, "/tokenize", {"messages": messages}).json()
    assert tokens["tokens"] == expected and tokens["count"] == len(expected) and tokens["max_model_len"] == 1024


def test_chat_stream_chunks_and_usage(client: OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    first, *middle, final, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in middle)
    assert "".join(c.choices[0].delta.content or "" for c in middle) == whole.choices[0].message.content
    assert final.choices[0].finish_reason == "length" and not final.choices[0].delta.content
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 6 and usage.usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]


def test_chat_stream_without_include_usage_has_no_usage_chunk(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_text_parts_are_joined_and_other_parts_are_rejected(client: OpenAI) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    a = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=1)  # type: ignore[misc,list-item]
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello\nthere"}], max_tokens=1)
    assert a.usage is not None and b.usage is not None and a.usage.prompt_tokens == b.usage.prompt_tokens
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": image}])  # type: ignore[misc,list-item]
    assert "text-only model" in caught.value.message and caught.value.body["param"] == "messages[0].content"  # type: ignore[index]


def test_stop_strings_end_with_stop_and_are_never_emitted(client: OpenAI) -> None:
    # the null graph writes " a a a ...": the first "a a" starts at index 1
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, temperature=0, stop=["a a", "zzz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == " "
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0, stop="a a a",
                                       stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == " " and chunks[-1].choices[0].finish_reason == "stop"  # " a" deltas were held back, then cut
    # a stop string that never matches: the whole budget, finish "length"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=0, stop=["b"])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == " a" * 4


def test_max_completion_tokens_wins_over_max_tokens(client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, max_completion_tokens=3, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_seeded_sampling_is_reproducible(client: OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=1.0, seed=seed,
                                      extra_body={"top_k": 50})
        return r.choices[0].text

    assert run(7) == run(7)


# ------------------------------------------------------------------------------------------ completions


def test_completions_non_stream_echo_and_bos(server: LiveServer, client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].text == "Hello" + " a" * 4 and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == 2  # <bos> Hello: special tokens added, as vLLM does
    # a list of one string is the same prompt; a list of token ids is taken as is
    again = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=1)
    ids = client.completions.create(model=MODEL, prompt=[2, 9259], max_tokens=1)
    assert again.usage.prompt_tokens == ids.usage.prompt_tokens == 2  # type: ignore[union-attr]


def test_completions_stream_echo_and_usage(client: OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].text == "Hello"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello a a a"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_completions_legacy_logprobs(client: OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == [" a"] * 4
    assert lp.text_offset == [0, 2, 4, 6]
    assert lp.token_logprobs is not None and len(lp.token_logprobs) == 4
    assert lp.top_logprobs is not None and all(len(t) == 2 and " a" in t for t in lp.top_logprobs)
    zero = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{" a": zero.choices[0].logprobs.token_logprobs[0]}] * 2  # type: ignore[union-attr,index]


# ------------------------------------------------------------------------------------------ n > 1, prompt lists


def test_chat_n_choices_and_usage(client: OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == " a" * 3 and c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and one.usage is not None
    # the prompt is counted once, every choice's completion
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (one.usage.prompt_tokens, 9)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 9


def test_chat_n_streamed_by_index(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0, n=2,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, usage = chunks
    assert all(len(c.choices) == 1 for c in body) and len({c.id for c in chunks}) == 1
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in body:
        choice = c.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: " a a", 1: " a a"} and finishes == {0: "length", 1: "length"}
    assert [c.choices[0].delta.role for c in body[:2]] == ["assistant", "assistant"]  # each choice opens with its role
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 4


def test_completions_prompt_list_times_n(client: OpenAI) -> None:
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0) for p in ("Hello", "Hi")]
    r = client.completions.create(model=MODEL, prompt=["Hello", "Hi"], n=2, max_tokens=2, temperature=0, echo=True)
    # OpenAI's order: the choices of prompt 0, then of prompt 1
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["Hello a a", "Hello a a", "Hi a a", "Hi a a"]
    assert r.usage is not None
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)  # type: ignore[union-attr]
    assert r.usage.completion_tokens == 8
    ids = client.completions.create(model=MODEL, prompt=[[2, 9259], [2, 9259, 9259]], max_tokens=1, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage is not None and ids.usage.prompt_tokens == 5
    streamed = list(client.completions.create(model=MODEL, prompt=["Hello", "Hi"], max_tokens=2, temperature=0,
                                              stream=True))
    texts: dict[int, str] = {}
    for c in streamed:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {0: " a a", 1: " a a"}


def test_choices_are_bounded(server: LiveServer) -> None:
    limit = server.settings.max_n
    for path, body, param in [
        ("/v1/chat/completions", {"messages": HI, "n": limit + 1}, "n"),
        ("/v1/completions", {"prompt": "x", "n": limit + 1}, "n"),
        ("/v1/completions", {"prompt": ["x"] * (limit // 2 + 1), "n": 2}, "prompt"),
    ]:
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "--max-n" in r.json()["error"]["message"]
    refused = post(server, "/v1/completions", {"prompt": "x", "best_of": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"


def test_no_max_tokens_means_the_rest_of_the_context(client: OpenAI) -> None:
    prompt = [2] + [9259] * 1020  # 1021 tokens of a 1024 context
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    # a larger max_tokens is capped by the context, not rejected
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=500)
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_context_length_exceeded(client: OpenAI) -> None:
    ok = client.completions.create(model=MODEL, prompt=[2] + [9259] * 1022, max_tokens=5)  # 1023 = max_total - 1
    assert ok.usage is not None and ok.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[2] + [9259] * 1023, max_tokens=5)
    body = caught.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    assert "1024" in body["message"] and "1024 tokens" in body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a " * 1100}])
    assert caught.value.body["code"] == "context_length_exceeded"  # type: ignore[index]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"262144": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 150}}, "logit_bias.5"),
        ({"seed": 2**63}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        # A tool message needs the call it answers; user/system messages need content (issue 15).
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "system", "content": None}, *HI]}, "messages[0].content"),
        # No silent drops: a field that would change the output is implemented or refused, naming it.
        ({"suffix": "x"}, "suffix"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"some_vendor_knob": 1}, "some_vendor_knob"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        # The demo (Gemma-3) has no native tool-call format.
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
        ({"messages": [*HI, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[1]"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(server: LiveServer, fields: dict[str, object], param: str) -> None:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param.split(".")[0] in error["message"]


def test_errors_raise_the_right_openai_exceptions(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HI, temperature=3)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=HI)
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["one", [2, 3]])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", logprobs=6)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=9)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "gemma-test", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        b'{"model": "gemma-test", "messages": [{"role": "user", "content": "Hi"}], "top_p": Infinity}',
        b'{"model": "gemma-test", "messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}',
        b'{"model": "gemma-test", "messages": [{"role": "user", "content": "Hi',
        b'{"model": "gemma-test", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        b"[1, 2, 3]",
        b"",
    ],
)
def test_malformed_bodies_are_400(server: LiveServer, raw: bytes) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_fields_that_change_nothing_are_ignored_and_model_is_optional(server: LiveServer, client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, user="someone", store=False,
                                       metadata={"k": "v"}, service_tier="auto",
                                       extra_body={"prompt_cache_key": "x", "safety_identifier": "y"})
    assert r.choices[0].finish_reason == "length"
    body = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "temperature": None}).json()
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] == 1


def test_ignore_eos_and_min_tokens_are_implemented(server: LiveServer) -> None:
    # The null graph greedily repeats one token; with logit_bias pushing eos to the top, only ignore_eos / min_tokens
    # keep it going.
    eos = {"1": 100}
    stopped = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "temperature": 0,
                                                   "logit_bias": eos}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    ignored = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 5, "temperature": 0,
                                                   "logit_bias": eos, "ignore_eos": True}).json()
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 5
    held = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 9, "temperature": 0, "logit_bias": eos,
                                           "min_tokens": 3}).json()
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 4


def test_legacy_completions_refuse_suffix(server: LiveServer) -> None:
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "suffix": "y"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_unknown_route_and_wrong_method(server: LiveServer) -> None:
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"] and r.json()["error"]["code"] == "method_not_allowed"


def test_request_id_is_honoured_and_echoed(server: LiveServer, client: OpenAI) -> None:
    r = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"].startswith("chatcmpl-")
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    generated = r.headers["x-request-id"]
    assert len(generated) >= 16 and r.json()["id"] == f"cmpl-{generated}"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=1,
                                                           extra_headers={"X-Request-Id": "from-openai"})
    assert raw.headers["x-request-id"] == "from-openai"


def test_completion_ids_are_unique_when_the_client_reuses_its_request_id(server: LiveServer) -> None:
    """Issue 15: the id was `chatcmpl-<X-Request-Id>`, so a client reusing one value got duplicate completion ids."""
    ids = []
    for path, body in [("/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 1})]:
        r = post(server, path, body, headers={"X-Request-Id": "same-id"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "same-id"  # still echoed
        ids.append(r.json()["id"])
    assert len(set(ids)) == 4 and all("same-id" not in i for i in ids), ids


# ------------------------------------------------------------------------------------------ other routes


def test_models(client: OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve(MODEL).id == MODEL


def test_tokenize_and_detokenize(server: LiveServer) -> None:
    r = post(server, "/tokenize", {"prompt": "Hello"}).json()
    assert r == {"tokens": [2, 9259], "count": 2, "max_model_len": 1024}
    assert post(server, "/tokenize", {"prompt": "Hello", "add_special_tokens": False}).json()["tokens"] == [9259]
    assert post(server, "/detokenize", {"tokens": [2, 9259]}).json() == {"prompt": "<bos>Hello"}
    assert post(server, "/detokenize", {"tokens": [9259]}).json() == {"prompt": "Hello"}
    assert post(server, "/detokenize", {"tokens": [262144]}).status_code == 400
    assert post(server, "/tokenize", {}).status_code == 400
    assert post(server, "/tokenize", {"prompt": "x", "model": "other"}).status_code == 404


def test_generate_route(server: LiveServer) -> None:
    r = post(server, "/generate", {"prompt": "Hi", "max_new_tokens": 5})
    assert r.status_code == 200
    body = r.json()
    assert body == {"prompt": "Hi", "response": " a" * 5, "prompt_tokens": 10, "gen_tokens": 5,
                    "finish_reason": "length"}
    assert post(server, "/generate", {"prompt": "Hi", "max_new_tokens": 0}).status_code == 400


def test_model_generation_defaults_fill_unset_fields() -> None:
    """Unset sampling fields take generation_config.json's values: a model that asks for greedy gets greedy."""
    host = null_host()
    greedy_host = dataclasses.replace(host, structure=dataclasses.replace(
        host.structure, generation_defaults={"temperature": 0.0}))
    with live_server(settings(), host=greedy_host) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12)
        assert r.choices[0].text == " a" * 12
        # an explicit field still wins: at temperature 2 over the top 40, " a" has p < 0.3 per token
        sampled = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, temperature=2, seed=3,
                                            extra_body={"top_k": 40})
        assert sampled.choices[0].text != " a" * 12


def test_metrics(server: LiveServer, client: OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['gemma4_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert samples["gemma4_generation_tokens_total"] >= 3 and samples["gemma4_prompt_tokens_total"] >= 10
    assert samples["gemma4_time_to_first_token_seconds_count"] >= 1
    assert samples["gemma4_inter_token_latency_seconds_count"] >= 2
    assert samples["gemma4_e2e_request_latency_seconds_count"] >= 1
    assert samples["gemma4_queue_wait_seconds_count"] >= 1
    assert samples["gemma4_queue_depth"] == 0 and samples["gemma4_requests_running"] == 0
    assert "gemma4_prefix_cache_hit_tokens_total" in samples
    assert samples['gemma4_requests_finished_total{reason="length"}'] >= 1


def test_body_too_large_is_413() -> None:
    with live_server(settings(max_body_bytes=2000)) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="x" * 3000, max_tokens=1)
        assert caught.value.status_code == 413 and caught.value.body["code"] == "request_too_large"  # type: ignore[index]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is what counts
            yield b'{"model": "gemma-test", "prompt": "'
            for _ in range(10):
                yield b"y" * 300
            yield b'", "max_tokens": 1}'

        r = httpx.post(f"{live.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
        assert client.completions.create(model=MODEL, prompt="x" * 1000, max_tokens=1).usage is not None


def test_api_key() -> None:
    with live_server(settings(api_key=API_KEY)) as live:
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError) as caught:
                OpenAI(base_url=f"{live.url}/v1", api_key=key or "x", max_retries=0).models.list()
            assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        good = OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).usage is not None
        assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"X-Api-Key": API_KEY})
        assert r.status_code == 200
        assert httpx.post(f"{live.url}/generate", json={"prompt": "x"}).status_code == 401
        assert httpx.post(f"{live.url}/tokenize", json={"prompt": "x"}).status_code == 401
        # health and metrics stay open
        assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
        assert httpx.get(f"{live.url}/metrics").status_code == 200



def test_chat_stream_logprobs_ride_with_their_tokens(client: OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0, stream=True,
                                                 logprobs=True, top_logprobs=2))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 3
    for c in content:
        lp = c.choices[0].logprobs
        assert lp is not None and lp.content is not None and len(lp.content) == 1
        assert lp.content[0].token == c.choices[0].delta.content and len(lp.content[0].top_logprobs) == 2
