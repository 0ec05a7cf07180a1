"""Which vision encoder serves (`--vision`), and what the HTTP layer is told: the `ImageReader`, or none.

- auto: the compiled vision graph, when graph.json declares one (`vision_graph_budgets`); else the host encoder,
  when the export kept vision.safetensors; else off.
- host: the host encoder; a start-up error when the export has no vision.safetensors or the model reads no images.
- off: image parts are a 400, as on a text-only model.

An image's soft tokens attend to each other both ways on the layers the model's config names
(`use_bidirectional_attention: "vision"`): the language graph must take `block_ids` (server.graphs.base). One that
does not would answer images with causal masks, that is wrong tokens: such a graph serves no images (host: an error
at start-up; auto: off, logged).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.model.artifacts import IMAGE_PROCESSOR_FILES, ArtifactDir, GraphSpec, image_processor_file

if TYPE_CHECKING:
    from server.graphs.base import VisionEncoder

log = logging.getLogger(__name__)

HOST_BUDGETS = (70, 140, 280, 560, 1120)


class VisionUnavailable(ValueError):
    """--vision host where it cannot serve (no tower in the export, a graph without image blocks): a start-up error."""


def vision_graph_budgets(art: ArtifactDir, spec: GraphSpec) -> tuple[int, ...]:
    """The soft-token budgets of the compiled vision graph graph.json declares (a recipe `--vision` build; ascending),
    or () when it declares none."""
    return tuple(sorted(spec.vision.budgets)) if spec.vision is not None else ()


def load_vision_graph(art: ArtifactDir, spec: GraphSpec) -> VisionEncoder:
    """The compiled vision graph graph.json declares, loaded (on the engine's device thread; server.graphs.vision).
    Called only when `vision_graph_budgets` is not ()."""
    from server.graphs.vision import load_vision_graph as load

    return load(art.root, spec)


@dataclass(frozen=True, slots=True)
class VisionPlan:
    mode: str  # graph | host | off (resolved)
    budgets: tuple[int, ...] = ()  # what the encoder takes and one prefill chunk holds, ascending
    load: Callable[[], VisionEncoder] | None = None  # run on the engine's device thread
    reason: str = ""  # off: why (logged; told to a client that sends an image)


def model_config(art: ArtifactDir) -> Any:
    """The model's transformers config (its defaults filled in: save_pretrained leaves out what equals them)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(art.cfg)


def model_reads_images(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def graph_takes_blocks(kind: str, spec: GraphSpec) -> bool:
    """Does the language graph of this kind take `block_ids` (the image-block contract, server.graphs.base)?"""
    if kind in ("hf", "null"):  # the null graph takes them and computes nothing either way
        return True
    if kind == "jit":  # a recipe --vision build: its prefill graphs take the ids (graph.json `block_ids`)
        return spec.block_ids
    return False


def plan_vision(mode: str, art: ArtifactDir, kind: str, spec: GraphSpec, dtype: Any) -> VisionPlan:
    """`--vision` resolved for this artifact directory and graph (see the module docs)."""
    if mode == "off":
        return VisionPlan("off", reason="images are off on this server (--vision off)")
    raw = json.loads((art.cfg / "config.json").read_text(encoding="utf-8"))
    if not raw.get("vision_config"):  # a text-only model: decided without importing transformers (start-up time)
        if mode == "host":
            raise VisionUnavailable("--vision host: this model reads no images (its config has no vision tower)")
        return VisionPlan("off", reason="this is a text-only model")
    config = model_config(art)
    problem = None
    if not model_reads_images(config):
        problem = "this model reads no images (its config has no vision tower)"
    elif image_processor_file(art.cfg) is None:
        problem = (f"the export has no image processor settings ({' or '.join(IMAGE_PROCESSOR_FILES)} in {art.cfg}): "
                   "export again from a checkpoint that has them (transformers' Gemma4Processor.save_pretrained "
                   f"writes {IMAGE_PROCESSOR_FILES[1]}), or copy the checkpoint's file into {art.cfg}")
    elif (getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"
          and not graph_takes_blocks(kind, spec)):
        problem = f"the {kind} graph takes no image blocks (block_ids), which this model's attention needs"
    chunk = spec.prefill_bucket  # an image's soft tokens are prefilled in one call
    graph_budgets = vision_graph_budgets(art, spec)
    if problem is None and graph_budgets and mode == "auto":
        budgets = tuple(b for b in graph_budgets if b <= chunk)
        return VisionPlan("graph", budgets, lambda: load_vision_graph(art, spec)) if budgets else \
            VisionPlan("off", reason=f"no vision budget fits a {chunk}-token prefill chunk")
    weights = art.vision_file
    if problem is None and weights is None:
        problem = f"the export kept no vision tower ({art.root}/vision.safetensors: export --vision host)"
    budgets = tuple(b for b in HOST_BUDGETS if b <= chunk)
    if problem is None and not budgets:
        problem = f"an image's soft tokens (70 at least) do not fit one {chunk}-token prefill chunk"
    if problem is not None:
        if mode == "host":
            raise VisionUnavailable(f"--vision host: {problem}")
        log.info("images off: %s", problem)
        return VisionPlan("off", reason=problem)

    def load() -> VisionEncoder:
        from server.vision.host import HostVisionEncoder

        assert weights is not None
        return HostVisionEncoder.from_export(weights, art.cfg, dtype, budgets)

    return VisionPlan("host", budgets, load)


def media_tokens(config: Any, tokenizer: Any) -> tuple[str, str, str]:
    """(begin-of-image, image soft token, end-of-image) texts, from the ids the model's config names."""
    texts = tuple(tokenizer.convert_ids_to_tokens(int(getattr(config, key)))
                  for key in ("boi_token_id", "image_token_id", "eoi_token_id"))
    if not all(isinstance(text, str) and text for text in texts):
        raise ValueError(f"the tokenizer has no text for the config's image tokens: {texts}")
    return texts  # type: ignore[return-value]
