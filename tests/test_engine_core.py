"""The engine core stepped by hand (no thread): which rows each graph call carried, in which slot and at which
positions, and each request's state after every step; held tokens go out on every graph call, a newcomer's prefill
chunks included; the scheduling policy is swappable; host work (`Sequence.preparing`) holds a sequence back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import pytest

from server.engine.scheduler import Alternate, DecodeStep, PrefillStep, Step
from server.engine.sequence import Sequence as Seq
from server.engine.sequence import State
from tests.support.core import Call, Walk, prompt_of


@pytest.fixture
def walk(request: pytest.FixtureRequest) -> Iterator[Walk]:
    walk = Walk(bucket=8, **getattr(request, "param", {}))
    yield walk
    walk.close()


def states(walk: Walk) -> list[State]:
    return [seq.state for seq in walk.core.records.values()]


@pytest.mark.parametrize("walk", [{"policy": Alternate()}], indirect=True)
def test_step_runs_one_graph_call_and_says_which_rows_it_carried(walk: Walk) -> None:
    """Two requests, under the first-come, first-served policy (`Alternate`; the default's order is
    test_scheduler's): the first's three chunks, its first decode beside nothing, the second's chunk, then one decode
    step of both rows; every step is one call, and the records' states follow it."""
    a = walk.submit(prompt_of(20), 3)
    b = walk.submit(prompt_of(5, start=900), 2)
    seq_a, seq_b = walk.core.records[a], walk.core.records[b]
    assert states(walk) == [State.WAITING, State.WAITING]

    steps: list[Step | None] = []
    seen: list[list[State]] = []
    while (step := walk.core.step()) is not None:
        steps.append(step)
        seen.append(states(walk))
    assert seq_a.kv is not None and seq_b.kv is not None and seq_a.kv.index != seq_b.kv.index
    slot_a, slot_b = seq_a.kv.index, seq_b.kv.index

    assert [(type(s).__name__, [r.handle for r in s.rows]) for s in steps if s is not None] == [
        ("PrefillStep", [a]), ("PrefillStep", [a]), ("PrefillStep", [a]), ("DecodeStep", [a]),
        ("PrefillStep", [b]), ("DecodeStep", [a, b])]
    assert walk.graph.log == [
        Call("prefill", (slot_a,), tuple(range(0, 8))), Call("prefill", (slot_a,), tuple(range(8, 16))),
        Call("prefill", (slot_a,), tuple(range(16, 20))), Call("decode", (slot_a,), (20,)),
        Call("prefill", (slot_b,), tuple(range(0, 5))), Call("decode", (slot_a, slot_b), (21, 5))]
    P, F, D, W = State.PREFILLING, State.FINISHED, State.DECODING, State.PREPARING
    assert seen == [[P, W], [P, W], [D, W], [D, W], [D, D], [F, F]]
    for handle, n in ((a, 3), (b, 2)):
        finish = walk.finish(handle)
        assert finish is not None and finish.reason == "length" and finish.completion_tokens == n
        assert len(walk.tokens(handle)) == n
    assert walk.core.live == 0 and not walk.core.busy


def test_held_tokens_go_out_when_a_newcomers_prefill_chunk_is_submitted(walk: Walk) -> None:
    """While a newcomer's chunks run, each decoding stream's newest token reaches its caller before the chunk
    completes: the chunk's submission publishes it, not the next decode step."""
    a = walk.submit(prompt_of(4), 40)
    while walk.core.records[a].state is not State.DECODING:
        walk.core.step()
    b = walk.submit(prompt_of(40, start=900), 2)
    seq_a = walk.core.records[a]
    at_chunks: list[tuple[int, int]] = []

    def during(call: Call) -> None:
        if call.kind == "prefill":  # inside the newcomer's chunk, after its submission
            at_chunks.append((len(walk.tokens(a)), seq_a.generated))

    walk.graph.during = during
    while walk.core.records[b].state is not State.DECODING:
        walk.core.step()
    assert len(at_chunks) == 5  # 40 tokens in chunks of 8, each beside a decode step of the running stream
    assert all(delivered == generated for delivered, generated in at_chunks), at_chunks


def test_the_policy_is_swappable() -> None:
    """A policy that decodes whenever a sequence decodes holds the newcomer's prefill until the first stream ends."""

    class DecodeFirst:
        def next_step(self, prefilling: Sequence[Seq], decoding: Sequence[Seq]) -> Step | None:
            if decoding:
                return DecodeStep(tuple(decoding))
            return PrefillStep.next_of(prefilling[0]) if prefilling else None

    walk = Walk(bucket=8, policy=DecodeFirst())
    try:
        a = walk.submit(prompt_of(4), 5)
        walk.core.step()  # a's prefill: it decodes from now on
        b = walk.submit(prompt_of(12, start=900), 1)
        while walk.core.step() is not None:
            pass
        kinds = [(call.kind, call.slots) for call in walk.graph.log]
        slot_a = kinds[0][1]
        assert kinds[:5] == [("prefill", slot_a)] + [("decode", slot_a)] * 4
        assert [kind for kind, _ in kinds[5:]] == ["prefill", "prefill"]  # b's two chunks, after a ended
        assert walk.finish(a) is not None and walk.finish(b) is not None
    finally:
        walk.close()


def test_host_work_holds_a_sequence_back_until_it_is_done(walk: Walk) -> None:
    """A sequence whose readiness stage has work pending keeps its slot but gets no graph call; once the work is done
    it is scheduled; work that failed ends it with the error and frees its slot."""
    slow = walk.submit(prompt_of(6), 2)
    broken = walk.submit(prompt_of(6, start=700), 2)
    other = walk.submit(prompt_of(6, start=900), 2)
    pending: Future[None] = Future()
    failing: Future[None] = Future()
    walk.core.records[slow].preparing.append(pending)
    walk.core.records[broken].preparing.append(failing)
    walk.core.step()
    assert [walk.core.records[h].state for h in (slow, broken, other)] == [State.PREPARING, State.PREPARING,
                                                                         State.DECODING]
    failing.set_exception(RuntimeError("encode failed"))
    while walk.core.step() is not None:
        pass
    finish = walk.finish(broken)
    assert finish is not None and finish.reason == "error" and "encode failed" in (finish.error or "")
    assert walk.finish(other) is not None and walk.core.records[slow].state is State.PREPARING
    assert walk.core.busy and len(walk.core.scheduler.slots.free) == 3  # only the held one keeps a slot
    pending.set_result(None)
    while walk.core.step() is not None:
        pass
    done = walk.finish(slow)
    assert done is not None and done.reason == "length" and done.completion_tokens == 2


def test_choices_share_one_prefill_and_decode_together(walk: Walk) -> None:
    """n > 1 on a graph that copies slots: the three choices are admitted together, the first prefills the prompt,
    its slot is copied into the others' and all three sample from its logits, then decode in batches of three."""
    prompt = prompt_of(10)
    handles = walk.choices(prompt, 3, 3)
    walk.core.step()  # the first chunk (8 of 10)
    assert [walk.core.records[h].state for h in handles] == [State.PREFILLING, State.PREPARING, State.PREPARING]
    walk.core.step()  # the last chunk: the copies, three first tokens
    assert [walk.core.records[h].state for h in handles] == [State.DECODING] * 3
    while walk.core.step() is not None:
        pass
    assert [call.kind for call in walk.graph.log] == ["prefill", "prefill", "decode", "decode"]
    assert all(len(call.slots) == 3 for call in walk.graph.log[2:])
    assert walk.tokens(handles[0]) == walk.tokens(handles[1]) == walk.tokens(handles[2])  # greedy, the same logits
    finishes = [walk.finish(h) for h in handles]
    assert [(f.prefill_calls, f.reused_tokens) for f in finishes if f is not None] == [(2, 0), (0, 10), (0, 10)]
    assert len(walk.core.scheduler.slots.free) == 4


def test_a_cancelled_source_hands_its_prompt_to_the_next_choice(walk: Walk) -> None:
    """The choice that prefills for the others is cancelled mid-prompt: the next prefills it, the last copies it."""
    prompt = prompt_of(20)
    first, second, third = walk.choices(prompt, 2, 3)
    walk.core.step()
    first.cancel()
    while walk.core.step() is not None:
        pass
    finishes = [walk.finish(h) for h in (first, second, third)]
    assert [f.reason for f in finishes if f is not None] == ["cancelled", "length", "length"]
    assert [f.prefill_calls for f in finishes if f is not None] == [1, 3, 0]
    assert walk.tokens(second) == walk.tokens(third) and len(walk.core.scheduler.slots.free) == 4


def test_a_choice_runs_after_the_one_before_it_and_finds_its_prompt_cached(walk: Walk) -> None:
    """n > 1 on a graph that cannot copy slots: the second choice of the same prompt waits (a slot is free) until the
    first ended, then samples from the first's kept logits: no graph call for its prompt."""
    walk.graph.copies_slots = False
    prompt = prompt_of(10)
    first, second = walk.choices(prompt, 2, 2)
    walk.core.step()
    assert walk.core.records[second].state is State.WAITING and walk.core.scheduler.has_room
    while walk.core.step() is not None:
        pass
    prefills = [call for call in walk.graph.log if call.kind == "prefill"]
    assert len(prefills) == 2  # the first choice's chunks (8 + 2); none for the second
    assert walk.tokens(first) == walk.tokens(second)  # greedy from the same logits
    finish = walk.finish(second)
    assert finish is not None and finish.reused_tokens == len(prompt) and finish.prefill_calls == 0


def test_a_cancelled_prefill_ends_between_two_calls(walk: Walk) -> None:
    long = walk.submit(prompt_of(30), 4)
    walk.core.step()
    long.cancel()
    walk.core.step()
    finish = walk.finish(long)
    assert finish is not None and finish.reason == "cancelled" and len(walk.graph.log) == 1
    assert not walk.core.busy and len(walk.core.scheduler.slots.free) == 4


def test_the_same_prompt_submitted_apart_runs_side_by_side(walk: Walk) -> None:
    """Only the choices of one submission wait for each other: two users' identical prompts take two slots at once."""
    prompt = prompt_of(6)
    first, second = walk.submit(prompt, 3), walk.submit(prompt, 3)
    for _ in range(3):  # first's prefill, its decode step, second's prefill
        walk.core.step()
    assert [walk.core.records[h].state for h in (first, second)] == [State.DECODING, State.DECODING]
    assert len({call.slots for call in walk.graph.log if call.kind == "prefill"}) == 2
