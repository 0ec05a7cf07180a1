"""Chat protocols: how a model family's own format maps to OpenAI's chat API, between the API and the engine.

The host detects the protocol once, at start-up (`protocol_of`), and hands the answer to everything else: Gemma-4's
when all of its markers are single tokens, else the plain protocol (no native tool format: a request with `tools` is a
`ProtocolError`). Each family owns its markers, stop tokens and call grammar (gemma4.py, gemma4_grammar.py).
Torch-free; the interface: base.py.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

from server.protocol.base import (
    ChatProtocol,
    OutputParser,
    ParsedDelta,
    PlainProtocol,
    PromptInputs,
    ProtocolError,
    ToolCallDelta,
    collect,
)
from server.protocol.gemma4 import Gemma4Protocol, is_gemma4

__all__ = ["ChatProtocol", "Gemma4Protocol", "OutputParser", "ParsedDelta", "PlainProtocol", "PromptInputs", "ProtocolError",
           "ToolCallDelta", "collect", "detect_protocol", "protocol_of"]


def detect_protocol(vocab: Container[str], special_tokens: Iterable[str] = ()) -> ChatProtocol:
    """`vocab`: the tokenizer's token texts (only `in` is asked); `special_tokens`: its special tokens' texts."""
    if is_gemma4(vocab):
        return Gemma4Protocol(frozenset(special_tokens))
    return PlainProtocol()


def protocol_of(tokenizer: Any) -> ChatProtocol:
    """The protocol of a `HostTokenizer` (or a transformers fast tokenizer)."""
    backend = tokenizer.backend_tokenizer
    specials = [token.content for token in backend.get_added_tokens_decoder().values() if token.special]
    return detect_protocol(_TokenTexts(backend.token_to_id), specials)


class _TokenTexts:
    """`text in vocabulary`, one lookup per question. The protocol asks about a handful of markers; building the whole
    262k-entry `get_vocab()` dict for that took 0.35 s of start-up and left its freed heap resident."""

    def __init__(self, token_to_id: Callable[[str], int | None]) -> None:
        self._token_to_id = token_to_id

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self._token_to_id(text) is not None
