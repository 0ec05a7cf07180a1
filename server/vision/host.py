"""`HostVisionEncoder` (`serve --vision host`): Gemma-4's vision tower and its projection, run with torch on the CPU.

The modules are transformers' own (`Gemma4VisionModel` from the config's vision_config, `Gemma4MultimodalEmbedder`),
built on the meta device and given the export's vision.safetensors (`export --vision host`): exactly what
`Gemma4Model.get_image_features` runs, so the soft tokens are transformers', float for float. It answers
server.graphs.base.VisionEncoder; the engine calls it on a host worker thread (server.engine.workers), one image at a
time, while the device thread keeps stepping the other requests.

What it costs: a matmul-bound tower (~2.8 TFLOP per 280-token image for the 26B's): tens of seconds per image on a
few vCPUs (`python -m server bench` measures it). For builds without a vision graph, and for the tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BUDGETS = (70, 140, 280, 560, 1120)  # the image processor's; the host runs any of them (nothing is compiled)


def modules(vision_config: Any, text_config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' vision tower and `embed_vision` projection for these configs (random or empty weights)."""
    from transformers import AutoModel
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    return AutoModel.from_config(vision_config), Gemma4MultimodalEmbedder(vision_config, text_config)


class HostVisionEncoder:
    name = "host"
    on_host = True  # the engine encodes on a host worker (server.engine.workers), never on the device thread

    def __init__(self, tower: torch.nn.Module, embed: torch.nn.Module, *, pooling: int, hidden_size: int,
                 dtype: torch.dtype, budgets: tuple[int, ...] = BUDGETS) -> None:
        self.tower = tower.to(dtype).eval()
        self.embed = embed.to(dtype).eval()
        self.pooling = pooling
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.budgets = tuple(sorted(budgets))

    @classmethod
    def from_export(cls, weights: Path, config_dir: Path, dtype: torch.dtype,
                    budgets: tuple[int, ...] = BUDGETS) -> HostVisionEncoder:
        """The export's vision.safetensors (`export --vision host`) in transformers' modules built from cfg/."""
        from accelerate import init_empty_weights
        from safetensors.torch import load_file
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config_dir)
        with init_empty_weights():
            tower, embed = modules(config.vision_config, config.get_text_config())
        state = load_file(str(weights))
        for prefix, module in (("vision_tower", tower), ("embed_vision", embed)):
            own = {key[len(prefix) + 1:]: value for key, value in state.items() if key.startswith(prefix + ".")}
            # strict: a missing or stray tensor means the file is not this model's tower
            module.load_state_dict(own, strict=True, assign=True)
        return cls(tower, embed, pooling=int(config.vision_config.pooling_kernel_size),
                   hidden_size=int(config.get_text_config().hidden_size), dtype=dtype, budgets=budgets)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """pixel_values [1, P, D], position_ids [1, P, 2] -> soft tokens [N, H] (N = real patches / k^2)."""
        if budget not in self.budgets:
            raise ValueError(f"budget {budget} is not one of this encoder's {self.budgets}")
        out = self.tower(pixel_values=pixel_values.to(self.dtype), pixel_position_ids=position_ids)
        soft = self.embed(inputs_embeds=out.last_hidden_state)  # [N, H] (the tower drops the padding) or [1, N, H]
        real = int((position_ids != -1).all(dim=-1).sum()) // self.pooling**2
        soft = soft.reshape(-1, soft.shape[-1])
        assert soft.shape == (real, self.hidden_size), (tuple(soft.shape), real)
        return soft
