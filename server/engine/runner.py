"""`Runner`, the only caller of the graph (server.graphs.base `Graph`): each call timed where the watchdog sees it
(`DeviceWatch`), its KV recorded in the rows' slots; `Abandoned` when the watchdog gave up on it meanwhile.

The decode fast path (measured; keep it when changing this file):
- publish on submit: the held tokens' Deltas go out from the graph's `on_submit` callback, right before every call's
  device work, a prefill chunk's too (why then: server.graphs.base; later, the client would wait for the whole device
  step). A call that fails before submitting publishes them afterwards: no token is ever lost.
- positions pre-built: one [1, 1] tensor per position, made once, for the one-row step (a fresh `torch.tensor` per
  token is a call on the critical path); a step of B rows builds its [B, 1] in one call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from server.graphs.base import Graph, VisionEncoder
from server.model.embedding import HostEmbedding

if TYPE_CHECKING:
    from server.engine.sequence import Sequence as Seq
    from server.engine.types import ImageInput


class Abandoned(Exception):
    """The watchdog gave up on the current graph call; its requests already got an error."""


@dataclass(slots=True)
class DeviceWatch:
    """What the device-owner thread and the watchdog both touch: read and written under the engine's lock only."""

    rows: tuple[Seq, ...] = ()  # the sequences of the graph call running now
    step_started: float | None = None  # while a graph call runs
    abandoned: bool = False  # the watchdog gave up on the current call
    stall: str | None = None  # why, until that call returns
    steps: dict[int, int] = field(default_factory=dict)  # rows per graph call -> how many calls had that many
    calls: int = 0  # every graph call so far
    device_s: float = 0.0  # and the time inside them

    def recovered(self) -> None:
        """An abandoned call has returned (or raised): the device answers again."""
        if self.abandoned:
            self.abandoned, self.stall = False, None


