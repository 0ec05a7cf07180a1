"""The continuous-batching engine on a several-slot device, tested on state: which graph calls ran, in which slots, in
what order (a stand-in device records each call as it starts), never on how long anything took.

- Fairness: a newcomer beside three decoding streams has its first token after its own prefill plus at most two
  steps; while a 2,000-token prompt is prefilled, every running stream gets a token at least every prefill chunk
  plus one step (llama.cpp's parallel slots and vLLM's chunked prefill promise the same).
- Per row: a cancelled stream leaves the batch within one step and its slot goes to the next in the queue; a seeded
  stream draws the same tokens alone and beside three others; batched sampling equals each row sampled alone.
- Slots: a conversation's next turn finds its own slot (the longest cached prefix), the least recently used idle
  slot is evicted first, the 2nd..nth choices of a request run no prefill, --max-batch lowers how many run at once.
- Faults: a batched step that raises ends its requests (their slots reset), the engine serves on; a stalled one is
  abandoned by the watchdog for all its rows; stop() ends every running row and the queue.
- Peers' concurrency cases in spirit: llama.cpp's test_completion_parallel_slots (n_slots streams at once, each the
  answer it gives alone) and vLLM's concurrent requests (more requests than slots: all complete, none mixed up).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from server.app.runtime import build_engine
from server.engine.engine import Engine
from server.engine.types import Completion, Delta, Finish, GenerationRequest, RequestHandle
from server.graphs.null import NullGraph
from server.sampling.params import SamplingParams
from server.sampling.sampler import Sampler, sample_rows
from tests.support.api_fixtures import null_host, settings
from tests.support.wait import until, wait_until

GREEDY = SamplingParams(temperature=0.0)
STEP_S = 0.002  # the stand-in device's time per call: a device, not a test's sleep


@dataclass(frozen=True)
class Call:
    kind: str  # "prefill" | "decode"
    slots: tuple[int, ...]
    begin: int = 0  # prefill: the chunk's first position
    length: int = 1


class Recording:
    """A stand-in device: a several-slot null graph (protocol v3) that records each call when it starts; `fail` and
    `stall` turn a call into a device fault or a hang."""

    def __init__(self, slots: int = 4, batches: Sequence[int] = (1, 2, 4), *, max_total: int = 1024,
                 bucket: int = 128, step_s: float = STEP_S) -> None:
        host = null_host()
        favoured = host.tokenizer.get_vocab().get("▁a")
        self.inner = NullGraph(host.structure.vocab_size, max_total=max_total, prefill_bucket=bucket,
                               favoured_token=favoured, step_s=step_s, slots=slots, decode_batches=batches)
        for fact in ("max_total", "prefill_bucket", "prefill_buckets", "input_dtype", "vocab_size", "host_softcap",
                     "slots", "decode_batches", "image_blocks", "copies_slots"):
            setattr(self, fact, getattr(self.inner, fact))
        self.name = "recording-null"
        self.log: list[Call] = []
        self.rewinds: list[tuple[int, int]] = []
        self.fail: Callable[[Call], bool] = lambda call: False
        self.stall: Callable[[Call], bool] = lambda call: False
        self.release = threading.Event()

    def _record(self, call: Call) -> None:
        self.log.append(call)
        if self.fail(call):
            raise RuntimeError("simulated device fault")
        if self.stall(call):
            self.release.wait(30)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.prefill(embeds, positions, 0, **kwargs)

    def copy_slot(self, src: int, dst: int) -> None:  # n > 1: the null graph checks the slots (it holds no KV)
        self.inner.copy_slot(src, dst)

    def rewind(self, position: int) -> int:
        return self.rewind_slot(0, position)

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, **kwargs: Any) -> torch.Tensor:
        self._record(Call("prefill", (slot,), int(positions[0, 0]), positions.shape[1]))
        return self.inner.prefill(embeds, positions, slot, **kwargs)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], **kwargs: Any) -> torch.Tensor:
        self._record(Call("decode", tuple(slots)))
        return self.inner.decode(embeds, positions, slots, **kwargs)

    def rewind_slot(self, slot: int, position: int) -> int:
        self.rewinds.append((slot, position))
        return self.inner.rewind_slot(slot, position)


def started(graph: Recording, **overrides: Any) -> Engine:
    engine = build_engine(null_host(), settings(**{"max_queue": 16, **overrides}), load=lambda: graph)
    engine.start()
    assert engine.wait_ready(30), engine.state_reason
    return engine


def request(prompt: Sequence[int], n: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=n, **{"sampling": GREEDY, "ignore_eos": True,
                                                                             **fields})


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]


def decoding_together(graph: Recording, rows: int) -> Callable[[], bool]:
    return lambda: any(c.kind == "decode" and len(c.slots) == rows for c in graph.log[-3:])


async def first_token(handle: RequestHandle, graph: Recording) -> int:
    """How many calls had started when `handle`'s first token reached its caller."""
    async for event in handle.events():
        if isinstance(event, Delta) and event.token_id is not None:
            return len(graph.log)
    raise AssertionError("no token")


