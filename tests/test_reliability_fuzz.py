"""Property-based fuzzing of the request bodies: arbitrary JSON values under the real field names (and raw bytes)
never give a 500.

In-process against `http.parse` (every failure is an `APIError` 400, and what passes is what the routes rely
on), then through the whole app on a live server (status < 500, OpenAI's error JSON, streams end with
`[DONE]` and no in-band error). Derandomized and bounded: the same ~3,000 examples every run, ~20 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from server.api.http import parse
from server.api.schemas import (
    MAX_STOPS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from server.errors import APIError
from tests.support.api_fixtures import LiveServer, live_server, settings

_FUZZ = hsettings(derandomize=True, database=None, deadline=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(examples: int) -> hsettings:
    return hsettings(_FUZZ, max_examples=examples)

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def either(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly values of the right shape near the limits, sometimes any JSON value at all."""
    return st.one_of(plausible, plausible, json_values)


small_ints = st.integers(-3, 8)
numbers = st.one_of(st.floats(-5, 5), st.integers(-3, 3), st.sampled_from([0, 1, 2, 1e-9, 1e308, -1e308]))
# Keys that look like token ids to str.isdigit() but not to int() ("²", "٣"), padded, long, or very long.
digits_like = st.text(st.characters(categories=["Nd", "No"]), min_size=1, max_size=3)
token_keys = st.one_of(st.integers(-5, 300_000).map(str), digits_like, st.text(max_size=4),
                       st.integers(0, 5000).map(lambda n: " 1" + "0" * n + " "))
part = st.fixed_dictionaries({"type": either(st.sampled_from(["text", "image_url", "input_audio", "file"])),
                              "text": either(st.text(max_size=10))})
message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", ""]))},
    optional={"content": either(st.text(max_size=20) | st.lists(part, max_size=2)), "name": json_values})
token_ids = st.lists(st.integers(-2, 270_000), max_size=5)

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": either(st.sampled_from(["gemma-test", "other", "../../etc/passwd", ""])),
    "max_tokens": either(small_ints),
    "max_completion_tokens": either(small_ints),
    "temperature": either(numbers),
    "top_p": either(numbers),
    "top_k": either(st.integers(-3, 300_000)),
    "min_p": either(numbers),
    "seed": either(st.integers(-(2**64), 2**64)),
    "stop": either(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=MAX_STOPS + 2)),
    "presence_penalty": either(numbers),
    "frequency_penalty": either(numbers),
    "repetition_penalty": either(numbers),
    "logit_bias": either(st.dictionaries(token_keys, st.floats(-100, 100), min_size=1, max_size=2)
                         | st.dictionaries(st.integers(0, 262_143).map(str), either(st.floats(-200, 200)), max_size=3)),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({}, optional={"include_usage": either(st.booleans())})),
    "n": either(small_ints),
    "user": json_values,
}
FIELDS: dict[type, dict[str, st.SearchStrategy[Any]]] = {
    ChatCompletionRequest: {**SAMPLING, "messages": either(st.lists(message, max_size=3)),
                            "logprobs": either(st.booleans() | small_ints), "top_logprobs": either(st.integers(-1, 22))},
    CompletionRequest: {**SAMPLING, "prompt": either(st.text(max_size=20) | token_ids | st.lists(st.text(max_size=5),
                                                                                                max_size=2)),
                        "echo": either(st.booleans()), "logprobs": either(st.integers(-1, 7)),
                        "best_of": either(small_ints)},
    GenerateRequest: {"prompt": either(st.text(max_size=20)), "max_new_tokens": either(small_ints)},
    TokenizeRequest: {"model": SAMPLING["model"], "prompt": either(st.text(max_size=20)),
                      "messages": either(st.lists(message, max_size=3)), "add_special_tokens": either(st.booleans()),
                      "add_generation_prompt": either(st.booleans())},
    DetokenizeRequest: {"model": SAMPLING["model"], "tokens": either(token_ids)},
}
ROUTES = {ChatCompletionRequest: "/v1/chat/completions", CompletionRequest: "/v1/completions",
          GenerateRequest: "/generate", TokenizeRequest: "/tokenize", DetokenizeRequest: "/detokenize"}

# Valid values of every field (so generation runs), for bodies where at most one field goes wild.
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                       "content": st.text(max_size=20) | st.lists(
                                           st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                                           min_size=1, max_size=2)})
unit = st.floats(0, 1)
VALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("gemma-test"),
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(1e-6, 1),
    "top_k": st.integers(-1, 300_000),
    "min_p": unit,
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=MAX_STOPS),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-3, 2),
    "logit_bias": st.dictionaries(st.integers(0, 262_143).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 2),
}
VALID: dict[type, tuple[dict[str, st.SearchStrategy[Any]], dict[str, st.SearchStrategy[Any]]]] = {  # required, optional
    ChatCompletionRequest: ({"messages": st.lists(valid_message, min_size=1, max_size=3)},
                            {**VALID_SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}),
    CompletionRequest: ({"prompt": st.text(max_size=20) | st.lists(st.integers(0, 262_143), min_size=1, max_size=5)},
                        {**VALID_SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 5), "best_of": st.just(1)}),
    GenerateRequest: ({"prompt": st.text(max_size=20)}, {"max_new_tokens": st.integers(1, 6)}),
    TokenizeRequest: ({"prompt": st.text(max_size=20)}, {"add_special_tokens": st.booleans()}),
    DetokenizeRequest: ({"tokens": st.lists(st.integers(0, 262_143), max_size=5)}, {"model": st.just("gemma-test")}),
}


