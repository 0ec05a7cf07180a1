"""The compiled graph: `torch.jit.load` of `sqz_neff.pt` (Neuron) or `model.pt` (the same contract traced on CPU).

The contract (ARCHITECTURE.md), built here from positions so the rest of the server never sees it:

    model(inputs_embeds f32 [1,T,H], position_ids int64 [1,T],
          onehot f32 [1,1,MAX,T], full_mask f32 [1,1,T,MAX], sliding_mask f32 [1,1,T,MAX]) -> logits [1,T,V]

What the call returns depends on the target: on Neuron (ModelBuilder's `sqz_neff.pt`) the logits alone, because
NxD drops aliased outputs and the KV stays on the device in `nxd_model.state`; on the CPU trace (`model.pt`)
`(logits, *kv)`, the KV also written into the module's buffers. Only the logits are read here.

T is exactly BUCKET (prefill) or 1 (decode): ModelBuilder routes by shape and an unknown shape raises,
so a short prefill chunk is padded here. Pad positions continue past the last real one; their KV writes
land in slots no real query has seen yet, and later decode steps overwrite them before any query can.

Contract v2 (`JitGraphV2`) takes embeds and positions only; contract v3 (`JitGraphV3`) adds slot ids and decode
graphs over several rows. All three answer graphs/base.py's `Graph`; v1 and v2 as one-slot graphs.

Last-row builds (graph.json `prefill_logits: "last"`, issue 34): a v2/v3/v4 prefill graph takes `last_index [1]`
int64 after its other inputs (the chunk's last real row; pads follow it) and returns that row's logits [1, 1, V], so a
chunk costs one row of norm + lm_head, not [T, V]. A scored prompt (`last_only=False`) runs the score graph instead (no
last_index, every row), compiled at the smallest bucket (`score_buckets`): a longer chunk goes through it in pieces of
that size, one call each, in order (the KV they write is the chunk's). v4 compiles its score graph at the largest
context bucket only, so a scored piece's table is that wide. Builds without the record run as before.

Image blocks (a `--vision` build, graph.json `block_ids`): v2's and v3's prefill graphs take `block_ids [1, T]` int64
last (0 = text, one id > 0 per image; graphs/base.py `VisionEncoder`), padded here with 0 like the chunk; decode takes
none. `image_blocks` says whether a graph has that input; one without it refuses block ids that name an image (it
would attend causally where the model attends both ways) and takes all-text ones as it always did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from server.graphs.base import DTYPES, OneSlotGraph, checked_slots, decode_batch_for
from server.graphs.blocks import DECODE_COST_26B, KVBlocks, decode_calls
from server.model.artifacts import GraphSpec
from server.vendor.neuron_prelude import prepare_neuron_imports

log = logging.getLogger(__name__)


def load_compiled(path: Path | str, contract: str) -> torch.jit.ScriptModule:
    """The published build's proven load, for every contract: NxD's model builder imported first (through the
    prelude: it registers `neuron.SPMDModel`), then `torch.jit.load` with no map_location, as the published deploy
    script, NxD and NxD Inference call it: a Neuron graph's saved weights must stay what they are for NxD's
    initialisation (mapped to the CPU they would be ~26.7 GB of host tensors the device never reloads). A
    CPU-traced graph holds CPU tensors and loads the same way."""
    runtime = prepare_neuron_imports()
    log.info("loading compiled graph %s (%s, neuron runtime: %s)", path, contract, runtime or "none, CPU TorchScript")
    module: torch.jit.ScriptModule = torch.jit.load(str(path))
    return module


def neuron_model(module: torch.jit.ScriptModule) -> Any | None:
    """NxD's model inside a Neuron build (what its weights are pushed through); None for a CPU trace."""
    return getattr(module, "nxd_model", None)


