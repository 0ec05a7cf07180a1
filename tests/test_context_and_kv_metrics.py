"""What clients and a prefix-aware router read (issue 34): the build's context on every model card (`max_model_len`,
vLLM's key, and `context_length`, OpenRouter's / llama.cpp's) through the official `openai` client, and the KV gauges
in `/metrics` (slots and positions in use and their share, the prefixes idle slots keep for reuse), scraped from a
live server on the real engine while a request runs and after it ends."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest
from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from server.app.runtime import load_host
from server.errors import ArtifactError
from tests.support.api_fixtures import LiveServer, live_server, null_host, settings
from tests.support.models import demo_dir
from tests.support.wait import wait_for_value

MODEL = "gemma-test"


def scrape(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("gemma4_kv_")}


def test_model_cards_report_the_builds_context() -> None:
    host = null_host()
    wider = dataclasses.replace(host, spec=dataclasses.replace(host.spec, max_total=2048))  # not the export's 1024
    with live_server(settings(), host=wider) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        (card,) = client.models.list().data
        one = client.models.retrieve(MODEL)
        tokens = httpx.post(f"{live.url}/tokenize", json={"prompt": "Hello"}, timeout=10).json()
    for extra in (card.model_extra, one.model_extra):
        assert extra is not None and extra["max_model_len"] == extra["context_length"] == 2048
    assert tokens["max_model_len"] == 2048


def test_max_model_len_caps_the_context_below_the_builds() -> None:
    """--max-model-len (vLLM's flag) is the context every route holds requests to: the card reports it, a prompt past
    it is refused with the overflow error agents act on, and an unbounded completion ends at it."""
    capped = settings(max_model_len=64)
    host = load_host(demo_dir(), "null", "gemma-test", settings=capped)
    assert host.spec.max_total == 1024 and host.max_total == 64
    with live_server(capped, host=host) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        (card,) = client.models.list().data
        assert card.model_extra is not None and card.model_extra["max_model_len"] == 64
        prompt = "The quick brown fox jumps over the lazy dog."
        prompt_tokens = len(host.tokenizer.encode(prompt))
        done = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
        assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
        assert done.usage.completion_tokens == 64 - prompt_tokens and done.choices[0].finish_reason == "length"
        with pytest.raises(BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=prompt * 12, max_tokens=1)
        assert refused.value.code == "context_length_exceeded" and "maximum context length is 64" in str(refused.value)


def test_max_model_len_past_the_builds_context_is_refused_at_start_up() -> None:
    with pytest.raises(ArtifactError, match="--max-model-len 4096: this build's context is 1024 tokens"):
        load_host(demo_dir(), "null", "gemma-test", settings=settings(max_model_len=4096))


@pytest.fixture(scope="module")
def slow_server() -> Iterator[LiveServer]:
    # 10 ms a graph call: a 200-token answer runs long enough to be scraped mid-way, whatever the machine's load.
    with live_server(settings(null_step_ms=10.0)) as live:
        yield live


def test_kv_gauges_follow_a_request_and_the_prefix_it_leaves(slow_server: LiveServer) -> None:
    live = slow_server
    idle = scrape(live)
    slots, capacity = live.engine.capacity, live.engine.capacity * live.host.max_total
    assert idle == {"gemma4_kv_slots_in_use": 0, "gemma4_kv_slots_in_use_ratio": 0, "gemma4_kv_tokens_in_use": 0,
                    "gemma4_kv_tokens_capacity": capacity, "gemma4_kv_tokens_in_use_ratio": 0,
                    "gemma4_kv_cached_prefixes": 0, "gemma4_kv_cached_prefix_tokens": 0,
                    "gemma4_kv_blocks_in_use": 0, "gemma4_kv_blocks_capacity": 0}  # no pool: KV per slot
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    prompt_tokens = len(live.host.tokenizer.encode(prompt))
    body = {"prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs: its prompt is in the slot
        running = wait_for_value(lambda: scrape(live), lambda m: m["gemma4_kv_tokens_in_use"] > prompt_tokens,
                                 "the running request's KV to grow past its prompt")
        assert running["gemma4_kv_slots_in_use"] == 1 and running["gemma4_kv_slots_in_use_ratio"] == 1 / slots
        assert running["gemma4_kv_tokens_in_use"] < prompt_tokens + 200
        assert running["gemma4_kv_tokens_in_use_ratio"] == running["gemma4_kv_tokens_in_use"] / capacity
        assert running["gemma4_kv_cached_prefixes"] == 0
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    done = wait_for_value(lambda: scrape(live), lambda m: m["gemma4_kv_slots_in_use"] == 0, "the slot to be freed")
    # The idle slot keeps the whole conversation but the last token (sampled, never fed back): a next turn's prefix.
    assert done["gemma4_kv_tokens_in_use"] == 0 and done["gemma4_kv_cached_prefixes"] == 1
    assert done["gemma4_kv_cached_prefix_tokens"] == prompt_tokens + 200 - 1
    assert live.engine.kv_usage.cached_tokens == done["gemma4_kv_cached_prefix_tokens"]


def test_each_kv_gauge_is_documented(slow_server: LiveServer) -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    for name in scrape(slow_server):
        assert name in docs, f"{name} is exported but docs/operations.md does not say what it is"


def test_a_kv_pool_caps_the_context_and_its_gauges_count_blocks() -> None:
    """The null graph with a v4 pool (--null-kv-blocks 9 --null-block-size 16: 8 lendable blocks, 128 positions):
    the card reports the pool's reach as the context, a longer prompt is the overflow error agents act on (before any
    work), and once two streams end every lent block is an idle slot's prefix, as /metrics says."""
    pooled = settings(null_kv_blocks=9, null_block_size=16)
    host = load_host(demo_dir(), "null", "gemma-test", settings=pooled)
    assert host.spec.max_total == 1024 and host.max_total == 128
    with live_server(pooled, host=host) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        (card,) = client.models.list().data
        assert card.model_extra is not None and card.model_extra["context_length"] == 128
        with pytest.raises(BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="The quick brown fox. " * 40, max_tokens=1)
        assert refused.value.code == "context_length_exceeded" and "maximum context length is 128" in str(refused.value)
        idle = scrape(live)
        assert (idle["gemma4_kv_blocks_capacity"], idle["gemma4_kv_blocks_in_use"]) == (8, 0)
        assert idle["gemma4_kv_tokens_capacity"] == 128
        prompt = "The quick brown fox jumps over the lazy dog. " * 4
        for _ in range(2):  # two conversations of ~100 positions each: the second evicts the first's blocks
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, extra_body={"ignore_eos": True})
            assert done.usage is not None and done.usage.completion_tokens == 60
            prompt = "A different opening line, then the same dog. " * 4
        after = wait_for_value(lambda: scrape(live), lambda m: m["gemma4_kv_slots_in_use"] == 0, "the slots freed")
        pool = live.engine.core.scheduler.pool
        assert pool is not None and after["gemma4_kv_blocks_in_use"] == pool.in_use > 0
        held = sum(pool.held(slot.index) for slot in live.engine.core.scheduler.slots.free)
        assert pool.in_use == held and after["gemma4_kv_tokens_in_use"] == 0
