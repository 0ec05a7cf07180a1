"""The scheduler, the KV slots and the runner on their own: plain sequences and slots, a recording stand-in graph; no
engine, no thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from server.engine.kv import KVSlot, KVSlots
from server.engine.runner import Abandoned, DeviceWatch, Runner
from server.engine.scheduler import Alternate, DecodeStep, PrefillStep, Scheduler, Step, TokenBudget
from server.engine.sequence import Sequence as Seq
from server.engine.sequence import State
from server.engine.types import GenerationRequest, ImageInput, RequestHandle, prompt_keys
from server.model.embedding import HostEmbedding
from tests.support.core import RecordingGraph

VOCAB, HIDDEN = 64, 4


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def seq_of(loop: asyncio.AbstractEventLoop, prompt: Sequence[int], *, images: tuple[ImageInput, ...] = (),
           scored: bool = False) -> Seq:
    request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=4, images=images,
                                prompt_logprobs=1 if scored else None)
    return Seq(RequestHandle(request, loop), eos_ids=frozenset(), budget=4, deadline=float("inf"))


def slots_of(count: int, rewinds: list[tuple[int, int]] | None = None,
             answer: Callable[[int, int], int] = lambda slot, position: position) -> KVSlots:
    def rewind(slot: int, position: int) -> int:
        if rewinds is not None:
            rewinds.append((slot, position))
        return answer(slot, position)
    return KVSlots(rewind, count)


# ------------------------------------------------------------------------------------------------------ KV slots


def test_a_slot_matches_its_common_prefix_short_of_the_last_token() -> None:
    slot = KVSlot(lambda position: position)
    slot.tokens = [1, 2, 3, 4, 5]
    assert slot.match([1, 2, 3, 9]) == 3 and slot.match([1, 2, 3, 4, 5]) == 4  # the last token is recomputed
    assert slot.match([1, 2, 3, 4, 5], prefix_reuse=False) == 0
    logits = torch.randn(1, 1, VOCAB)
    slot.keep([1, 2, 3, 4, 5], logits)
    assert slot.match([1, 2, 3, 4, 5]) == 5  # kept with its logits: nothing to compute
    start, kept = slot.reuse([1, 2, 3, 4, 5])
    assert start == 5 and kept is not None and torch.equal(kept, logits)


def test_reuse_rewinds_the_graph_and_takes_its_word_for_where_to_continue() -> None:
    asked: list[int] = []

    def ring_wrapped(position: int) -> int:  # a graph that can only start over
        asked.append(position)
        return 0

    slot = KVSlot(ring_wrapped)
    slot.tokens = [1, 2, 3, 4, 5, 6]
    assert slot.reuse([1, 2, 3, 4, 7]) == (0, None)
    assert asked == [4] and slot.tokens == []
    slot.tokens = [1, 2, 3]
    slot.keep([1, 2, 3], torch.zeros(1, 1, VOCAB))
    assert slot.rewind_to(2) == 0 and slot.match([1, 2, 3]) == 0  # the kept logits went with the rewind


def test_choose_takes_the_longest_prefix_when_it_is_half_the_prompt_else_the_least_recently_used() -> None:
    slots = slots_of(3)
    first, second, third = (slots.choose([n]) for n in (1, 2, 3))
    assert not slots.free
    first.tokens, third.tokens = [5, 6, 7, 8, 9], [5]
    for slot in (third, first, second):
        slots.release(slot)
    assert slots.choose([5, 6, 7, 8, 1]) is first  # 4 of 5 cached
    # third holds 1 of 6, under half: the least recently used of the free ones (second) is evicted instead
    assert slots.choose([5, 1, 1, 1, 1, 1]) is second
    assert slots.choose([9]) is third



def test_a_short_newcomer_evicts_an_empty_or_short_cache_before_a_long_one() -> None:
    # An agent's long prefix (more than one prefill call to rebuild) idle longest; a probe must not take its slot.
    slots = KVSlots(lambda slot, position: position, 3, short=8)
    agent, chat, spare = (slots.choose([n]) for n in (1, 2, 3))
    agent.tokens, chat.tokens, spare.tokens = list(range(100, 140)), [7, 8, 9], []
    for slot in (agent, chat, spare):
        slots.release(slot)
    assert slots.choose([42]) is spare  # empty first, though it was used last
    assert slots.choose([43]) is chat  # then the short cache
    slots.release(chat)
    slots.release(spare)
    chat.tokens, spare.tokens = [7, 8, 9], [5, 6]
    assert slots.choose([44]) is spare  # the least recently used of the short ones (spare was taken before chat)
    assert slots.choose([45]) is chat
    assert slots.choose([46]) is agent  # the long one only when nothing else is free
    # The agent's next turn still finds its prefix when a short slot was free: match beats eviction order.
    for slot in (agent, chat, spare):
        slots.release(slot)
    assert slots.choose(list(range(100, 140)) + [1]) is agent


# ------------------------------------------------------------------------------------------------------ scheduler


def test_capacity_bounds_admission_below_the_free_slots(loop: asyncio.AbstractEventLoop) -> None:
    scheduler = Scheduler((8,), slots_of(4), capacity=2)
    for n in range(2):
        assert scheduler.has_room
        scheduler.add(seq_of(loop, [2, 10 + n]))
    assert not scheduler.has_room and len(scheduler.slots.free) == 2
    scheduler.remove(scheduler.active[0])
    assert scheduler.has_room and len(scheduler.slots.free) == 3


def test_add_plans_the_chunks_after_the_cached_prefix(loop: asyncio.AbstractEventLoop) -> None:
    rewinds: list[tuple[int, int]] = []
    scheduler = Scheduler((4, 16), slots_of(2, rewinds), capacity=2)
    prompt = list(range(2, 42))  # 40 tokens
    cached = scheduler.slots.all[1]
    cached.tokens = prompt[:30]
    seq = seq_of(loop, prompt)
    assert scheduler.add(seq) is None
    assert seq.kv is cached and seq.reused_tokens == 30 and rewinds == [(1, 30)]
    assert list(seq.chunks) == [(30, 40)]
    scored = seq_of(loop, prompt, scored=True)  # logprobs of every prompt token: nothing is reused
    scheduler.add(scored)
    assert scored.reused_tokens == 0 and list(scored.chunks) == [(0, 16), (16, 32), (32, 40)]


def test_a_cached_prefix_ending_inside_an_image_goes_back_to_its_start(loop: asyncio.AbstractEventLoop) -> None:
    image = ImageInput(digest=b"\x01" * 32, budget=8, soft_tokens=6, pixel_values=np.zeros(1), position_ids=np.zeros(1),
                       offset=4)
    prompt = [2, 3, 4, 5, *[7] * 6, 8, 9, 10]
    seq = seq_of(loop, prompt, images=(image,))
    scheduler = Scheduler((8,), slots_of(1), capacity=1)
    scheduler.slots.all[0].tokens = list(prompt_keys(seq.handle.request)[:7])  # the prefix ends mid-image
    scheduler.add(seq)
    assert seq.reused_tokens == 4 and list(seq.chunks) == [(4, 12), (12, 13)]  # the image whole, in one chunk


def test_alternate_interleaves_chunks_with_decode_steps_and_skips_what_is_not_ready(
        loop: asyncio.AbstractEventLoop) -> None:
    scheduler = Scheduler((4,), slots_of(4), capacity=4, policy=Alternate())
    running, long, held = (seq_of(loop, list(range(2, 2 + n))) for n in (3, 10, 3))
    for seq in (running, long, held):
        scheduler.add(seq)
    running.chunks.clear()
    running.state = State.DECODING
    work: Future[None] = Future()
    held.preparing.append(work)
    kinds = []
    for _ in range(6):
        step = scheduler.schedule()
        assert step is not None
        kinds.append(("decode",) if isinstance(step, DecodeStep) else ("prefill", step.seq is long, step.begin))
    assert kinds == [("prefill", True, 0), ("decode",), ("prefill", True, 4), ("decode",), ("prefill", True, 8),
                     ("decode",)]
    assert long.state is State.PREFILLING and held.state is State.WAITING and list(held.chunks) == [(0, 3)]
    work.set_result(None)
    step = scheduler.schedule()
    assert isinstance(step, PrefillStep) and step.seq is held and step.last


def kinds_of(scheduler: Scheduler, names: dict[Seq, str], count: int) -> list[str]:
    """The next `count` steps, each "decode" or the name of the prompt whose chunk ran (a finished plan's sequence
    turns to decoding, as the core does once its first token is sampled)."""
    kinds = []
    for _ in range(count):
        step: Step | None = scheduler.schedule()
        assert step is not None
        if isinstance(step, DecodeStep):
            kinds.append("decode")
            continue
        kinds.append(names[step.seq])
        if step.last:
            step.seq.state = State.DECODING
    return kinds


def test_token_budget_gives_the_next_chunk_to_the_shortest_prompt_between_decode_steps(
        loop: asyncio.AbstractEventLoop) -> None:
    """Three newcomers arrive together beside a running stream (8k, 512 and 16 tokens, scaled to chunks of 4: 40, 12
    and 2): the smallest is prefilled first and decodes after its one chunk; the running stream gets a decode step
    between any two chunks; the long prompt runs last."""
    scheduler = Scheduler((4,), slots_of(4), capacity=4, policy=TokenBudget())
    running, long, mid, tiny = (seq_of(loop, list(range(2, 2 + n))) for n in (3, 40, 12, 2))
    for seq in (running, long, mid, tiny):
        scheduler.add(seq)
    running.chunks.clear()
    running.state = State.DECODING
    names = {long: "8k", mid: "512", tiny: "16"}
    kinds = kinds_of(scheduler, names, 10)
    assert kinds == ["16", "decode", "512", "decode", "512", "decode", "512", "decode", "8k", "decode"]
    assert long.state is State.PREFILLING and list(long.chunks)[0] == (4, 8)


def test_token_budget_runs_prompts_back_to_back_when_nothing_decodes(loop: asyncio.AbstractEventLoop) -> None:
    scheduler = Scheduler((4,), slots_of(2), capacity=2, policy=TokenBudget())
    long, short = (seq_of(loop, list(range(2, 2 + n))) for n in (12, 3))
    for seq in (long, short):
        scheduler.add(seq)
    step = scheduler.schedule()
    assert isinstance(step, PrefillStep) and step.seq is short and step.last  # the shorter first, though it came later
    step = scheduler.schedule()  # `short` has not turned to decoding (no token sampled): the long one's chunk
    assert isinstance(step, PrefillStep) and step.seq is long


def test_token_budget_never_starves_a_long_prompt(loop: asyncio.AbstractEventLoop) -> None:
    """Short prompts keep arriving: the long one, passed over `patience` chunks, gets the next; then waits again."""
    scheduler = Scheduler((4,), slots_of(8), capacity=8, policy=TokenBudget(patience=3))
    long = seq_of(loop, list(range(2, 42)))
    scheduler.add(long)
    shorts = []
    for n in range(6):  # one fresh 4-token prompt ready before every chunk
        shorts.append(seq := seq_of(loop, [2, 100 + n, 101 + n, 102 + n]))
        scheduler.add(seq)
    names: dict[Seq, str] = {long: "long", **{seq: "short" for seq in shorts}}
    kinds = kinds_of(scheduler, names, 14)
    # the first short ends before anything decodes, then a decode step between any two chunks
    assert kinds == ["short", "short", "decode", "short", "decode", "long", "decode", "short", "decode", "short",
                     "decode", "short", "decode", "long"]


def test_a_larger_budget_runs_several_chunks_between_decode_steps(loop: asyncio.AbstractEventLoop) -> None:
    scheduler = Scheduler((4,), slots_of(3), capacity=3, policy=TokenBudget(budget=8))
    running, a, b = (seq_of(loop, list(range(2, 2 + n))) for n in (3, 8, 12))
    for seq in (running, a, b):
        scheduler.add(seq)
    running.chunks.clear()
    running.state = State.DECODING
    names = {a: "a", b: "b"}
    # 8 prefill tokens (two chunks of 4) a round; `a` turns to decoding after its second chunk and joins the step
    assert kinds_of(scheduler, names, 6) == ["a", "a", "decode", "b", "b", "decode"]


# ------------------------------------------------------------------------------------------------------ runner


class StandIn(RecordingGraph):
    """The recording null graph, with a fault before its submission on demand."""

    fail_before_submit = False

    def prefill(self, *args: object, **kwargs: object) -> torch.Tensor:  # type: ignore[override]
        if self.fail_before_submit:
            raise RuntimeError("device fault")
        return super().prefill(*args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def runner() -> Runner:
    graph = StandIn(VOCAB, slots=2, batches=(1, 2), bucket=8, max_total=64)
    embedding = HostEmbedding(torch.randn(VOCAB, HIDDEN), 1.0)
    return Runner(graph, embedding, threading.Condition(), DeviceWatch())


def test_runner_prefills_into_the_slot_and_publishes_once_on_submit(loop: asyncio.AbstractEventLoop,
                                                                     runner: Runner) -> None:
    seq = seq_of(loop, [2, 5, 6, 7, 8])
    seq.kv = runner_slot = KVSlot(lambda p: p, index=1)
    published: list[int] = []
    logits = runner.prefill(seq, 0, 5, last_only=True, on_submit=lambda: published.append(len(graph_log(runner))))
    assert logits.shape == (1, 1, VOCAB) and published == [0]  # before the call was recorded as submitted
    assert graph_log(runner)[0].slots == (1,) and graph_log(runner)[0].positions == (0, 1, 2, 3, 4)
    assert runner_slot.tokens == [2, 5, 6, 7, 8] and seq.graph_calls == 1
    assert runner.watch.steps == {1: 1} and runner.watch.rows == ()


def test_runner_publishes_after_a_fault_before_the_submission(loop: asyncio.AbstractEventLoop, runner: Runner) -> None:
    seq = seq_of(loop, [2, 5])
    seq.kv = KVSlot(lambda p: p)
    runner.graph.fail_before_submit = True  # type: ignore[attr-defined]
    published: list[bool] = []
    with pytest.raises(RuntimeError, match="device fault"):
        runner.prefill(seq, 0, 2, last_only=True, on_submit=lambda: published.append(True))
    assert published == [True]  # no held token is lost


def test_runner_decodes_each_row_at_its_own_next_position(loop: asyncio.AbstractEventLoop, runner: Runner) -> None:
    rows = [seq_of(loop, [2, 5, 6]), seq_of(loop, [2, 9])]
    for index, seq in enumerate(rows):
        seq.kv = KVSlot(lambda p: p, index=index)
        seq.kv.tokens = list(seq.token_ids)
        seq.token_ids.append(11 + index)  # the token each just sampled
    logits = runner.decode(rows)
    assert logits.shape == (2, VOCAB)
    assert graph_log(runner)[-1].slots == (0, 1) and graph_log(runner)[-1].positions == (3, 2)
    assert [seq.kv.tokens[-1] for seq in rows if seq.kv is not None] == [11, 12]


def test_runner_raises_abandoned_when_the_watchdog_gave_up_meanwhile(loop: asyncio.AbstractEventLoop,
                                                                   runner: Runner) -> None:
    seq = seq_of(loop, [2, 5])
    seq.kv = KVSlot(lambda p: p)

    def watchdog(call: object) -> None:
        assert runner.watch.rows == (seq,)  # what the watchdog sees during the call
        runner.watch.abandoned = True

    runner.graph.during = watchdog  # type: ignore[attr-defined]
    with pytest.raises(Abandoned):
        runner.prefill(seq, 0, 2, last_only=True)


def graph_log(runner: Runner) -> list:  # type: ignore[type-arg]
    return runner.graph.log  # type: ignore[attr-defined, no-any-return]