def test_a_newcomer_beside_three_decoding_streams_starts_after_its_prefill_and_two_steps() -> None:
    graph = Recording()
    engine = started(graph)
    try:
        async def scenario() -> tuple[int, int, list[Completion]]:
            streams = [engine.submit(request(prompt_of(20, seed=i), 400)) for i in range(3)]
            await until(decoding_together(graph, 3), "three streams decoding together")
            mark = len(graph.log)  # the call running now started before the newcomer arrived
            newcomer = engine.submit(request(prompt_of(100, seed=9), 5))
            arrived = await first_token(newcomer, graph)
            for handle in streams:
                handle.cancel()
            return mark, arrived, [await h.result() for h in streams]

        mark, arrived, others = asyncio.run(asyncio.wait_for(scenario(), 60))
        after = graph.log[mark:arrived]
        prefills = [i for i, c in enumerate(after) if c.kind == "prefill"]
        assert len(prefills) == 1, after  # one chunk of 100 tokens
        # Calls that began after it arrived, up to its first token: at most one step before its prefill (the worker
        # may have scheduled it already) and the step whose submission publishes the token.
        assert len(after) <= 1 + 2, after
        assert all(len(c.slots) == 3 for c in after[: prefills[0]])  # the others kept decoding meanwhile
        assert after[prefills[0] + 1 :] == [] or len(after[prefills[0] + 1].slots) == 4  # then all four together
        assert all(c.finish.reason == "cancelled" for c in others)
    finally:
        engine.stop()


