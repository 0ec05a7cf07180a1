"""Per-rank weight files of a v2 `--weights separate` graph, memory-mapped (never read into anonymous memory).

Each rank's weights are one safetensors file (`weights/tp{rank}_sharded_checkpoint.safetensors`, named and keyed
as NxD's ModelBuilder.shard_checkpoint writes them). The tensors returned here are views of a private,
copy-on-write map of the file: the kernel pages them in from the page cache and can drop them again, so loading
a graph whose weights are larger than the host's RAM needs no swap. On Neuron they go to
`nxd_model.initialize(weights, start_rank)`, which copies them to the device; on CPU the TorchScript graph
reads them in place.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

# safetensors dtype names -> torch
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def open_rank_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """{name: tensor} for one safetensors file (also an embedding table's), each a view of one private memory map."""
    path = Path(path)
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        # ACCESS_COPY: a private mapping. Pages stay file-backed until written (nothing writes them); it is also a
        # writable buffer, which torch.frombuffer wants.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)  # [file bytes]; keeps the map alive
    base = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        raw = flat[base + begin : base + end]  # [nbytes] uint8 view
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (base + begin) % itemsize:
            raw = raw.clone()  # misaligned for a typed view (safetensors normally aligns): copy this one tensor
        tensors[name] = raw.view(dtype).view(entry["shape"])
    return tensors


def attach_weights(module: torch.nn.Module, weights: Mapping[str, torch.Tensor], prefix: str = "") -> int:
    """Put each tensor on the TorchScript module under its name (the CPU twin of NxD's initialize). Returns bytes.

    The traced graph reads parameters by attribute, so assigning the mapped tensors is the whole load.
    """
    total = 0
    for name, tensor in weights.items():
        owner_path, leaf = (prefix + name).rsplit(".", 1)
        owner = functools.reduce(getattr, owner_path.split("."), module)  # ScriptModules lack get_submodule
        current = getattr(owner, leaf)
        if current.dtype != tensor.dtype:
            raise ValueError(f"{name}: file has {tensor.dtype}, the graph expects {current.dtype}")
        setattr(owner, leaf, tensor)
        total += tensor.numel() * tensor.element_size()
    return total
