"""server/model/detok.py with the real 262k Gemma tokenizer: streaming text equals the full decode; stop strings."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.model.detok import IncrementalDetokenizer, StopMatcher

SAMPLES = [
    "Hello world",
    " leading space",
    "  two leading spaces and trailing  ",
    "line one\nline two\n\n\nthree blank\tand a tab",
    "한국어 텍스트입니다. 안녕하세요!",
    "中文文本测试，这是一个句子。",
    "emoji 🤖🎉 and a family 👩\u200d👩\u200d👧\u200d👦 and flags 🇰🇷",
    "rare characters 𝔘𓀀ꙮ𐍈 spelled in bytes",
    "naïve café — “quotes” «guillemets» ½ ∑ ≠",
    "code:\n```python\ndef f(x):\n    return x ** 2\n```\n",
]
END_OF_TURN, EOS, BOS = 106, 1, 2


def encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def byte_ids(tok: Any, text: str) -> list[int]:
    """text spelled entirely in byte-fallback tokens <0xNN>."""
    return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]


def stream(tok: Any, ids: list[int], **kw: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kw)
    return [detok.push(i) for i in ids] + [detok.flush()]


def check_stream(tok: Any, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    pieces = stream(tok, ids, skip_special_tokens=skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in pieces), pieces
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_equals_full_decode(gemma_tokenizer: Any, text: str) -> None:
    ids = encode(gemma_tokenizer, text)
    check_stream(gemma_tokenizer, ids)
    # The same text with chat specials around and inside it: skipped by default, kept when asked.
    with_specials = [BOS, *ids[:3], END_OF_TURN, *ids[3:], END_OF_TURN, EOS]
    assert "".join(stream(gemma_tokenizer, with_specials)) == gemma_tokenizer.decode(ids)
    check_stream(gemma_tokenizer, with_specials, skip_special_tokens=False)


def test_samples_really_use_byte_fallback(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, "𝔘𓀀")
    assert ids == byte_ids(gemma_tokenizer, "𝔘𓀀")  # the test above covers byte-fallback, not whole tokens


def test_byte_fallback_held_until_the_character_completes(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, "a") + byte_ids(gemma_tokenizer, "𝔘é") + encode(gemma_tokenizer, " b")
    pieces = stream(gemma_tokenizer, ids)
    assert pieces == ["a", "", "", "", "𝔘", "", "é", " b", ""]


def test_byte_run_continues_across_a_skipped_special(gemma_tokenizer: Any) -> None:
    smile = byte_ids(gemma_tokenizer, "😀")
    ids = [*smile[:2], END_OF_TURN, *smile[2:]]
    assert check_stream(gemma_tokenizer, ids) == ["", "", "", "", "😀", ""]


def test_first_token_keeps_its_leading_space(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, " Hello world")
    assert gemma_tokenizer.convert_ids_to_tokens(ids[0]).startswith("▁")
    pieces = check_stream(gemma_tokenizer, ids)
    assert pieces[0] == " Hello"


def test_dangling_bytes_come_out_at_flush_like_a_full_decode(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, "ok") + byte_ids(gemma_tokenizer, "😀")[:2]
    pieces = check_stream(gemma_tokenizer, ids)
    assert pieces[-1] == "\ufffd\ufffd" and "".join(pieces[:-1]) == "ok"


def test_a_real_replacement_character_token_is_not_held(gemma_tokenizer: Any) -> None:
    replacement = gemma_tokenizer.convert_tokens_to_ids("�")
    assert stream(gemma_tokenizer, [replacement]) == ["\ufffd", ""]


def test_invalid_byte_sequence_keeps_going(gemma_tokenizer: Any) -> None:
    # Documented divergence: ByteFallback turns the whole invalid run into U+FFFD, but we already streamed 'é'.
    ids = encode(gemma_tokenizer, "ab") + byte_ids(gemma_tokenizer, "é") + [gemma_tokenizer.convert_tokens_to_ids(
        "<0x80>")] + encode(gemma_tokenizer, "cd")
    assert "".join(stream(gemma_tokenizer, ids)) == "abé\ufffdcd"
    assert gemma_tokenizer.decode(ids) == "ab\ufffd\ufffd\ufffdcd"


def test_window_stays_bounded(gemma_tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(gemma_tokenizer)
    ids = encode(gemma_tokenizer, " ".join(SAMPLES) * 20)
    out = []
    for i in ids:
        out.append(detok.push(i))
        assert len(detok._ids) <= 8  # never the whole sequence
    assert "".join(out) + detok.flush() == gemma_tokenizer.decode(ids)


# Ids a model could emit: tokenizer output of arbitrary text, specials anywhere, characters spelled in bytes.
def _pieces(tok: Any) -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.text(max_size=12).map(lambda s: encode(tok, s)),
        st.sampled_from([[BOS], [EOS], [END_OF_TURN], [105], [107], [108]]),
        st.characters(codec="utf-8").map(lambda c: byte_ids(tok, c)),
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_property_streaming_equals_full_decode(gemma_tokenizer: Any, data: st.DataObject, skip: bool) -> None:
    chunks = data.draw(st.lists(_pieces(gemma_tokenizer), max_size=12))
    ids = [i for chunk in chunks for i in chunk]
    check_stream(gemma_tokenizer, ids, skip_special_tokens=skip)


# --- StopMatcher ------------------------------------------------------------------------------------------


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to the stop occurrence that ends first (ties: the one starting first)."""
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    return text[: min(hits)[1]], True


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    out: list[str] = []
    for chunk in chunks:
        text, hit = matcher.push(chunk)
        out.append(text)
        if hit:
            return "".join(out), True, out
    out.append(matcher.flush())
    return "".join(out), False, out