def near_valid(model: type) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body, or one with one field (any of the model's) replaced by a wild value."""
    required, optional = VALID[model]
    valid = st.fixed_dictionaries(required, optional=optional)
    wild = st.sampled_from(sorted(FIELDS[model])).flatmap(lambda key: st.tuples(st.just(key), FIELDS[model][key]))
    return st.builds(lambda body, change: {**body, **dict([change])} if change else body, valid, st.none() | wild)


def bodies(model: type) -> st.SearchStrategy[Any]:
    """Objects with the model's real field names and random values, near-valid ones, and sometimes not an object."""
    objects = st.fixed_dictionaries({}, optional=FIELDS[model])
    return st.one_of(objects, near_valid(model), near_valid(model), json_values)


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity are written as JSON5-ish literals: the parser must cope


def check_parsed(parsed: Any) -> None:
    """What the routes do with a validated body, without a server: none of it may raise."""
    if isinstance(parsed, ChatCompletionRequest | CompletionRequest):
        assert all(0 <= int(key) < 10**18 for key in parsed.logit_bias or {})
        assert len(parsed.stop) <= MAX_STOPS and all(parsed.stop)
        # 0 only on completions with echo (the prompt alone, vLLM's)
        assert parsed.token_limit is None or parsed.token_limit >= 1 or (isinstance(parsed, CompletionRequest)
                                                                          and parsed.echo)
        json.dumps(parsed.model_dump(), allow_nan=False)  # nothing non-finite got through


def assert_parse_total(model: type, raw: bytes) -> None:
    try:
        parsed = parse(model, raw)
    except APIError as exc:
        assert exc.status == 400 and exc.message, exc
        assert set(exc.to_json()["error"]) == {"message", "type", "param", "code"}
        return
    check_parsed(parsed)


@pytest.mark.parametrize("model", list(FIELDS), ids=lambda m: m.__name__)
def test_parse_maps_every_json_body_to_a_model_or_a_400(model: type) -> None:
    @fuzz(100)
    @given(body=bodies(model))
    def run(body: Any) -> None:
        assert_parse_total(model, encode(body))

    run()


FIELD_CASES = [(model, name) for model in FIELDS for name in sorted(FIELDS[model])]


@pytest.mark.parametrize(("model", "name"), FIELD_CASES, ids=[f"{m.__name__}.{n}" for m, n in FIELD_CASES])
def test_one_wild_field_on_a_valid_body_parses_or_is_a_400(model: type, name: str) -> None:
    required, optional = VALID[model]

    @fuzz(25)
    @given(body=st.fixed_dictionaries(required, optional=optional), value=FIELDS[model][name])
    def run(body: dict[str, Any], value: Any) -> None:
        assert_parse_total(model, encode({**body, name: value}))

    run()


@fuzz(100)
@given(raw=st.one_of(st.binary(max_size=64), st.builds(lambda b, cut: b[:cut], bodies(ChatCompletionRequest).map(encode),
                                                       st.integers(0, 200))))
def test_parse_maps_any_bytes_to_a_model_or_a_400(raw: bytes) -> None:
    for model in FIELDS:
        assert_parse_total(model, raw)


# ---------------------------------------------------------------------------------------------- through the app


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    # A short wall-clock limit per request bounds every fuzzed generation (max_tokens may be anything).
    with live_server(settings(request_timeout_s=0.1, sse_ping_s=60.0)) as live:
        yield live


def assert_no_server_error(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    assert "Traceback" not in r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text[:500]
        assert r.status_code in (400, 404), r.text[:500]
    elif r.headers["content-type"].startswith("text/event-stream"):
        data = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", r.text[-300:]
        assert not any('"error"' in d[:10] for d in data), r.text[-500:]  # an in-band error is a 500 in disguise
    else:
        assert r.json()


@pytest.mark.parametrize("model", list(ROUTES), ids=lambda m: m.__name__)
def test_fuzzed_bodies_through_the_live_app_never_get_a_5xx(server: LiveServer, model: type) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        @fuzz(40 if model in (ChatCompletionRequest, CompletionRequest) else 25)
        @given(body=bodies(model))
        def run(body: Any) -> None:
            assert_no_server_error(client.post(ROUTES[model], content=encode(body),
                                               headers={"Content-Type": "application/json"}))

        run()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert 'gemma4_errors_total{status="500"}' not in httpx.get(f"{server.url}/metrics").text