def push_weights(module: torch.jit.ScriptModule, weights: list[dict[str, torch.Tensor]], start_rank: int,
                 prefix: str = "") -> None:
    """Per-rank memory-mapped weights (server/model/weights.py) into a loaded graph: NxD's own initialisation on
    Neuron (what ModelBuilder.trace does with its shards); on a CPU trace, one rank's put on the module by name."""
    from server.model.weights import attach_weights

    nxd = neuron_model(module)
    if nxd is not None:
        nxd.initialize(weights, torch.tensor([start_rank], dtype=torch.int32))
        return
    if len(weights) != 1:
        raise ValueError(f"a CPU graph runs one rank, graph.json lists {len(weights)} weight files")
    log.info("attached %.1f MB of memory-mapped weights", attach_weights(module, weights[0], prefix=prefix) / 1e6)


class ContractInputs:
    """Builds onehot / full_mask / sliding_mask for given positions (shapes of the contract above)."""

    def __init__(self, max_total: int, sliding_window: int | None, dtype: torch.dtype) -> None:
        self.max_total = max_total
        self.window = sliding_window or max_total
        self.dtype = dtype
        self.slots = torch.arange(max_total)  # [MAX]
        self.neg = torch.finfo(dtype).min
        # Decode inputs depend on the position alone: built once per position (at most MAX x 3 rows of MAX floats,
        # 3 MB at MAX=512), so a decode step costs a dict lookup instead of ten small torch calls.
        self._decode: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def build(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if positions.shape[1] == 1:
            position = int(positions)  # [1, 1]: one element, read without indexing (one torch call, not two)
            cached = self._decode.get(position)
            if cached is None:
                cached = self._decode[position] = self._build(positions)
            return cached
        return self._build(positions)

    def _build(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pos = positions[0]  # [T]
        onehot = (self.slots[:, None] == pos[None, :]).to(self.dtype)  # [MAX, T]; pads beyond MAX write nowhere
        seen = self.slots[None, :] <= pos[:, None]  # [T, MAX]
        in_window = self.slots[None, :] > (pos[:, None] - self.window)  # [T, MAX]
        zero = torch.zeros((), dtype=self.dtype)
        full = torch.where(seen, zero, self.neg)  # [T, MAX]
        sliding = torch.where(seen & in_window, zero, self.neg)  # [T, MAX]
        return onehot[None, None], full[None, None], sliding[None, None]


class _CompiledGraph:
    """What both contracts share: the loaded module, the facts the engine reads, and a call that pads a short chunk
    to the smallest bucket that holds it (pad positions continuing past the last real one) and reads back the logits.
    A contract adds its own inputs after embeds and positions (`_contract_inputs`)."""

    name = "jit"

    def __init__(self, path: Path | str, spec: GraphSpec, contract: str, *, vocab_size: int, final_softcap: float | None) -> None:
        self.module = load_compiled(path, contract)
        self.max_total = spec.max_total
        self.prefill_buckets = spec.buckets
        self.prefill_bucket = max(spec.buckets)
        self.input_dtype = DTYPES[spec.input_dtype]
        self.vocab_size = vocab_size
        self.host_softcap = None if spec.softcap_in_graph else final_softcap
        # chunk length -> the bucket it runs at (the smallest that holds it); 1 is the decode graph
        self._bucket_for = {t: next(b for b in spec.buckets if b >= t) for t in range(2, self.prefill_bucket + 1)}
        self._bucket_for[1] = 1
        self.image_blocks = spec.block_ids  # the prefill graphs take block_ids (the module docs)
        self.last_rows = spec.last_logits  # prefill graphs take last_index and return one row (the module docs)
        self.score_bucket = max(spec.score_buckets) if spec.score_buckets else 0
        self._last_index = [torch.tensor([i], dtype=torch.int64) for i in range(self.prefill_bucket)]  # [1] each

    def _block_inputs(self, block_ids: torch.Tensor | None, t: int, bucket: int) -> tuple[torch.Tensor, ...]:
        """The prefill's block_ids input for a chunk of t tokens run at `bucket` (1: decode, which takes none):
        padded with 0 (text) to the bucket; all text when None. () for a graph without the input."""
        if block_ids is not None and block_ids.shape != (1, t):
            raise ValueError(f"block_ids must be [1, {t}] like the positions, got {tuple(block_ids.shape)}")
        if not self.image_blocks or bucket == 1:
            if block_ids is not None and bool((block_ids != 0).any()):
                where = "a decode step (one token)" if self.image_blocks else "this graph (built without --vision)"
                raise ValueError(f"block_ids name an image block, and {where} has no image-block input")
            return ()
        blocks = torch.zeros(1, bucket, dtype=torch.int64)  # [1, bucket]: pads are text
        if block_ids is not None:
            blocks[:, :t] = block_ids
        return (blocks,)

    def _load_weights(self, path: Path | str, spec: GraphSpec, start_rank: int) -> None:
        if spec.weight_files:
            from server.model.weights import open_rank_weights

            weights = [open_rank_weights(Path(path).parent / f) for f in spec.weight_files]  # memory-mapped, per rank
            push_weights(self.module, weights, start_rank, prefix="core.")
        else:
            self._initialize_saved_weights(start_rank)

    def _initialize_saved_weights(self, start_rank: int) -> None:
        nxd = neuron_model(self.module)
        if nxd is not None:  # pushes the saved sharded weights to the NeuronCores; once, before the first call
            nxd.initialize_with_saved_weights(torch.tensor([start_rank], dtype=torch.int32))

    def _contract_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _scored(self, embeds: torch.Tensor, positions: torch.Tensor, block_ids: torch.Tensor | None,
                on_submit: Callable[[], None] | None,
                rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Callable[[], None] | None],
                               torch.Tensor]) -> torch.Tensor:
        """Every row's logits [1, T, V] of a last-row build's chunk: `rows` (one call returning every row) over
        pieces of the score bucket, in order; `on_submit` before the first. An image block must stay in one call."""
        t, size = embeds.shape[1], self.score_bucket
        if block_ids is not None and t > size and bool((block_ids != 0).any()):
            raise ValueError(f"a scored chunk of {t} tokens with an image block: this graph scores {size} rows a call "
                             "and an image block must be prefilled in one call")
        pieces = []
        for begin in range(0, t, size):
            end = min(t, begin + size)
            piece_blocks = None if block_ids is None else block_ids[:, begin:end]
            pieces.append(rows(embeds[:, begin:end], positions[:, begin:end], piece_blocks,
                               on_submit if begin == 0 else None))  # [1, piece, V]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # [1, T, V]

    def _last_input(self, t: int, bucket: int, last_only: bool) -> tuple[torch.Tensor, ...]:
        """A last-row prefill graph's last_index [1] (the chunk's last real row); () for other graphs."""
        return (self._last_index[t - 1],) if self.last_rows and last_only and bucket != 1 else ()

    def _pad_chunk(self, embeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk of T tokens padded to the smallest graph that holds it (pad positions continue past the last)."""
        t = embeds.shape[1]  # embeds [1, T, H], positions [1, T]
        bucket = self._bucket_for[t]  # KeyError: a chunk longer than the largest bucket (the engine plans them)
        if bucket != t:
            pad = bucket - t
            embeds = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], dim=1)  # [1, B, H]
            tail = positions[0, -1] + 1 + torch.arange(pad)  # continue past the last real position
            positions = torch.cat([positions, tail[None]], dim=1)  # [1, B]
        return embeds, positions

    @staticmethod
    def _logits(out: object) -> torch.Tensor:
        logits = out[0] if isinstance(out, tuple | list) else out  # Neuron returns it alone, the CPU trace first
        assert isinstance(logits, torch.Tensor)
        return logits

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = embeds.shape[1]  # embeds [1, T, H], positions [1, T], block_ids [1, T] or None
        if self.last_rows and not last_only and t > 1:
            # a one-token piece runs on the decode graph, whose one row is every row
            return self._scored(embeds, positions, block_ids, on_submit,
                                lambda e, p, b, submit: self._rows(e, p, b, submit, last_only=False))
        return self._rows(embeds, positions, block_ids, on_submit, last_only=last_only)

    def _rows(self, embeds: torch.Tensor, positions: torch.Tensor, block_ids: torch.Tensor | None,
              on_submit: Callable[[], None] | None, *, last_only: bool) -> torch.Tensor:
        """One call of the graph that holds the chunk: its logits [1, T, V], or [1, 1, V] of the last row."""
        t = embeds.shape[1]
        bucket = self._bucket_for[t]
        blocks = self._block_inputs(block_ids, t, bucket)
        last = self._last_input(t, bucket, last_only)
        embeds, positions = self._pad_chunk(embeds, positions)
        inputs = self._contract_inputs(positions)
        embeds, positions = embeds.to(self.input_dtype), positions.to(torch.int64)
        if on_submit is not None:
            on_submit()
        logits = self._logits(self.module(embeds, positions, *inputs, *blocks, *last))  # [1, T', V] or [1, 1, V]
        if logits.shape[1] != 1:  # decode answers [1, 1, V] already: no slicing call on the critical path
            logits = logits[:, t - 1 : t] if last_only else logits[:, :t]
        return logits if logits.dtype == torch.float32 else logits.float()


class JitGraph(_CompiledGraph, OneSlotGraph):
    """Contract v1 (the module docs): one prefill bucket; the host builds the write slots and masks."""

    def __init__(self, path: Path | str, spec: GraphSpec, *, vocab_size: int, sliding_window: int | None,
                 final_softcap: float | None, start_rank: int = 0) -> None:
        super().__init__(path, spec, "contract v1", vocab_size=vocab_size, final_softcap=final_softcap)
        self._initialize_saved_weights(start_rank)
        self.inputs = ContractInputs(spec.max_total, sliding_window, self.input_dtype)

    def _contract_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inputs.build(positions)  # onehot, full_mask, sliding_mask

    def rewind(self, position: int) -> int:
        # One-hot writes address slots by absolute position: stale slots are simply overwritten.
        return position


class JitGraphV2(_CompiledGraph, OneSlotGraph):
    """Contract v2 (ARCHITECTURE.md "Contract v2"): `model(inputs_embeds f32 [1,T,H], position_ids int64 [1,T])`.

    The graph builds its masks and KV write slots from the positions and keeps sliding layers in a ring of
    `sliding_slots` slots, so the host ships no [T, MAX] tensors. T is one of the graph's prefill buckets or 1 (the
    ring is sized so the writes of pad positions never reach a slot a real query can see).
    """

    def __init__(self, path: Path | str, spec: GraphSpec, *, vocab_size: int, final_softcap: float | None,
                 start_rank: int = 0) -> None:
        super().__init__(path, spec, "contract v2", vocab_size=vocab_size, final_softcap=final_softcap)
        self._load_weights(path, spec, start_rank)
        self.window, self.ring = spec.sliding_window, spec.sliding_slots
        self._written = -1  # highest position written (pads included) since the cache was last filled from 0

    def _contract_inputs(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Recorded before the call: a failed call may have written some layers.
        self._written = max(self._written, int(positions[0, -1]))
        return ()

    def rewind(self, position: int) -> int:
        """The cache is valid before `position` unless a later write wrapped a sliding ring over what a query at
        `position` still reads: positions (position - window, position). A slot holds position x until a write at
        x + ring, so all of them survive iff position - window + 1 > written - ring. Otherwise only a prefill from
        0 rebuilds the ring (going back less would need even older positions)."""
        keeps = ring_keeps(position, self._written, self.window, self.ring)
        if not keeps:
            self._written = -1
        return position if keeps else 0


KV_STATES = ("k_cache", "v_cache", "k_scale", "v_scale")  # the recipe's per-layer KV buffers (SlotRingCache)


def ring_keeps(position: int, written: int, window: int | None, ring: int | None) -> bool:
    """Whether a ring cache written up to `written` still holds what a query at `position` reads (JitGraphV2.rewind)."""
    return position > 0 and (ring is None or window is None or position - window + 1 > written - ring)


class JitGraphV3(_CompiledGraph):
    """Contract v3: `model(inputs_embeds f32 [B,T,H], position_ids int64 [B,T], slot_ids int64 [B])`.

    The graph keeps `slots` KV caches, each a v2 ring per layer. A prefill is one row (B = 1) of a bucket's length
    into one slot; a decode call takes B rows (T = 1), each in its own slot at its own position, and runs the
    smallest compiled decode batch >= B. Spare rows of that batch shadow real rows: row j of the spare ones repeats
    real row j mod B in its slot, k = 1 + j // B positions ahead, with zero embeds. That write lands where a pad of a
    prefill chunk would (positions past the row's last one, which the slot's next call overwrites before any query
    reads them, the ring's guarantee for up to `max(decode_batches) <= largest bucket` positions a call), costs what
    a real row costs and touches no other slot. `rewind_slot` counts it as written.

    `forward` and `rewind` serve slot 0 as a v2 graph would.
    """

    def __init__(self, path: Path | str, spec: GraphSpec, *, vocab_size: int, final_softcap: float | None,
                 start_rank: int = 0) -> None:
        super().__init__(path, spec, "contract v3", vocab_size=vocab_size, final_softcap=final_softcap)
        self._load_weights(path, spec, start_rank)
        self.window, self.ring = spec.sliding_window, spec.sliding_slots
        self.slots = spec.kv_slots
        self.decode_batches = spec.decode_batches
        # rows -> the compiled decode batch that runs them (the smallest that holds them)
        self._batch_for = decode_batch_for(spec.decode_batches)
        self._slot_written = [-1] * spec.kv_slots  # per slot: highest position written (pads included)
        self._slot_ids = [torch.tensor([s]) for s in range(spec.kv_slots)]  # [1] int64 each, made once
        # The CPU trace keeps each layer's K and V (and int8 scales) as module buffers [S, kvh, R, D]: a slot's copy is
        # one indexed copy per buffer. A Neuron build keeps them on the device, where a copy needs a graph of its own
        # that the recipe does not build yet (docs/contract-v3.md): there the engine runs n > 1 one choice at a time.
        self._kv_states = [] if neuron_model(self.module) is not None else [
            buf for name, buf in self.module.named_buffers() if name.endswith(KV_STATES)]
        self.copies_slots = bool(self._kv_states)

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = embeds.shape[1]  # embeds [1, T, H], positions [1, T], block_ids [1, T] or None
        if self.last_rows and not last_only and t > 1:  # a scored chunk: the score graph, a piece at a time
            return self._scored(embeds, positions, block_ids, on_submit,
                                lambda e, p, b, submit: self._prefill_rows(e, p, slot, b, submit, last_only=False))
        return self._prefill_rows(embeds, positions, slot, block_ids, on_submit, last_only=last_only)

    def _prefill_rows(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, block_ids: torch.Tensor | None,
                      on_submit: Callable[[], None] | None, *, last_only: bool) -> torch.Tensor:
        """One call into `slot`: the chunk's logits [1, T, V], or [1, 1, V] of its last row."""
        t = embeds.shape[1]
        bucket = self._bucket_for[t]
        blocks = self._block_inputs(block_ids, t, bucket)
        if t == 1:  # one token runs on the decode graph (no bucket of 1); a one-token block sees itself alone
            return self.decode(embeds, positions, [slot], on_submit=on_submit)[:, None]  # [1, 1, V]
        checked_slots([slot], self.slots)
        # v4: the slot's blocks (reserved first); a scored piece's table as wide as the score graph's
        tables = self._tables([slot], [int(positions[0, -1]) + 1], scored=self.last_rows and not last_only)
        last = self._last_input(t, bucket, last_only)
        embeds, positions = self._pad_chunk(embeds, positions)  # [1, bucket, H], [1, bucket]
        self._slot_written[slot] = max(self._slot_written[slot], int(positions[0, -1]))  # before: a failed call wrote
        embeds, positions = embeds.to(self.input_dtype), positions.to(torch.int64)
        if on_submit is not None:
            on_submit()
        logits = self._logits(self.module(embeds, positions, self._slot_ids[slot], *tables, *blocks, *last))
        if logits.shape[1] != 1:  # a last-row graph answers [1, 1, V] already
            logits = logits[:, t - 1 : t] if last_only else logits[:, :t]
        return logits if logits.dtype == torch.float32 else logits.float()

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int] | torch.Tensor, *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        rows = embeds.shape[0]  # embeds [B, 1, H], positions [B, 1]
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
        if embeds.shape[1] != 1 or positions.shape != (rows, 1) or len(ids) != rows:
            raise ValueError(f"decode takes embeds [B, 1, H], positions [B, 1], B slots; got {tuple(embeds.shape)}, "
                             f"{tuple(positions.shape)}, {len(ids)} slots")
        batch = self._batch_for.get(rows)
        if batch is None:
            raise ValueError(f"{rows} rows: the largest compiled decode batch is {max(self.decode_batches)}")
        checked_slots(ids, self.slots)
        ends = [int(p) + 1 for p in positions[:, 0].tolist()]
        spare = batch - rows
        positions = positions.to(torch.int64)
        if spare:
            shadow = torch.arange(spare)  # [spare]
            of = shadow % rows  # [spare] the real row each spare row shadows
            embeds = torch.cat([embeds, embeds.new_zeros(spare, 1, embeds.shape[2])])  # [batch, 1, H]
            positions = torch.cat([positions, positions[of] + (1 + shadow // rows)[:, None]])  # [batch, 1]
            ids = ids + [ids[r] for r in of.tolist()]
        for slot, position in zip(ids, positions[:, 0].tolist(), strict=True):
            self._slot_written[slot] = max(self._slot_written[slot], position)
        slot_ids = torch.tensor(ids, dtype=torch.int64)  # [batch]
        tables = self._tables(ids, ends)  # v4: every row's blocks (the spare rows share their real row's)
        embeds = embeds.to(self.input_dtype)
        if on_submit is not None:
            on_submit()
        logits = self._logits(self.module(embeds, positions, slot_ids, *tables))  # [batch, 1, V]
        logits = logits[:rows, 0]  # [B, V]
        return logits if logits.dtype == torch.float32 else logits.float()

    def _tables(self, ids: list[int], ends: list[int], *, scored: bool = False) -> tuple[torch.Tensor, ...]:
        """Inputs after slot_ids for rows `ids` whose real positions end before `ends` (the first len(ends) rows), for
        the score graph if `scored`: none in v3 (JitGraphV4: the block table)."""
        return ()

    def rewind_slot(self, slot: int, position: int) -> int:
        """`JitGraphV2.rewind` for one slot: other slots' writes never reach its ring."""
        checked_slots([slot], self.slots)
        keeps = ring_keeps(position, self._slot_written[slot], self.window, self.ring)
        if not keeps:
            self._slot_written[slot] = -1
        return position if keeps else 0

    def copy_slot(self, src: int, dst: int) -> None:
        checked_slots([src, dst], self.slots)
        if not self.copies_slots:
            raise NotImplementedError("this build keeps its KV on the device and has no slot-copy graph")
        with torch.no_grad():
            for state in self._kv_states:  # [S, kvh, R, D]
                state[dst].copy_(state[src])
        self._slot_written[dst] = self._slot_written[src]

    # Slot 0 as a one-slot graph's calls (what tests of one conversation drive).
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.prefill(embeds, positions, 0, last_only=last_only, on_submit=on_submit, block_ids=block_ids)

    def rewind(self, position: int) -> int:
        return self.rewind_slot(0, position)


class JitGraphV4(JitGraphV3):
    """Contract v4 (docs/contract-v4.md): v3's call with `block_table int32 [B, NBc]` after the slot ids.

    Sliding layers keep v3's rings per slot; the global layers' KV is a pool of blocks this adapter lends by need
    (server/graphs/blocks.py `KVBlocks`): a slot takes blocks as its positions reach them, `rewind_slot` gives back
    those past where it continues (a newcomer in a slot rewinds it to its kept prefix, so an evicted conversation's
    blocks return to the pool). Each call runs at the context bucket of its longest row; spare rows share their real
    row's table (their writes land past its last position or in the null block). Rows of different context buckets
    decode in one call at the longest row's bucket or one call per bucket, whichever the roofline's cost model
    (`decode_cost`, graphs/blocks.py `decode_calls`) says reads less. The pool (`pool`, graphs/base.py `KVPool`) is
    what the engine's scheduler admits by; it refuses (MemoryError) a call it is short for, which the scheduler
    never makes (it evicts idle slots' blocks or preempts a row first).
    """

    def __init__(self, path: Path | str, spec: GraphSpec, *, vocab_size: int, final_softcap: float | None,
                 start_rank: int = 0) -> None:
        super().__init__(path, spec, vocab_size=vocab_size, final_softcap=final_softcap, start_rank=start_rank)
        self.pool = KVBlocks(spec.kv_blocks, spec.block_size, spec.context_buckets)
        # n > 1: v3's copy_slot copies the per-slot states, which here would leave the global layers' blocks behind;
        # until a copy lends and fills the destination's blocks, a v4 build's choices wait (as without a copy graph).
        self.copies_slots = False
        self.decode_cost = DECODE_COST_26B  # what a call reads (the 26B's projection; a test may force a split)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int] | torch.Tensor, *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """v3's decode, as one call or one per context bucket (the class docs); logits [B, V] in row order."""
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
        if positions.dim() != 2 or len(ids) != positions.shape[0] or embeds.shape[0] != len(ids):
            return super().decode(embeds, positions, ids, on_submit=on_submit)  # v3 says what is wrong
        ends = [int(p) + 1 for p in positions[:, 0].tolist()]
        calls = decode_calls([self.pool.context_for(end) for end in ends], self.decode_cost)
        if len(calls) == 1:
            return super().decode(embeds, positions, ids, on_submit=on_submit)
        for slot, end in zip(ids, ends, strict=True):  # every row's blocks before the first call
            self.pool.reserve(slot, end)
        logits = torch.empty(len(ids), self.vocab_size)  # [B, V]
        for n, rows in enumerate(calls):
            index = torch.tensor(rows)  # [b]
            logits[index] = super().decode(embeds[index], positions[index], [ids[i] for i in rows],
                                           on_submit=on_submit if n == 0 else None)  # [b, V]
        return logits

    def _tables(self, ids: list[int], ends: list[int], *, scored: bool = False) -> tuple[torch.Tensor, ...]:
        for slot, end in zip(ids, ends, strict=False):  # the real rows (spare rows follow them in `ids`)
            self.pool.reserve(slot, end)
        # the score graph is compiled at the largest context bucket only (the recipe's Plan.score_context)
        context = self.max_total if scored else self.pool.context_for(max(ends))
        return (self.pool.table(ids, context),)

    def rewind_slot(self, slot: int, position: int) -> int:
        start = super().rewind_slot(slot, position)
        self.pool.truncate(slot, start)
        return start

    def free_tokens(self) -> int:
        """Positions the pool could still lend (admission by free KV, for a scheduler that asks)."""
        return len(self.pool.free) * self.pool.block_size