def test_a_2000_token_prompt_never_holds_a_running_stream_longer_than_a_chunk_and_a_step() -> None:
    graph = Recording(max_total=4096)
    engine = started(graph)
    try:
        async def scenario() -> tuple[int, int, Completion]:
            streams = [engine.submit(request(prompt_of(10, seed=i), 3000)) for i in range(3)]
            await until(decoding_together(graph, 3), "three streams decoding together")
            mark = len(graph.log)
            long = engine.submit(request(prompt_of(2000, seed=7), 4))
            done = await long.result()
            end = len(graph.log)
            for handle in streams:
                handle.cancel()
            for handle in streams:
                assert (await handle.result()).finish.reason == "cancelled"
            return mark, end, done

        mark, end, done = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert done.finish.prefill_calls == -(-2000 // 128) and len(done.token_ids) == 4
        window = graph.log[mark:end]
        prefill_slot = next(c.slots[0] for c in window if c.kind == "prefill")
        running = {s for c in window if c.kind == "decode" for s in c.slots} - {prefill_slot}
        assert len(running) == 3
        for slot in running:  # between two of its decode steps: at most one prefill chunk
            since = 0
            for call in window:
                if call.kind == "decode" and slot in call.slots:
                    since = 0
                elif call.kind == "prefill":
                    since += 1
                    assert since <= 1, f"slot {slot} waited {since} prefill chunks for a token"
    finally:
        engine.stop()


def test_a_cancelled_stream_leaves_the_batch_within_one_step_and_its_slot_goes_to_the_next() -> None:
    graph = Recording()
    engine = started(graph)
    try:
        async def scenario() -> tuple[int, int, list[Completion], Completion]:
            streams = [engine.submit(request(prompt_of(12, seed=i), 300)) for i in range(4)]
            waiting = engine.submit(request(prompt_of(12, seed=9), 5))
            await until(decoding_together(graph, 4), "four streams decoding together")
            assert (engine.running, engine.queue_depth) == (4, 1)
            mark = len(graph.log)
            streams[1].cancel()
            done = await waiting.result()
            for handle in streams:
                handle.cancel()
            return mark, len(graph.log), [await h.result() for h in streams], done

        mark, end, results, newcomer = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert results[1].finish.reason == "cancelled"
        # Its rows after the cancel: the call running then and at most one more; then three rows until the newcomer
        # (admitted into the freed slot) prefills and joins.
        after = graph.log[mark:end]
        first_three = next(i for i, c in enumerate(after) if c.kind != "decode" or len(c.slots) != 4)
        assert first_three <= 1, after[:5]
        assert after[first_three].kind == "prefill" or len(after[first_three].slots) == 3
        assert newcomer.finish.reason == "length" and len(newcomer.token_ids) == 5
    finally:
        engine.stop()


def test_four_streams_at_once_each_give_what_they_give_alone() -> None:
    """llama.cpp's test_completion_parallel_slots and vLLM's concurrent requests, in spirit: more requests than slots
    (8 on 4), mixed sampling, all complete, each exactly what it gives alone; the batch ran at 4 rows."""
    graph = Recording()
    engine = started(graph)
    samplings = [GREEDY, SamplingParams(temperature=1.0, top_k=40, seed=11),
                 SamplingParams(temperature=0.8, top_p=0.9, seed=12, logprobs=True, top_logprobs=3),
                 SamplingParams(temperature=0.0, logit_bias=((300, 100.0),)),
                 SamplingParams(temperature=1.0, seed=13, presence_penalty=1.5, frequency_penalty=0.5)]
    requests = [request(prompt_of(8 + 7 * i, seed=i), 12 + i, sampling=samplings[i % len(samplings)])
                for i in range(8)]
    try:
        async def together() -> list[Completion]:
            handles = [engine.submit(r) for r in requests]
            return [await h.result() for h in handles]

        async def alone(r: GenerationRequest) -> Completion:
            return await engine.submit(r).result()

        batched = asyncio.run(together())
        assert max(len(c.slots) for c in graph.log if c.kind == "decode") == 4
        for r, done in zip(requests, batched, strict=True):
            single = asyncio.run(alone(r))
            assert done.token_ids == single.token_ids and done.text == single.text
            assert done.finish.reason == "length" and len(done.token_ids) == r.max_new_tokens
            assert [d.logprob for d in done.deltas] == [d.logprob for d in single.deltas]
        assert batched[3].token_ids == [300] * requests[3].max_new_tokens  # the bias row, argmaxed on its own row
    finally:
        engine.stop()


def test_batched_sampling_equals_each_row_sampled_alone() -> None:
    vocab = 4096
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [B, V]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0, logprobs=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3)]

    def samplers() -> list[Sampler]:
        return [Sampler(p, vocab, [1, 2, int(logits[4].argmax())], 30.0) for p in params]

    together = sample_rows(samplers(), logits)
    alone = [s.sample(logits[b]) for b, s in enumerate(samplers())]
    assert together == alone
    assert [s.plain_greedy for s in samplers()] == [True, True, False, False, False]
    assert together[4].token_id != int(logits[4].argmax())  # the penalised row was not taken by the plain argmax


