"""Token ids -> text deltas, one token at a time, and stop strings that may span tokens.

IncrementalDetokenizer: the prefix_offset/read_offset scheme of vLLM and TGI. Each push decodes a small window
(the tokens of the last emitted chunk as context, plus the tokens not yet emitted) twice and returns the
difference, so the cost is bounded by the window, never by the sequence length.

Why not `tokenizers.decoders.DecodeStream` (checked, tokenizers 0.23): it decides "character incomplete" by
the decoded text ending in U+FFFD, yet Gemma's vocabulary has real tokens that *are* U+FFFD (e.g. id 238479),
which it would then hold until some later token; and it has no flush, so bytes left dangling at the end of a
generation would be lost instead of showing as U+FFFD the way a full decode shows them. Here incompleteness
is judged on the bytes themselves: Gemma spells rare characters with byte-fallback tokens `<0xNN>`, and we
track the trailing run of those with Python's incremental UTF-8 decoder, holding text while it is mid-character.

Contract: the concatenation of push() outputs and flush() equals
`tokenizer.decode(ids, skip_special_tokens=...)` for any ids whose byte-fallback runs are valid UTF-8 (all
text the tokenizer itself encodes). Deliberate exception: when the model emits an *invalid* byte sequence,
the tokenizer's ByteFallback decoder turns the whole run into U+FFFD, including characters of that run we
already streamed; we do not delay every byte-spelled character to cover that case, so only the number of
U+FFFD may then differ.

StopMatcher: emits text as soon as it can no longer be the start of a stop string; the stop that ends first
wins (ties: the one starting first), so the result does not depend on how the text was chunked.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import Any

# Per backend tokenizer: byte-fallback token id -> byte value, and the ids the decoder drops as special.
# Built once per tokenizer (the added-token table has ~6k entries), not once per request.
_TABLES: weakref.WeakKeyDictionary[Any, tuple[dict[int, int], frozenset[int]]] = weakref.WeakKeyDictionary()


def _tables(backend: Any) -> tuple[dict[int, int], frozenset[int]]:
    tables = _TABLES.get(backend)
    if tables is None:
        byte_of = {}
        for value in range(256):
            token_id = backend.token_to_id(f"<0x{value:02X}>")  # ByteFallback's spelling of a raw byte
            if token_id is not None:
                byte_of[token_id] = value
        special = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        tables = _TABLES[backend] = (byte_of, special)
    return tables


class IncrementalDetokenizer:
    """push(token_id) -> new text; never returns part of a UTF-8 character; flush() at the end."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        # A transformers fast tokenizer (or a bare tokenizers.Tokenizer). transformers' decode of a BPE tokenizer
        # is exactly its backend's decode, so decoding with the backend skips a Python layer per call.
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._backend = backend
        self._skip = skip_special_tokens
        self._byte_of, special = _tables(backend)
        # Tokens the decoder drops: they neither show up nor end a byte run.
        self._invisible = special if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the window: the last emitted chunk's tokens (context), then unemitted ones
        self._read = 0  # ids before this are emitted (vLLM's read_offset; the window starts at its prefix_offset)
        self._utf8 = codecs.getincrementaldecoder("utf-8")()  # the trailing byte-fallback run's bytes
        self._run_broken = False  # the current byte run is already invalid UTF-8: nothing to wait for

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        byte = self._byte_of.get(token_id)
        if byte is not None:
            if not self._run_broken:
                try:
                    self._utf8.decode(bytes((byte,)))
                except UnicodeDecodeError:
                    self._run_broken = True
                    self._utf8.reset()
            if self._utf8.getstate()[0]:
                return ""  # mid-character: wait for the rest of its bytes
        elif token_id in self._invisible:
            if self._utf8.getstate()[0]:
                return ""  # dropped by the decoder, so the byte run goes on after it
        else:
            self._utf8.reset()
            self._run_broken = False
        return self._emit()

    def flush(self) -> str:
        """Whatever is still held (an unfinished character decodes to U+FFFD, as in a full decode)."""
        self._utf8.reset()
        self._run_broken = False
        return self._emit() if self._read < len(self._ids) else ""

    def _emit(self) -> str:
        ids = self._ids
        prefix_text = self._backend.decode(ids[: self._read], skip_special_tokens=self._skip)
        text = self._backend.decode(ids, skip_special_tokens=self._skip)
        if not self._byte_of and text.endswith("\ufffd"):
            return ""  # byte-level BPE (no byte tokens): the vLLM heuristic, an incomplete character decodes so
        if text.startswith(prefix_text):
            new = text[len(prefix_text) :]
        else:
            # Only after an invalid byte run (see the module docs): emit the new tokens on their own.
            new = self._backend.decode(ids[self._read :], skip_special_tokens=self._skip)
        # The emitted tokens become the next window's context; older ones are dropped (bounded window).
        del ids[: self._read]
        self._read = len(ids)
        return new


class StopMatcher:
    """push(text) -> (text safe to emit now, stop hit?); holds back any suffix that may grow into a stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "empty stop strings are rejected by the HTTP layer"
        self._stops = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.hit = False
        self.matched: str | None = None  # the stop string that was hit (the API names it: Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        if self.hit:
            return "", True
        buf = self._held + text
        # Every occurrence that ends in buf starts in buf: anything that could still begin one was held back.
        best: tuple[int, int, str] | None = None  # (end, start, stop) of the stop that completes first
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self.hit = True
            self.matched = best[2]
            self._held = ""
            return buf[: best[1]], True
        keep = 0
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                keep = n
                break
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a generation that hit no stop."""
        held, self._held = self._held, ""
        return "" if self.hit else held
