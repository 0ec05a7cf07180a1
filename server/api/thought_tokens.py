"""How many generated tokens an answer's thought took (usage's `reasoning_tokens` / `thinking_tokens`), counted as
the parser reads the engine's deltas: the tokens before the answer (visible text or a call) began, when there was a
thought; all of them when the answer never began (a cut thought, or an empty answer after one)."""

from __future__ import annotations

from server.engine.types import Delta
from server.protocol import ParsedDelta


class ThoughtTokens:
    def __init__(self) -> None:
        self.count = 0
        self._tokens = 0  # generated tokens fed so far
        self._before = 0  # ... before the current feed
        self._thought = False
        self._answered = False

    def feed(self, delta: Delta, parsed: ParsedDelta) -> None:
        """One engine delta and what the parser made of its text."""
        self._before = self._tokens
        self._tokens += delta.token_id is not None
        self._see(parsed)

    def finish(self, parsed: ParsedDelta) -> int:
        """What the parser's finish() added; the count, final."""
        self._before = self._tokens
        self._see(parsed)
        if self._thought and not self._answered:
            self.count = self._tokens
        return self.count

    def _see(self, parsed: ParsedDelta) -> None:
        self._thought = self._thought or bool(parsed.reasoning)
        if (parsed.content or parsed.tool_calls) and not self._answered:
            self._answered = True
            if self._thought:
                self.count = self._before