class Runner:
    """One graph call per method: `prefill` (one chunk of one sequence) and `decode` (one token of each row)."""

    def __init__(self, graph: Graph, embedding: HostEmbedding, lock: threading.Condition, watch: DeviceWatch,
                 vision: VisionEncoder | None = None) -> None:
        self.graph = graph
        self.embedding = embedding
        # Encodes a prompt's images: a host encoder on a host worker once the sequence is admitted (its future in
        # `Sequence.encoded`), a device one on this (the device) thread right before the image's chunk.
        self.vision = vision
        self._lock = lock
        self.watch = watch
        self._positions = [torch.tensor([[p]]) for p in range(graph.max_total)]  # [1, 1] each: the one-row fast path

    def prefill(self, seq: Seq, begin: int, end: int, *, last_only: bool,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """seq's ids[begin:end] into its slot at positions begin..end-1: logits [1, T, V], or [1, 1, V] of the chunk's
        last position with `last_only`. `on_submit` publishes the held tokens."""
        kv = seq.kv
        assert kv is not None
        chunk = seq.token_ids[begin:end]
        embeds = self.embedding.lookup(chunk)  # [1, T, H]
        positions = torch.arange(begin, end).unsqueeze(0)  # [1, T]
        images = [image for image in seq.handle.request.images if begin <= image.offset < end]
        blocks: dict[str, torch.Tensor] = {}
        if images:
            embeds, blocks["block_ids"] = self._splice(embeds, begin, end, images, seq.encoded)
        logits = self._call((seq,), lambda submit: self.graph.prefill(embeds, positions, kv.index, last_only=last_only,
                                                                      on_submit=submit, **blocks), publish=on_submit)
        kv.tokens.extend(seq.prompt_keys[begin:end])  # a prefill chunk is always of the prompt
        return logits

    def encode(self, image: ImageInput) -> torch.Tensor:
        """One image's soft tokens [N, H] (any thread: a host encoder runs on a worker)."""
        if self.vision is None:
            raise RuntimeError("a prompt with images reached an engine without a vision encoder")
        pixels = torch.from_numpy(image.pixel_values).unsqueeze(0)  # [1, P, D]
        patches = torch.from_numpy(image.position_ids).unsqueeze(0)  # [1, P, 2]
        soft = self.vision.encode(pixels, patches, image.budget)  # [N, H]
        if soft.shape[0] != image.soft_tokens:
            raise RuntimeError(f"the vision encoder gave {soft.shape[0]} soft tokens for an image the processor "
                               f"counted {image.soft_tokens}")
        return soft

    def _splice(self, embeds: torch.Tensor, begin: int, end: int, images: Sequence[ImageInput],
                encodes: Mapping[int, Future[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images' soft tokens written over their placeholder rows of `embeds` [1, T, H], and the chunk's block ids
        [1, T] (0 on text, image i of the chunk: i + 1), as server.graphs.base's image-block contract says. An image
        a worker encoded (`encodes`, by offset: done, the sequence was ready) is taken from there."""
        if self.vision is None:
            raise RuntimeError("a prompt with images reached an engine without a vision encoder")
        embeds = embeds.clone()
        block_ids = torch.zeros(1, end - begin, dtype=torch.int64)  # [1, T]
        for number, image in enumerate(images, start=1):
            first, last = image.span
            assert last <= end, "an image block straddles two prefill chunks (the plan keeps them whole)"
            encoded = encodes.get(image.offset)
            soft = encoded.result() if encoded is not None else self.encode(image)  # [N, H]
            embeds[0, first - begin : last - begin] = soft.to(embeds.dtype)
            block_ids[0, first - begin : last - begin] = number
        return embeds, block_ids

    def decode(self, rows: Sequence[Seq], on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """Each row's last token into its slot at its next position: logits [B, V]. `on_submit` publishes the held
        tokens."""
        kvs = [seq.kv for seq in rows]
        tokens = [seq.token_ids[-1] for seq in rows]
        if len(rows) == 1:
            embeds = self.embedding.lookup(tokens)  # [1, 1, H]
            positions = self._positions[len(kvs[0].tokens)]  # type: ignore[union-attr]  # [1, 1]
        else:
            embeds = self.embedding.lookup(tokens).view(len(rows), 1, -1)  # [1, B, H] -> [B, 1, H]
            positions = torch.tensor([[len(kv.tokens)] for kv in kvs])  # type: ignore[union-attr]  # [B, 1]
        slots = [kv.index for kv in kvs]  # type: ignore[union-attr]
        logits = self._call(rows, lambda submit: self.graph.decode(embeds, positions, slots, on_submit=submit),
                            publish=on_submit)  # [B, V]
        for kv, token in zip(kvs, tokens, strict=True):
            kv.tokens.append(token)  # type: ignore[union-attr]
        return logits

    def copy_slot(self, src: Seq, dst: Seq) -> None:
        """dst's slot takes a copy of src's KV (n > 1: a prompt prefilled once). Not a step: no row decodes in it."""
        assert src.kv is not None and dst.kv is not None
        self.graph.copy_slot(src.kv.index, dst.kv.index)

    def _call(self, rows: tuple[Seq, ...] | Sequence[Seq], call: Callable[[Callable[[], None]], torch.Tensor],
              publish: Callable[[], None] | None = None) -> torch.Tensor:
        """One graph call for `rows`; `publish` runs once: when the graph submits its device work, or after a failure
        before that. Counts the call and its device time for every row."""
        watch = self.watch
        with self._lock:
            watch.rows, watch.step_started = tuple(rows), (started := time.monotonic())
        submitted: float | None = None

        def on_submit() -> None:
            nonlocal submitted
            if submitted is None:
                submitted = time.monotonic()
                if publish is not None:
                    publish()

        try:
            logits = call(on_submit)
        finally:
            if submitted is None and publish is not None:
                publish()
            # Device time from the submission on: building the call's inputs is the host's work, not the device's.
            device_s = time.monotonic() - (submitted or started)
            with self._lock:
                watch.step_started, watch.rows = None, ()
                watch.steps[len(rows)] = watch.steps.get(len(rows), 0) + 1
                watch.calls += 1
                watch.device_s += device_s
                abandoned = watch.abandoned
            for seq in rows:
                seq.graph_calls += 1
                seq.device_s += device_s
        if abandoned:
            raise Abandoned
        return logits
