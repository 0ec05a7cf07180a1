"""The host vision encoder's time per image (`--vision host`), at each soft-token budget.

    python -m server bench vision [--artifacts DIR] [--budgets 70,140,280] [--json PATH]

With --artifacts: the export's own tower (vision.safetensors, `export --vision host`). Without: a random tower of
the 26B-A4B's vision shape (27 layers, width 1152, MLP 4304, 16 heads of 72, patch 16, pooling 3: ~0.4 B parameters,
plus the 1152 -> 2816 projection), f32 on the CPU, the same transformers modules. One warm-up image first; each
budget then encodes one square picture, which the processor resizes to fill the budget. Seconds per image on this
machine with torch's threads as they are (`threads` in the report), and CPU seconds over all threads (the work
itself, which a busy machine does not inflate): the tower is matmul-bound, so on n otherwise idle cores an image
takes about its CPU seconds / n.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# google/gemma-4-26b-a4b's vision_config and the language model's width (what the projection maps into)
VISION_26B = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=10240, standardize=True)
TEXT_HIDDEN_26B = 2816


def _encoder(artifacts: Path | None, budgets: tuple[int, ...]) -> tuple[Any, str]:
    import torch

    from server.vision.host import HostVisionEncoder, modules

    if artifacts is not None:
        from server.model.artifacts import ArtifactDir

        art = ArtifactDir(artifacts)
        if art.vision_file is None:
            raise SystemExit(f"{artifacts}: no vision.safetensors (export --vision host)")
        return HostVisionEncoder.from_export(art.vision_file, art.cfg, torch.float32, budgets), str(artifacts)
    from transformers.models.gemma4 import Gemma4TextConfig, Gemma4VisionConfig

    torch.manual_seed(0)
    vision = Gemma4VisionConfig(**VISION_26B)  # type: ignore[arg-type]
    tower, embed = modules(vision, Gemma4TextConfig(hidden_size=TEXT_HIDDEN_26B))
    return HostVisionEncoder(tower, embed, pooling=3, hidden_size=TEXT_HIDDEN_26B, dtype=torch.float32,
                             budgets=budgets), "random tower of the 26B-A4B's vision shape"


def measure(artifacts: Path | None = None, budgets: tuple[int, ...] = (70, 140, 280)) -> dict[str, Any]:
    import numpy as np
    import torch
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    encoder, what = _encoder(artifacts, budgets)
    params = sum(p.numel() for p in encoder.tower.parameters()) + sum(p.numel() for p in encoder.embed.parameters())
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (896, 896, 3), dtype=np.uint8))

    def encode(budget: int) -> tuple[float, float, int]:
        features = Gemma4ImageProcessorPil(max_soft_tokens=budget)(picture, return_tensors="pt")
        start, cpu = time.perf_counter(), time.process_time()
        soft = encoder.encode(features["pixel_values"], features["image_position_ids"], budget)
        return time.perf_counter() - start, time.process_time() - cpu, int(soft.shape[0])

    encode(min(budgets))  # warm-up: first-call allocations
    results: dict[str, Any] = {"encoder": what, "parameters": params, "threads": torch.get_num_threads()}
    for budget in budgets:
        seconds, cpu_seconds, tokens = encode(budget)
        results[f"s_per_image_{budget}"] = round(seconds, 3)
        # CPU time over all threads: the work itself, whatever else shares the cores (wall time on a busy box is not)
        results[f"cpu_s_per_image_{budget}"] = round(cpu_seconds, 3)
        results[f"soft_tokens_{budget}"] = tokens
    return results
