"""Chat protocols: how a model family's own format maps to OpenAI's chat API, between the API and the engine.

`protocol_of(tokenizer)` (or `detect_protocol(vocab, special_tokens)`) picks the protocol from the tokenizer: Gemma-4's
when all of its markers are single tokens, else the plain protocol (no native tool format: a request with `tools` is a
`ProtocolError`). The host asks once, at start-up; everything else is handed the answer. Each family owns its markers,
stop tokens and call grammar (gemma4.py, gemma4_grammar.py). Torch-free (`import server.protocol.gemma4` loads no
torch); see base.py for the interface.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

from server.protocol.base import (
    ChatProtocol,
    OutputParser,
    ParsedDelta,
    ParsedMessage,
    ParseEnd,
    PlainProtocol,
    PromptInputs,
    ProtocolError,
    ToolCallDelta,
    collect,
)
from server.protocol.gemma4 import Gemma4Protocol, is_gemma4

__all__ = ["ChatProtocol", "Gemma4Protocol", "OutputParser", "ParseEnd", "ParsedDelta", "ParsedMessage", "PlainProtocol",
           "PromptInputs", "ProtocolError", "ToolCallDelta", "collect", "detect_protocol", "protocol_of"]


def detect_protocol(vocab: Container[str], special_tokens: Iterable[str] = ()) -> ChatProtocol:
    """`vocab`: the tokenizer's token texts (only `in` is asked: `HostTokenizer.get_vocab()` or a lookup);
    `special_tokens`: its special tokens' texts
    (`{t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special}`)."""
    if is_gemma4(vocab):
        return Gemma4Protocol(frozenset(special_tokens))
    return PlainProtocol()


def protocol_of(tokenizer: Any) -> ChatProtocol:
    """The protocol of a `HostTokenizer` (or a transformers fast tokenizer): its markers looked up one by one."""
    return detect_protocol(_TokenTexts(tokenizer), _special_tokens(tokenizer))


class _TokenTexts:
    """`text in vocabulary`, one lookup per question. The protocol asks about a handful of markers; building the whole
    262k-entry `get_vocab()` dict for that took 0.35 s of start-up and left its freed heap resident."""

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._contains = ((lambda text: backend.token_to_id(text) is not None) if backend is not None
                          else tokenizer.get_vocab().__contains__)

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self._contains(text)


def _special_tokens(tokenizer: Any) -> list[str]:
    """The texts of the tokenizer's special added tokens (what skip_special_tokens would remove)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    return [token.content for token in backend.get_added_tokens_decoder().values() if token.special]
