"""The recipe's `--target cpu` graph, served by our deploy path (`--graph jit`), matches `transformers.generate()`.

This is the production path end to end on CPU: the vendored script traces the Gemma-4 module into `model.pt`,
`load_host(..., "jit")` + the engine drive it through `torch.jit.load` with the contract tensors, a padded last
prefill chunk, decode steps, and prefix reuse for a follow-up request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from server.app.runtime import Host, build_engine, load_host
from server.engine.engine import Engine
from server.engine.types import Completion, Finish, GenerationRequest
from server.sampling.params import SamplingParams
from tests.test_recipe import BUCKET, MAX, H

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return H.make_tiny_hf(seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, reference: torch.nn.Module) -> Iterator[tuple[Host, Engine]]:
    out = H.export_cpu_artifacts(tmp_path_factory.mktemp("recipe-served"), reference, MAX, BUCKET)
    host = load_host(out, "jit")
    assert host.graph_kind == "jit"
    engine = build_engine(host)
    engine.start()
    assert engine.wait_ready(600), engine.state_reason
    yield host, engine
    engine.stop()


def run(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], Finish]:
    async def go() -> Completion:
        return await engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=n,
                                                           sampling=SamplingParams(temperature=0.0))).result()

    completion = asyncio.run(go())
    return completion.token_ids, completion.finish


def expected(reference: torch.nn.Module, prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    for index, token in enumerate(out):  # the engine stops at eos; generate() here does not
        if token in eos:
            return out[: index + 1]
    return out


def test_jit_graph_from_the_recipe_matches_generate(served: tuple[Host, Engine], reference: torch.nn.Module) -> None:
    host, engine = served
    assert host.embedding.table.dtype == torch.bfloat16 and host.embedding.dtype == torch.float32
    eos = frozenset(host.structure.eos_token_ids)
    prompt = prompt_ids(2 * BUCKET + 5, seed=11)  # two full chunks, then a padded one
    ids, finish = run(engine, prompt, 16)
    assert ids == expected(reference, prompt, 16, eos)
    assert finish.prefill_calls == 3

    # A follow-up re-sends the conversation: only the new tokens are prefilled.
    follow = prompt + ids[:4] + prompt_ids(6, seed=12)
    ids2, finish2 = run(engine, follow, 12)
    assert finish2.reused_tokens == len(prompt) + 4
    assert finish2.prefill_calls == 1
    assert ids2 == expected(reference, follow, 12, eos)


def prompt_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, H.TINY["vocab_size"], (length,), generator=generator).tolist()