def test_stop_spanning_pushes_is_never_emitted() -> None:
    text, hit, out = run_matcher(["STOP"], ["hello S", "T", "OP world"])
    assert (text, hit) == ("hello ", True)
    assert out == ["hello ", "", ""]


def test_partial_match_is_released_when_it_fails_or_at_the_end() -> None:
    assert run_matcher(["STOP"], ["a ST", "ART"]) == ("a START", False, ["a ", "START", ""])
    assert run_matcher(["STOP"], ["a ST"]) == ("a ST", False, ["a ", "ST"])


def test_the_matcher_names_the_stop_that_completed_first() -> None:
    """Anthropic's `stop_sequence` names it (Finish.stop_sequence)."""
    matcher = StopMatcher(["world", "lo w", "xyz"])
    assert matcher.matched is None
    assert matcher.push("hello wor") == ("hel", True) and matcher.matched == "lo w"
    quiet = StopMatcher(["xyz"])
    quiet.push("hello")
    assert quiet.matched is None


def test_no_stops_is_a_pass_through() -> None:
    matcher = StopMatcher([])
    text = "anything at all"
    assert matcher.push(text)[0] is text and matcher.flush() == ""


def test_after_a_hit_nothing_more_comes_out() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.push("abxcd") == ("ab", True)
    assert matcher.push("more") == ("", True) and matcher.flush() == ""


def stream_until_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[bool, list[str]]:
    """What the engine does per token: detokenize, then match stops; (whether one hit, the text emitted)."""
    detok, matcher = IncrementalDetokenizer(tokenizer), StopMatcher(stops)
    emitted, hit = [], False
    for i in ids:
        text, hit = matcher.push(detok.push(i))
        emitted.append(text)
        if hit:
            break
    return hit, emitted


def test_stop_string_across_real_tokens(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, "The answer is 42.\nUser: what now?")
    hit, emitted = stream_until_stop(gemma_tokenizer, ids, ["\nUser:", "never"])
    assert hit and "".join(emitted) == "The answer is 42."
    assert all("\n" not in piece for piece in emitted)


def test_stops_inside_multibyte_characters(gemma_tokenizer: Any) -> None:
    ids = encode(gemma_tokenizer, "안녕하세요 세계 🤖 끝")
    hit, emitted = stream_until_stop(gemma_tokenizer, ids, ["세계 🤖"])
    assert hit and "".join(emitted) == "안녕하세요 "


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab\n c", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_property_any_chunking_cuts_at_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got, hit, pieces = run_matcher(stops, chunks)
    assert (got, hit) == reference_cut(text, stops)
    assert not any(s in got for s in stops)
    assert not any(s in piece for s in stops for piece in pieces)
