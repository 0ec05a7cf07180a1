"""`HostEmbedding`: the word-embedding table, memory-mapped on the host, looked up and scaled per step.

The compiled graph starts at the first decoder layer, so the host inherits the job that
`Gemma4TextScaledWordEmbedding.forward` did inside the model: `embedding(ids) * embed_scale.to(weight.dtype)`.
Forget the scale (sqrt(hidden) for Gemma) and the model answers with a confident wall of blanks.

The table is never copied into RAM: `torch.load(mmap=True)` / a zero-copy view of a safetensors file keeps
it in the page cache, so only the rows a prompt touches are ever read. `warm()` reads the file through once, on a
background thread, so those rows are in the page cache before a prompt needs them: a prompt's rows are scattered over
the whole table (the 26B's: 1.5 GB), and on a cold cache each 128-token chunk's lookup waited on ~128 page reads,
~110 ms a chunk on the device thread here, which every running stream waited for too (`bench fairness`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)
WARM_NICE = 10  # the warming thread's priority: below the device thread's, as the host workers' (engine/workers.py)


def open_table(path: Path | str) -> torch.Tensor:
    """The [vocab, hidden] table of `embed_tokens.pt` (a bare tensor or {"weight": t}) or `.safetensors`, mmapped."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _open_safetensors(path)
    obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if isinstance(obj, dict):
        if "weight" not in obj or len(obj) != 1 and not isinstance(obj.get("weight"), torch.Tensor):
            raise ValueError(f"expected a tensor or a {{'weight': tensor}} dict, got keys {sorted(obj)[:5]}")
        obj = obj["weight"]
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"expected a tensor, got {type(obj).__name__}")
    return obj


def _open_safetensors(path: Path) -> torch.Tensor:
    """A zero-copy view of the single tensor (or the one named 'weight') in a safetensors file, through the same
    memory map as a graph's weight files (safetensors' own get_tensor copies it)."""
    from server.model.weights import open_rank_weights

    tensors = open_rank_weights(path)
    name = "weight" if "weight" in tensors else next(iter(tensors)) if len(tensors) == 1 else None
    if name is None:
        raise ValueError(f"expected one tensor (or one named 'weight'), found {sorted(tensors)[:5]}")
    return tensors[name]


class HostEmbedding:
    """rows x scale, computed in the dtype the graph consumes, exactly as the model's own embedding module would."""

    def __init__(self, table: torch.Tensor, scale: float, dtype: torch.dtype | None = None, *,
                 source: Path | None = None) -> None:
        assert table.dim() == 2, "table must be [vocab, hidden]"
        self.table = table  # [V, H], memory-mapped
        self.dtype = dtype or table.dtype
        # The module keeps the scale as an f32 buffer and casts it to the weight dtype before the multiply
        # (bf16 rounds sqrt(2816)=53.07 to 53.0); do the same cast to the compute dtype.
        self.scale = torch.tensor(scale, dtype=torch.float32).to(self.dtype)
        # Decode's one row in two torch calls: a [1, H] slice times a [1, 1, 1] scale broadcasts to [1, 1, H], and a
        # non-scalar scale takes part in type promotion, so a bf16 row meets an f32 scale in f32: the same arithmetic
        # as `rows.to(dtype) * scale`. Only where that promotion lands on `dtype` (not for an f32 table read as bf16).
        promoted = torch.promote_types(table.dtype, self.dtype) == self.dtype
        self._row_scale = self.scale.reshape(1, 1, 1) if promoted else None
        self.source = source  # the file the table is mapped from (`open`), what `warm` reads
        self.warmed = 0  # bytes `warm` has read
        self.warming: threading.Thread | None = None  # `warm`'s thread

    @classmethod
    def open(cls, path: Path | str, scale: float, dtype: torch.dtype | None = None) -> HostEmbedding:
        return cls(open_table(path), scale, dtype, source=Path(path))

    def warm(self) -> threading.Thread | None:
        """Read the table's file once on a daemon thread at low priority (None: a table not opened from a file; the
        thread already started if an engine warmed it before).
        Page-cache pages, not this process's memory: the kernel may drop them again under pressure, and a lookup
        faults them back in as it did before. posix_fadvise(WILLNEED) would be the one-call way; on this machine's
        filesystem it read nothing."""
        if self.source is None:
            return None
        if self.warming is not None:  # once per table: an engine started again on the same host reads nothing more
            return self.warming
        self.warming = threading.Thread(target=self._read_through, args=(self.source,), name="embedding-warm",
                                        daemon=True)
        self.warming.start()
        return self.warming

    def _read_through(self, path: Path) -> None:
        with contextlib.suppress(AttributeError, OSError):  # a platform without per-thread nice keeps its priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_NICE)
        buffer = bytearray(8 << 20)  # one 8 MB buffer, reused: sequential reads the kernel reads ahead of
        try:
            with open(path, "rb", buffering=0) as f:
                while read := f.readinto(buffer):
                    self.warmed += read
        except OSError as exc:  # a hint only: the lookups read the rows anyway
            log.warning("could not warm the embedding table %s: %s", path, exc)

    def lookup(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """ids [T] or [1, T] -> [1, T, H] in the compute dtype."""
        if self._row_scale is not None and isinstance(ids, list) and len(ids) == 1:
            # Decode: after the worker sat out a device step its caches are cold and every torch call costs ~25 us
            # more, so the fewest calls that compute the same thing.
            return self.table[ids[0] : ids[0] + 1] * self._row_scale  # [1, H] * [1, 1, 1] -> [1, 1, H]
        ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)  # [1, T]
        rows = torch.nn.functional.embedding(ids_t, self.table)  # [1, T, H] table dtype (gathers only T rows)
        return rows.to(self.dtype) * self.scale  # [1, T, H]
