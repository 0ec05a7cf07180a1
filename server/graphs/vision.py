"""The recipe's vision graph (`--vision`): Gemma-4's vision tower + embed_vision, traced, behind `VisionEncoder`.

    tower(pixel_values f32 [1, P, 3 * patch**2], position_ids int64 [1, P, 2]) -> soft tokens f32 [1, P / k**2, H]

P = budget * k**2 (k = pooling_kernel_size) patch rows, as transformers' Gemma-4 image processor gives them for
`max_soft_tokens = budget`, pad rows at (-1, -1). The graph returns one row per soft-token slot of the budget; the
image's own soft tokens are the first (real patches) / k**2 of them, which is what `encode` returns (the rest is pooled
padding, which transformers strips with a boolean index: a data-dependent shape no compiled graph can have).

It loads as the language graph does (graphs/jit.py): the Neuron prelude, `torch.jit.load`, then the per-rank weights
memory-mapped (server/model/weights.py) and handed to `nxd_model.initialize` on Neuron, put on the TorchScript module
by name on CPU. One graph (a NEFF per budget on Neuron; one CPU trace whose ops take their sizes from the inputs)
serves every budget graph.json lists.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from server.graphs.base import DTYPES
from server.graphs.jit import load_compiled, push_weights
from server.model.artifacts import GraphSpec, VisionSpec

log = logging.getLogger(__name__)


class VisionGraph:
    """`VisionEncoder` (graphs/base.py) over the traced tower."""

    name = "jit-vision"
    on_host = False  # a device graph: the device thread calls it

    def __init__(self, root: Path | str, vision: VisionSpec, input_dtype: torch.dtype, start_rank: int = 0) -> None:
        from server.model.weights import open_rank_weights

        root = Path(root)
        self.spec = vision
        self.budgets = vision.budgets
        self.input_dtype = input_dtype
        self.module = load_compiled(root / vision.graph_file, "vision")
        push_weights(self.module, [open_rank_weights(root / f) for f in vision.weight_files], start_rank)

    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """pixel_values [1, P, D], position_ids [1, P, 2] for `budget` -> soft tokens [N, H] in `input_dtype`."""
        if budget not in self.budgets:
            raise ValueError(f"budget {budget}: the vision graph is built for {list(self.budgets)} soft tokens")
        rows = self.spec.patch_rows(budget)
        if pixel_values.shape != (1, rows, self.spec.patch_dim) or position_ids.shape != (1, rows, 2):
            raise ValueError(f"budget {budget} takes pixel_values [1, {rows}, {self.spec.patch_dim}] and position_ids "
                             f"[1, {rows}, 2]; got {tuple(pixel_values.shape)}, {tuple(position_ids.shape)}")
        position_ids = position_ids.to(torch.int64)
        # What get_image_features splits off per image: real patch rows / k**2 (the pooled cells are a prefix).
        real = int((position_ids[0] != -1).all(dim=-1).sum())
        n = real // self.spec.pooling_kernel_size**2
        out = self.module(pixel_values.to(torch.float32), position_ids)
        tokens: torch.Tensor = out[0] if isinstance(out, tuple | list) else out  # [1, budget, H]
        return tokens[0, :n].to(self.input_dtype)  # [N, H]


def load_vision_graph(root: Path | str, spec: GraphSpec, start_rank: int = 0) -> VisionGraph:
    """The vision graph of the artifact directory `root`, as graph.json's `vision` declares it."""
    if spec.vision is None:
        raise ValueError("graph.json declares no vision graph: build with the recipe's --vision, or use --vision host")
    return VisionGraph(root, spec.vision, DTYPES[spec.input_dtype], start_rank)
