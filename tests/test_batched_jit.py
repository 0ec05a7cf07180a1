"""Continuous batching on the production path: the recipe's `--contract v3` CPU build (4 KV slots, decode batches 1, 2,
4) loaded by `load_host(..., "jit")` and served by the real app and engine (`serve --graph jit`), token for token
against transformers.

- Four greedy streams submitted at once: the scheduler admits each into its own slot, prefills them one chunk at a
  time between decode steps, and decodes them together (batches of 1 to 4 rows, 3 rounded up to the compiled 4);
  each stream equals transformers' `generate()` alone, at the engine (ids) and over HTTP (text).
- The same four beside mixed requests (one seeded sample, one json_schema, one forced tool call, one cancelled half
  way): the greedy ones still equal transformers, the sampled one equals itself run alone, the constrained outputs
  are valid, the cancelled one frees its slot and the rest carry on.

The model is tests/test_recipe_v3.py's tiny Gemma-4 (bf16-rounded table, sliding window 12), with the Gemma-4-format
test tokenizer in its cfg/ (tests/support/gemma4_tokenizer.py) so tool calls and JSON grammars run as in production.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch

from server.app.runtime import Host, build_engine, load_host
from server.engine.engine import Engine
from server.engine.types import GenerationRequest
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import LiveServer, live_server, metric, settings
from tests.support.wait import wait_until
from tests.test_recipe_v3 import BATCHES, SLOTS, checkpoint, expected, prompt_of, reference  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "tiny-gemma4-v3"
GREEDY = SamplingParams(temperature=0.0)
LENGTHS = (9, 40, 23, 70)  # one chunk; 32 + 8 (padded); 32 (padded); 2 x 32 + 8 (padded): each crosses the window
NEW = 20
SCHEMA = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                           "windy": {"type": "boolean"}},
          "required": ["unit", "windy"], "additionalProperties": False}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def artifacts(recipe_v3_artifacts: Path) -> Path:
    return recipe_v3_artifacts  # tests/conftest.py: built once, this build beside its Gemma-4-format tokenizer


@pytest.fixture(scope="module")
def host(artifacts: Path) -> Host:
    return load_host(artifacts, "jit", MODEL)


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[LiveServer]:
    config = settings(artifacts=host.artifacts.root, graph="jit", served_model_name=MODEL, lazy_grammar=False)
    with live_server(config, build_engine(host, config), host) as live:
        live.app.state.grammar.wait(600)  # the grammar vocabulary, before any constrained request
        yield live


def greedy_request(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=NEW, sampling=GREEDY, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [prompt_of(n, seed=60 + i) for i, n in enumerate(LENGTHS)]


def test_four_concurrent_greedy_streams_equal_transformers(server: LiveServer, host: Host,
                                                           reference: torch.nn.Module) -> None:  # noqa: F811
    engine = server.engine
    assert engine.capacity == SLOTS
    before = engine.step_batches

    async def together() -> list[list[int]]:
        handles = [engine.submit(greedy_request(p)) for p in prompts()]
        return [(await handle.result()).token_ids for handle in handles]

    outputs = asyncio.run(together())
    for prompt, ids in zip(prompts(), outputs, strict=True):
        assert ids == expected(reference, prompt, NEW), prompt[:3]
    batches = {rows for rows, calls in engine.step_batches.items() if calls > before.get(rows, 0)}
    assert batches >= {1, 2, 3, 4}, batches  # every batch size ran, 3 on the 4-row graph with a spare row
    assert max(batches) <= max(BATCHES)

    # Over HTTP: /v1/completions streams of token-id prompts, all four at once.
    async def over_http() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return list(await asyncio.gather(*(completion_text(client, p) for p in prompts())))

    texts = asyncio.run(over_http())
    for prompt, text in zip(prompts(), texts, strict=True):
        assert text == host.tokenizer.decode(expected(reference, prompt, NEW), skip_special_tokens=True)
    # What a client and a scraper are told: how many run at once, and the calls by batch size.
    (card,) = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert card["max_concurrency"] == SLOTS
    assert metric(server.url, "gemma4_max_concurrency") == SLOTS
    assert metric(server.url, "gemma4_graph_steps_total", rows="4") == engine.step_batches[4] > 0
    assert metric(server.url, "gemma4_slot_occupancy") == 0.0  # all done


async def completion_text(client: httpx.AsyncClient, prompt: list[int], **fields: Any) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "stream": True,
            **fields}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(choice["text"] for choice in chunk["choices"])
    return text


async def chat(client: httpx.AsyncClient, content: str, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def cancelled_half_way(client: httpx.AsyncClient, engine: Engine, prompt: list[int]) -> int:
    """Stream a long completion, go away after a few chunks; returns the chunks seen."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 6:
                    break  # leaving the block closes the connection: a disconnect mid-stream
    return seen


def test_mixed_requests_beside_four_greedy_streams(server: LiveServer, host: Host,
                                                   reference: torch.nn.Module) -> None:  # noqa: F811
    engine = server.engine
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 1234, "max_tokens": 16, "ignore_eos": True}
    finished_before = dict(engine.step_batches)

    async def mixed() -> tuple[list[str], str, dict[str, Any], dict[str, Any], int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            greedy = asyncio.gather(*(completion_text(client, p) for p in prompts()))
            sample = completion_text(client, prompt_of(15, seed=80), **sampled)
            schema = chat(client, "Weather?", max_tokens=40, temperature=0.7, seed=3,
                          response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
            tool = chat(client, "Time?", max_tokens=40, tools=[TIME],
                        tool_choice={"type": "function", "function": {"name": "get_time"}})
            gone = cancelled_half_way(client, engine, prompt_of(30, seed=81))
            texts, sample_text, schema_choice, tool_choice, seen = await asyncio.gather(greedy, sample, schema, tool, gone)
            return texts, sample_text, schema_choice, tool_choice, seen

    texts, sample_text, schema_choice, tool_choice, seen = asyncio.run(mixed())
    for prompt, text in zip(prompts(), texts, strict=True):
        assert text == host.tokenizer.decode(expected(reference, prompt, NEW), skip_special_tokens=True)
    document = json.loads(schema_choice["message"]["content"])
    jsonschema.validate(document, SCHEMA)
    assert tool_choice["finish_reason"] in ("tool_calls", "stop")
    (call,) = tool_choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), TIME["function"]["parameters"])
    assert seen == 6
    wait_until(lambda: engine.admitted == 0, "the cancelled stream to end", 60)  # its Finish came: its slot is free
    assert max(rows for rows, calls in engine.step_batches.items() if calls > finished_before.get(rows, 0)) == 4

    # The seeded sample alone draws exactly what it drew beside seven others.
    async def alone() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await completion_text(client, prompt_of(15, seed=80), **sampled)

    assert asyncio.run(alone()) == sample_text
