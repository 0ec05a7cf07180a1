"""Host work off the device thread (issue 35), through the engine's own front and threads: a host image encode that
takes as long as it likes never stops a running stream (it runs on a host worker, the stream keeps decoding, the
image's request waits in its readiness stage, then runs); a scored prompt's logprobs, computed on a worker, still come
before its first token; a failed encode ends only its own request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from server.engine.engine import Engine
from server.engine.types import Delta, Finish, GenerationRequest, ImageInput, PromptLogprobs
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import null_host
from tests.support.core import RecordingGraph
from tests.support.wait import until

GREEDY = SamplingParams(temperature=0.0)
SOFT = 3  # the image's soft tokens


class GatedEncoder:
    """A host vision encoder that holds each encode until the test opens its gate; it notes the thread it ran on."""

    on_host = True
    budgets = (SOFT,)

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.gate = threading.Event()
        self.threads: list[str] = []
        self.fail = False

    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, budget: int) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("the tower broke")
        return torch.zeros(SOFT, self.hidden)


class ImageGraph(RecordingGraph):
    image_blocks = True


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Engine, GatedEncoder]]:
    host = null_host()
    encoder = GatedEncoder(int(host.embedding.lookup([2]).shape[-1]))
    graph = ImageGraph(host.structure.vocab_size, slots=4, batches=(1, 2, 4), bucket=8, max_total=256)
    engine = Engine(host.embedding, host.tokenizer, host.stop_token_ids, lambda: graph, load_vision=lambda: encoder)
    engine.start()
    assert engine.wait_ready(60), engine.state_reason
    yield engine, encoder
    engine.stop()


def image_request(tag: int) -> GenerationRequest:
    """A prompt with one image of its own (`tag`: nothing cached from another test's request)."""
    image = ImageInput(digest=bytes([tag]) * 32, budget=SOFT, soft_tokens=SOFT,
                       pixel_values=np.zeros((1, 4), np.float32), position_ids=np.zeros((1, 2), np.int64), offset=2)
    return GenerationRequest(prompt_ids=(2, 300 + tag, *[5] * SOFT, 301), max_new_tokens=2, sampling=GREEDY,
                             ignore_eos=True, images=(image,))


async def collect(handle: object, into: list[object]) -> None:
    async for event in handle.events():  # type: ignore[attr-defined]
        into.append(event)


def tokens(events: list[object]) -> int:
    return sum(isinstance(e, Delta) and e.token_id is not None for e in events)


def test_an_image_encode_on_the_host_never_stops_a_running_stream(served: tuple[Engine, GatedEncoder]) -> None:
    engine, encoder = served
    encoder.gate.clear()

    async def main() -> None:
        stream: list[object] = []
        running = engine.submit(GenerationRequest(prompt_ids=(2, 400, 401), max_new_tokens=200, sampling=GREEDY,
                                                  ignore_eos=True))
        streaming = asyncio.ensure_future(collect(running, stream))
        await until(lambda: tokens(stream) >= 2, "the stream decoding")
        pictured: list[object] = []
        with_image = engine.submit(image_request(1))
        imaging = asyncio.ensure_future(collect(with_image, pictured))
        await until(lambda: bool(encoder.threads), "the encode started")
        before = tokens(stream)
        await until(lambda: tokens(stream) >= before + 20, "tokens while the encode is held")
        assert not pictured and not encoder.gate.is_set()
        encoder.gate.set()
        await imaging
        assert tokens(pictured) == 2 and isinstance(pictured[-1], Finish) and pictured[-1].reason == "length"
        running.cancel()
        await streaming

    asyncio.run(main())
    assert encoder.threads and all(name.startswith("host-vision") for name in encoder.threads), encoder.threads


def test_a_failed_encode_ends_its_request_only(served: tuple[Engine, GatedEncoder]) -> None:
    engine, encoder = served
    encoder.fail = True
    encoder.gate.set()
    try:
        async def main() -> tuple[list[object], list[object]]:
            broken: list[object] = []
            plain: list[object] = []
            await asyncio.gather(collect(engine.submit(image_request(2)), broken),
                                 collect(engine.submit(GenerationRequest(prompt_ids=(2, 500), max_new_tokens=3,
                                                                         sampling=GREEDY, ignore_eos=True)), plain))
            return broken, plain

        broken, plain = asyncio.run(main())
    finally:
        encoder.fail = False
    assert isinstance(broken[-1], Finish) and broken[-1].reason == "error" and "the tower broke" in (broken[-1].error or "")
    assert isinstance(plain[-1], Finish) and plain[-1].reason == "length" and tokens(plain) == 3


def test_scored_prompt_logprobs_come_before_the_first_token(served: tuple[Engine, GatedEncoder]) -> None:
    engine, _ = served

    async def main() -> list[object]:
        events: list[object] = []
        prompt = (2, *range(600, 619))  # 20 tokens: three chunks of 8, each scored on a worker
        await collect(engine.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=2, sampling=GREEDY,
                                                      ignore_eos=True, prompt_logprobs=1)), events)
        return events

    events = asyncio.run(main())
    assert isinstance(events[0], PromptLogprobs) and len(events[0].entries) == 19
    assert tokens(events) == 2 and isinstance(events[-1], Finish)
