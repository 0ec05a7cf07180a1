"""Chat protocols: how a model family's own format maps to OpenAI's chat API, between the API and the engine.

`detect_protocol(vocab, special_tokens)` picks the protocol from the tokenizer: Gemma-4's when all of its markers
are single tokens, else the plain protocol (no native tool format: a request with `tools` is a `ProtocolError`).
Torch-free (`import server.protocol.gemma4` loads no torch); see base.py for the interface.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

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
           "PromptInputs", "ProtocolError", "ToolCallDelta", "collect", "detect_protocol"]


def detect_protocol(vocab: Container[str], special_tokens: Iterable[str] = ()) -> ChatProtocol:
    """`vocab`: the tokenizer's token texts (only `in` is asked: `HostTokenizer.get_vocab()` or a lookup);
    `special_tokens`: its special tokens' texts
    (`{t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special}`)."""
    if is_gemma4(vocab):
        return Gemma4Protocol(frozenset(special_tokens))
    return PlainProtocol()