def test_a_conversation_finds_its_own_slot_and_the_least_recently_used_is_evicted() -> None:
    graph = Recording(slots=2, batches=(1, 2))
    engine = started(graph)
    try:
        async def turn(prompt: list[int]) -> Completion:
            return await engine.submit(request(prompt, 4)).result()

        a, b = prompt_of(40, seed=1), prompt_of(30, seed=2)
        first_a, first_b = asyncio.run(turn(a)), asyncio.run(turn(b))
        # Each next turn re-sends its conversation: it finds it in its own slot, whatever ran in the other.
        a2 = a + first_a.token_ids + [500, 501]
        b2 = b + first_b.token_ids + [600]
        assert asyncio.run(turn(a2)).finish.reused_tokens == len(a) + 3  # the last generated token was never fed back
        assert asyncio.run(turn(b2)).finish.reused_tokens == len(b) + 3
        # A third conversation takes the least recently used slot (a's), so b's next turn still finds b.
        # A third conversation shares only the BOS with either: it takes the least recently used slot (a's, keeping
        # that BOS), so b's next turn still finds b.
        assert asyncio.run(turn(prompt_of(20, seed=3))).finish.reused_tokens == 1
        b3 = b2 + [700]
        assert asyncio.run(turn(b3)).finish.reused_tokens == len(b2)
        assert asyncio.run(turn(a2 + [800])).finish.reused_tokens == 1  # a's conversation was evicted: the BOS only
    finally:
        engine.stop()


def test_the_choices_of_one_request_run_no_prefill_beside_other_streams() -> None:
    graph = Recording()
    engine = started(graph)
    try:
        async def scenario() -> list[Completion]:
            other = engine.submit(request(prompt_of(10, seed=5), 200))
            choices = engine.submit_all([request(prompt_of(50, seed=6), 6, sampling=SamplingParams(temperature=1.0,
                                                                                                  seed=s))
                                         for s in range(3)])
            done = [await h.result() for h in choices]
            other.cancel()
            await other.result()
            return done

        done = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert [c.finish.prefill_calls for c in done] == [1, 0, 0]
        assert [c.finish.reused_tokens for c in done[1:]] == [50, 50]
    finally:
        engine.stop()


def test_max_batch_lowers_how_many_run_at_once() -> None:
    graph = Recording()
    engine = started(graph, max_batch=2)
    try:
        assert engine.capacity == 2

        async def scenario() -> list[Completion]:
            handles = [engine.submit(request(prompt_of(10, seed=i), 30)) for i in range(4)]
            await until(lambda: engine.running == 2 and engine.queue_depth == 2, "two running, two queued")
            return [await h.result() for h in handles]

        assert all(c.finish.reason == "length" for c in asyncio.run(asyncio.wait_for(scenario(), 60)))
        assert max(len(c.slots) for c in graph.log if c.kind == "decode") == 2
        assert {s for c in graph.log for s in c.slots} == {0, 1}
    finally:
        engine.stop()


def test_a_batched_step_that_raises_ends_its_requests_resets_their_slots_and_the_engine_serves_on() -> None:
    graph = Recording()
    engine = started(graph)
    try:
        async def scenario() -> tuple[list[Finish], Completion]:
            handles = [engine.submit(request(prompt_of(10, seed=i), 300)) for i in range(3)]
            await until(decoding_together(graph, 3), "three streams decoding together")
            graph.fail = lambda call: call.kind == "decode" and len(call.slots) == 3
            finishes = [(await h.result()).finish for h in handles]
            graph.fail = lambda call: False
            return finishes, await engine.submit(request(prompt_of(10, seed=0), 5)).result()

        finishes, after = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert all(f.reason == "error" and "simulated device fault" in (f.error or "") for f in finishes)
        assert all(f.completion_tokens >= 1 for f in finishes)
        assert {slot for slot, position in graph.rewinds if position == 0} >= {0, 1, 2}  # every row's slot reset
        assert after.finish.reason == "length" and after.finish.reused_tokens == 0  # its cache was not trusted
        assert engine.state == "ok" and (engine.admitted, engine.running) == (0, 0)
    finally:
        engine.stop()


