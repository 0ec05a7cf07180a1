"""n > 1 side by side on the production path: the recipe's `--contract v3` CPU build (4 KV slots, decode batches 1, 2,
4; tests/test_recipe_v3.py's tiny Gemma-4) served by the real engine and app. A request of four choices prefills its
prompt once, the graph copies that slot into the other three (`JitGraphV3.copy_slot`, the KV buffers' rows), and the
four decode in batches of 4; each seeded choice draws exactly what the same seed draws alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.app.runtime import Host, build_engine, load_host
from server.engine.types import GenerationRequest
from server.graphs.jit import JitGraphV3
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.test_recipe_v3 import prompt_of

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NEW = 12
SAMPLED = SamplingParams(temperature=1.0, top_k=50)


@pytest.fixture(scope="module")
def host(recipe_v3_artifacts: Path) -> Host:
    return load_host(recipe_v3_artifacts, "jit", "tiny-v3")  # tests/conftest.py: the build test_batched_jit serves


class Prefills:
    """The graph's prefill calls, (slot, first position, length) each, recorded as the engine makes them."""

    def __init__(self, graph: JitGraphV3) -> None:
        self.calls: list[tuple[int, int, int]] = []
        prefill: Callable[..., torch.Tensor] = graph.prefill

        def recording(embeds: torch.Tensor, positions: torch.Tensor, slot: int, **kwargs: Any) -> torch.Tensor:
            self.calls.append((slot, int(positions[0, 0]), positions.shape[1]))
            return prefill(embeds, positions, slot, **kwargs)

        graph.prefill = recording  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[LiveServer]:
    config = settings(artifacts=host.artifacts.root, graph="jit", served_model_name="tiny-v3")
    engine = build_engine(host, config)
    with live_server(config, engine, host) as live:
        graph = engine.core.graph
        assert isinstance(graph, JitGraphV3) and graph.copies_slots and graph.slots == 4
        live.prefills = Prefills(graph)  # type: ignore[attr-defined]
        yield live


def request(prompt: list[int], seed: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=NEW, sampling=SamplingParams(
        temperature=SAMPLED.temperature, top_k=SAMPLED.top_k, seed=seed), ignore_eos=True)


def test_four_choices_prefill_once_and_decode_in_batches_of_four(server: LiveServer) -> None:
    engine, prefills = server.engine, server.prefills  # type: ignore[attr-defined]
    prompt = prompt_of(27, seed=90)  # one chunk (the 32 bucket)
    before, calls = dict(engine.step_batches), len(prefills.calls)

    async def together() -> list[list[int]]:
        handles = engine.submit_all([request(prompt, 500 + i) for i in range(4)])
        return [(await handle.result()).token_ids for handle in handles]

    choices = asyncio.run(together())
    assert len(prefills.calls) - calls == 1 and prefills.calls[-1][1:] == (0, 27)  # the prompt once, in one slot
    ran = {rows: n - before.get(rows, 0) for rows, n in engine.step_batches.items() if n > before.get(rows, 0)}
    assert ran == {1: 1, 4: NEW - 1}  # the prefill, then every decode step with all four rows
    assert len({tuple(ids) for ids in choices}) > 1  # four seeds, four draws: not one choice four times

    # Each seed alone (the prompt's logits kept in a slot: no prefill; decode steps of one row) draws the same.
    async def alone(seed: int) -> list[int]:
        return (await engine.submit(request(prompt, seed)).result()).token_ids

    for i, ids in enumerate(choices):
        assert asyncio.run(alone(500 + i)) == ids, i

    # The four again, the whole prompt now in the cache with its logits: no prefill at all; the first choice takes
    # the kept logits, the other three copy its slot at once, and all four decode together from the first step.
    before, calls = dict(engine.step_batches), len(prefills.calls)
    assert asyncio.run(together()) == choices
    assert len(prefills.calls) == calls
    ran = {rows: n - before.get(rows, 0) for rows, n in engine.step_batches.items() if n > before.get(rows, 0)}
    assert ran == {4: NEW - 1}


def test_n_4_over_http_is_one_prefill_and_each_choice_its_seed_alone(server: LiveServer) -> None:
    """/v1/completions with n: 4 and a seed: choice i draws with seed + i (the chat route's rule), one prefill."""
    prefills = server.prefills  # type: ignore[attr-defined]
    prompt = prompt_of(45, seed=91)  # two chunks: 32 + 13 (padded to 32)
    body = {"model": "tiny-v3", "prompt": prompt, "max_tokens": NEW, "temperature": 1.0, "top_k": 50, "seed": 70,
            "ignore_eos": True}
    calls = len(prefills.calls)
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 4}, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    ran = prefills.calls[calls:]
    assert [(begin, length) for _, begin, length in ran] == [(0, 32), (32, 13)] and len({s for s, _, _ in ran}) == 1
    for i, text in enumerate(texts):
        alone = httpx.post(f"{server.url}/v1/completions", json={**body, "seed": 70 + i}, timeout=300)
        assert alone.status_code == 200 and alone.json()["choices"][0]["text"] == text, i
