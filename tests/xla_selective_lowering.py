"""Does the selective decode graph lower on torch-xla with no aten:: fallback and one compilation across positions
and routings? A hand-run check until the recipe's own `--check-lowering` (graph contract v2) covers it.

Run in a torch-xla venv (torch 2.9.0, torch-xla 2.9.0, transformers, safetensors, accelerate), not the test venv:

    PJRT_DEVICE=CPU /path/to/xla-venv/bin/python tests/xla_selective_lowering.py

Prints one JSON object: per quant, per graph the compilations each call caused (pass: [1, 0, 0]), the aten::
fallback counters (pass: none), the gathers in each graph's HLO (decode: the experts' rows and scales, 4 per layer
and routed-expert slot for int8, on top of the router's per-expert scale; prefill: none beyond the router's) and how many distinct
routings the decode calls took. Lowering is necessary for neuronx-cc, not sufficient.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX, BUCKET = 64, 16
DECODE_POSITIONS, PREFILL_STARTS = (16, 17, 40), (0, 32)


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


recipe = load(ROOT / "server" / "vendor" / "tp_mb_moe_sqz.py", "tp_mb_moe_sqz")
TINY = load(ROOT / "tests" / "support" / "recipe_helpers.py", "recipe_helpers").TINY


def compilations() -> int:
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def inputs(cfg, t: int, start: int, seed: int, device) -> list[torch.Tensor]:
    embeds = torch.randn(1, t, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)) * 3  # [1, T, H]
    positions = torch.arange(start, start + t)[None]  # [1, T]
    return [x.to(device) for x in recipe.contract_inputs(embeds, positions, MAX, cfg.sliding_window)]


def check(quant: str) -> dict:
    device = torch_xla.device()
    cfg = recipe.text_config_from_dict(dict(TINY, num_experts=16, top_k_experts=2))
    plan = recipe.Plan(quant=quant, max_total=MAX, experts="selective", inplace_kv=False)
    cpu_model = recipe.build_model(cfg, plan)
    recipe.randomize(cpu_model)
    model = recipe.build_model(cfg, plan)
    model.load_state_dict(cpu_model.state_dict())
    model = model.to(device)
    met.clear_all()
    report: dict = {}
    with torch.no_grad():
        for graph, t, starts in (("decode", 1, DECODE_POSITIONS), ("prefill", BUCKET, PREFILL_STARTS)):
            per_call, gathers = [], None
            for i, start in enumerate(starts):
                before = compilations()
                logits = model(*inputs(cfg, t, start, seed=100 * t + i, device=device))[0]
                if gathers is None:
                    gathers = torch_xla._XLAC._get_xla_tensors_hlo([logits]).count(" gather(")
                torch_xla.sync()
                assert torch.isfinite(logits.cpu()).all()
                per_call.append(compilations() - before)
            report[graph] = {"compilations_per_call": per_call, "hlo_gathers": gathers}
    report["aten_fallbacks"] = {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}

    # The decode calls routed differently: replay them on the CPU twin and record every layer's chosen experts.
    chosen: list[list[int]] = []
    hooks = [layer.experts.register_forward_hook(lambda m, args, out: chosen.append(args[1].flatten().tolist()))
             for layer in cpu_model.layers]
    routings = set()
    with torch.no_grad():
        for i, start in enumerate(DECODE_POSITIONS):
            chosen.clear()
            cpu_model(*inputs(cfg, 1, start, seed=100 + i, device="cpu"))
            routings.add(tuple(map(tuple, chosen)))
    for hook in hooks:
        hook.remove()
    report["decode_calls_with_distinct_routings"] = len(routings)
    report["layers"] = len(cpu_model.layers)
    return report


if __name__ == "__main__":
    print(json.dumps({quant: check(quant) for quant in ("int8", "none")}))