def test_a_stalled_batched_step_is_abandoned_for_all_its_rows() -> None:
    graph = Recording()
    engine = started(graph, step_timeout_s=0.4)
    try:
        async def scenario() -> list[Finish]:
            handles = [engine.submit(request(prompt_of(10, seed=i), 300)) for i in range(3)]
            await until(decoding_together(graph, 3), "three streams decoding together")
            graph.stall = lambda call: call.kind == "decode"
            finishes = [(await h.result()).finish for h in handles]
            assert engine.state == "error" and (engine.admitted, engine.running) == (0, 0)
            graph.stall = lambda call: False
            graph.release.set()
            return finishes

        finishes = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert all(f.reason == "error" and "step timeout" in (f.error or "") for f in finishes)
        wait_until(lambda: engine.state == "ok", "the engine to be healthy again", 10)

        async def after() -> Completion:
            return await engine.submit(request(prompt_of(10, seed=4), 5)).result()

        assert asyncio.run(asyncio.wait_for(after(), 30)).finish.reason == "length"
    finally:
        graph.release.set()
        engine.stop()


def test_stop_ends_every_running_row_and_the_queue() -> None:
    graph = Recording()
    engine = started(graph)

    async def scenario() -> list[str]:
        handles = [engine.submit(request(prompt_of(10, seed=i), 3000)) for i in range(6)]
        await until(lambda: (engine.running, engine.queue_depth) == (4, 2) and decoding_together(graph, 4)(),
                    "four running, two queued")
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        return [(await h.result()).finish.reason for h in handles]

    assert asyncio.run(asyncio.wait_for(scenario(), 30)) == ["cancelled"] * 6
    assert engine.admitted == 0


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_the_null_graph_answers_protocol_v3_in_any_batch(rows: int) -> None:
    graph = NullGraph(64, slots=4, decode_batches=(1, 2, 4), favoured_token=7)
    logits = graph.decode(torch.zeros(rows, 1, 8), torch.arange(rows)[:, None], list(range(rows)))  # [B, V]
    assert logits.shape == (rows, 64) and logits.argmax(1).tolist() == [7] * rows
    with pytest.raises(ValueError, match="distinct"):
        graph.decode(torch.zeros(2, 1, 8), torch.zeros(2, 1, dtype=torch.long), [1, 1])


def test_a_drain_lets_every_running_row_and_the_queue_finish() -> None:
    """What SIGTERM does (server.api.service.Service.drain): no new requests, every admitted one runs to its end."""
    graph = Recording()
    engine = started(graph)

    async def scenario() -> list[Finish]:
        handles = [engine.submit(request(prompt_of(10, seed=i), 40)) for i in range(6)]
        await until(lambda: (engine.running, engine.queue_depth) == (4, 2), "four running, two queued")
        engine.drain()
        with pytest.raises(Exception, match="draining"):
            engine.submit(request(prompt_of(10, seed=9), 4))
        assert await engine.wait_idle(30)
        return [(await h.result()).finish for h in handles]

    try:
        finishes = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert [(f.reason, f.completion_tokens) for f in finishes] == [("length", 40)] * 6
    finally:
        engine.stop()


def test_a_rows_timeout_and_stop_string_end_that_row_alone() -> None:
    """Per row: a stop string ends one stream, a wall-clock limit another; the streams beside them go on."""
    graph = Recording()
    engine = started(graph)

    async def scenario() -> tuple[Completion, Completion, list[Completion]]:
        others = [engine.submit(request(prompt_of(10, seed=i), 3000)) for i in range(2)]
        stopped = engine.submit(request(prompt_of(12, seed=5), 3000, stop=(" a a a",)))
        limited = engine.submit(request(prompt_of(14, seed=6), 3000, timeout_s=0.3))
        first, second = await stopped.result(), await limited.result()
        assert engine.running == 2  # the two others still decode
        for handle in others:
            handle.cancel()
        return first, second, [await h.result() for h in others]

    try:
        stopped, limited, others = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert stopped.finish.reason == "stop" and stopped.text == "" and len(stopped.token_ids) == 3  # cut where it began
        assert limited.finish.reason == "length" and limited.finish.timed_out and limited.finish.completion_tokens > 0
        assert all(c.finish.reason == "cancelled" for c in others)
    finally:
        engine.stop()
