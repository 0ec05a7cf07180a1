"""The host's record of one KV slot (the cache itself lives with the graph): the token ids it holds, to find the
longest common prefix with the next prompt, and the last prefilled prompt's logits, so the same prompt again (the
2nd..nth choice of a request, a regenerated answer) costs no graph call. One slot today; one per slot with contract v3.

- The last prompt token is always recomputed when its logits were not kept: they are what the first token is
  sampled from, and the graph does not hand back logits it computed earlier.
- The graph has the last word on what it can keep: `rewind` answers where it can really continue (server.graphs.base).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)


class KVSlot:
    """Token ids whose KV one graph slot holds (`tokens[p]` sits at position p), and the kept last-prefill logits."""

    __slots__ = ("tokens", "_rewind", "_kept")

    def __init__(self, rewind: Callable[[int], int]) -> None:
        self.tokens: list[int] = []
        self._rewind = rewind  # the graph's: forget positions >= p, answer where the next write must start
        self._kept: tuple[list[int], torch.Tensor] | None = None  # (the last prefilled prompt, its last logits [1, 1, V])

    def reuse(self, prompt: Sequence[int], prefix_reuse: bool = True) -> tuple[int, torch.Tensor | None]:
        """Rewind the slot to what it can keep of `prompt`: (the position prefill starts at, the kept logits [1, 1, V]
        when the whole prompt is in the cache with its logits: then nothing is to be prefilled)."""
        ids = list(prompt)
        kept = self._kept
        if kept is not None and prefix_reuse and kept[0] == ids and self.tokens[: len(ids)] == ids:
            start = self._truncate(len(ids))
            if start == len(ids):
                return start, kept[1]  # Sampler.sample never modifies its input: the kept copy stays as it was
        self._kept = None  # whatever is prefilled next replaces it (and a cancelled prefill leaves none)
        common = 0
        for cached, wanted in zip(self.tokens if prefix_reuse else (), ids[:-1], strict=False):
            if cached != wanted:
                break
            common += 1
        return self._truncate(common), None

    def keep(self, prompt: Sequence[int], logits: torch.Tensor) -> None:
        """Remember a fully prefilled prompt's last logits [1, 1, V] for the same prompt again."""
        # A copy: a graph may hand back a view of an output buffer its next call overwrites.
        self._kept = (list(prompt), logits.clone())

    def reset(self) -> None:
        """Forget everything (after a fault: the cache's contents are no longer trusted)."""
        self.tokens, self._kept = [], None
        try:
            self._rewind(0)
        except Exception:  # noqa: BLE001 - a graph that cannot even rewind fails its next call, with that request
            log.exception("graph rewind failed")

    def _truncate(self, position: int) -> int:
        start = self._rewind(position)
        del self.tokens[start:]
        return start
