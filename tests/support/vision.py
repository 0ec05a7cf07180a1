"""A tiny random Gemma-4 that reads images (issue 27), saved like a real checkpoint, and the reference it must match.

- `vision_cfg_dir()`: the Gemma-4-format tokenizer (tests/support/gemma4_tokenizer.py) with Gemma-4's image, audio
  and video tokens written over the Gemma-3 ids the published tokenizer gives them (`<|image>` 255999 over
  `<start_of_image>`, `<|image|>` 258880 and `<image|>` 258882 over `<unusedN>`, ...), and named in
  tokenizer_config.json's `extra_special_tokens`: transformers' Gemma-4 processing reads `image_token`,
  `boi_token`, `eoi_token` from there.
- `tiny_vision_checkpoint()`: `Gemma4ForConditionalGeneration` with a two-layer vision tower (patch 16, pooling 3,
  as the real one) and `use_bidirectional_attention="vision"`, plus that tokenizer and the PIL image processor's
  preprocessor_config.json (`max_soft_tokens` 70, the smallest it allows). `tiny_vision_config()` /
  `tiny_vision_model()` build it in memory, other text configs and towers too (tests/test_vision_graph.py's).
- `reference_prompt()` / `reference_generate()`: what transformers itself does with a prompt and images: the
  processor's expansion of each `<|image|>` into `<|image>` + n soft tokens + `<image|>` (n from the image processor,
  per image), `mm_token_type_ids` (1 on soft tokens: the bidirectional blocks), `pixel_values`, greedy `generate()`.
  `Gemma4Processor` itself cannot be built here (it insists on a video processor, whose check imports torchvision,
  broken beside the CPU torch), so this is the processor's own text expansion, from its parts.
- `ONE` / `TWO` (prompts with one and two images, text around them), `picture()`, `engine_request()`, `generate()`,
  `data_url()`, `chat_text()`: what the parity tests of every graph (hf: tests/test_vision.py; the recipe's jit
  graph: tests/test_vision_jit.py) submit and compare.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.gemma4_tokenizer import gemma4_cfg_dir
from tests.support.models import cache_root, round_table_to_bf16, save_checkpoint, tiny_gemma4_config

# Gemma-4's multimodal tokens (ids as in transformers' Gemma4Config defaults) and the Gemma-3 ids they replace.
MEDIA_TOKENS: dict[str, tuple[int, str]] = {
    "<|image>": (255999, "boi_token"),  # <start_of_image>
    "<|audio>": (256000, "boa_token"),  # <end_of_image>
    "<|image|>": (258880, "image_token"),  # <unused2978>
    "<|audio|>": (258881, "audio_token"),
    "<image|>": (258882, "eoi_token"),
    "<audio|>": (258883, "eoa_token"),
    "<|video|>": (258884, "video_token"),
}
IMAGE_TOKEN, BOI, EOI = "<|image|>", "<|image>", "<image|>"
IMAGE_TOKEN_ID = MEDIA_TOKENS[IMAGE_TOKEN][0]
SOFT_TOKENS = 70  # the processor's smallest budget: the fixture's default
_VERSION = "v1"
NEW_TOKENS = 8
TWO = "<bos><|turn>user\nLook at <|image|> and then at <|image|>, what changed?<turn|>\n<|turn>model\n"
ONE = "<bos><|turn>user\nDescribe <|image|> briefly.<turn|>\n<|turn>model\n"
PICTURES = {"square": (64, 64, 1), "wide": (96, 64, 2), "tall": (48, 80, 3)}  # width, height, seed

if TYPE_CHECKING:
    from server.app.runtime import Host
    from server.config import Settings
    from server.engine.engine import Engine
    from server.engine.types import Finish, GenerationRequest


def vision_cfg_dir(root: Path | None = None) -> Path:
    """The Gemma-4 tokenizer directory with the media tokens (see the module docstring), built once per cache."""
    dest = (root or cache_root()) / f"gemma4-vision-tokenizer-{_VERSION}"
    if (dest / "tokenizer.json").is_file():
        return dest
    source = gemma4_cfg_dir(root)
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    data = json.loads((staging / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {token["id"]: token for token in data["added_tokens"]}
    vocab: dict[str, int] = data["model"]["vocab"]
    for text, (token_id, _) in MEDIA_TOKENS.items():
        old = by_id[token_id]["content"]
        by_id[token_id].update(content=text, special=True)
        vocab.pop(old, None)
        vocab[text] = token_id
    (staging / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = json.loads((staging / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["extra_special_tokens"] = {name: text for text, (_, name) in MEDIA_TOKENS.items()}
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    staging.rename(dest)
    return dest


# The tower: two layers, patch 16 and pooling 3 as the real one (the processor's patches are 16 x 16 pixels).
TOWER: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3,
                             position_embedding_size=1024)


def tiny_vision_config(text: dict[str, Any] | None = None, **tower: Any) -> Any:
    """`Gemma4Config` of the tiny vision Gemma-4: `text` overrides tests/support/models.py's tiny Gemma-4 text config
    (always with `use_bidirectional_attention="vision"`), `tower` overrides TOWER."""
    from transformers.models.gemma4 import Gemma4Config, Gemma4VisionConfig

    language = tiny_gemma4_config(**{**(text or {}), "use_bidirectional_attention": "vision"})
    vision = Gemma4VisionConfig(**{**TOWER, **tower})
    return Gemma4Config(text_config=language.to_dict(), vision_config=vision.to_dict(),
                        audio_config=None, boi_token_id=MEDIA_TOKENS[BOI][0], eoi_token_id=MEDIA_TOKENS[EOI][0],
                        image_token_id=IMAGE_TOKEN_ID, video_token_id=MEDIA_TOKENS["<|video|>"][0],
                        audio_token_id=MEDIA_TOKENS["<|audio|>"][0], tie_word_embeddings=True)


def tiny_vision_model(config: Any, seed: int = 1) -> Any:
    """A random `Gemma4ForConditionalGeneration` of `config` whose soft tokens matter (see below), in eval mode."""
    import torch
    from transformers.models.gemma4 import Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # As tiny_gemma4_checkpoint: an embedding that matters beside the layers, layer scalars != 1. And a projection
        # large enough that the soft tokens (and so the block mask among them) move the logits: with seed 1 and 0.2 a
        # causal-only mask changes the first token of the tests' two-image prompt, and greedy output is not one
        # token repeated.
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for index, layer in enumerate(model.model.language_model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * index)
        model.model.embed_vision.embedding_projection.weight.normal_(0, 0.2)
    return model


def image_processor(max_soft_tokens: int = SOFT_TOKENS) -> Any:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens, patch_size=16, pooling_kernel_size=3)


def tiny_vision_checkpoint(dest: Path | None = None, *, seed: int = 1, sliding_window: int = 24,
                           bf16_table: bool = False) -> Path:
    """Save the tiny vision Gemma-4 + tokenizer + image processor into `dest` (default: the test cache), once.
    The default window (24) is smaller than an image's soft tokens; a window longer than the tests' prompts lets
    the hf graph rewind its caches (transformers' sliding ring cannot once it wrapped), for the prefix-reuse tests.
    `bf16_table`: the (tied) embedding rounded to bf16, so that the recipe's artifact (its table is bf16) and the
    f32 reference read the same rows and the same lm_head."""
    table = "-bf16" if bf16_table else ""
    dest = dest or cache_root() / f"gemma4-vision-{_VERSION}-{seed}-w{sliding_window}{table}"
    if (dest / "config.json").is_file():
        return dest
    model = tiny_vision_model(tiny_vision_config({"sliding_window": sliding_window}), seed)
    if bf16_table:
        round_table_to_bf16(model)
    return save_checkpoint(model, dest, _add_vision_files)


def vision_export(checkpoint: Path, dest: Path, *, prefill_bucket: int, max_total: int) -> Path:
    """`export --vision host` of a tiny vision checkpoint into `dest`, served with `vision_cfg_dir()`'s tokenizer and
    template (the media tokens and Gemma-4's tool calls): the artifact directory."""
    from server.tools.export import export

    artifacts = export(checkpoint, dest, prefill_bucket=prefill_bucket, max_total=max_total, vision="host")
    cfg = vision_cfg_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(cfg / name, artifacts / "cfg" / name)
    (artifacts / "cfg" / "special_tokens_map.json").unlink(missing_ok=True)
    return artifacts


def _add_vision_files(staging: Path) -> None:
    """The vision checkpoint's tokenizer and template (vision_cfg_dir's) and its image processor."""
    cfg = vision_cfg_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(cfg / name, staging / name)
    image_processor().save_pretrained(staging)


def random_image(width: int, height: int, seed: int = 0) -> Any:
    """A PIL RGB image of random pixels (smooth enough to survive resizing differently per seed)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)


def png_bytes(image: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def reference_prompt(text: str, images: list[Any], max_soft_tokens: int = SOFT_TOKENS) -> dict[str, Any]:
    """transformers' inputs for `text` (one `<|image|>` per image) and `images`: input_ids, mm_token_type_ids,
    pixel_values, image_position_ids, as Gemma4Processor builds them."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vision_cfg_dir())
    assert text.count(IMAGE_TOKEN) == len(images)
    features = image_processor(max_soft_tokens)(images, return_tensors="pt") if images else None
    pieces = text.split(IMAGE_TOKEN)
    expanded = pieces[0]
    for index, piece in enumerate(pieces[1:]):
        count = int(features["num_soft_tokens_per_image"][index]) if features is not None else 0
        expanded += BOI + IMAGE_TOKEN * count + EOI + piece
    ids = torch.tensor([tokenizer.encode(expanded, add_special_tokens=False)])  # [1, T]
    inputs: dict[str, Any] = {"input_ids": ids, "mm_token_type_ids": (ids == IMAGE_TOKEN_ID).long()}
    if features is not None:
        inputs.update(pixel_values=features["pixel_values"], image_position_ids=features["image_position_ids"])
    return inputs


def reference_generate(checkpoint: Path, inputs: dict[str, Any], max_new_tokens: int, *,
                       bidirectional: bool = True) -> list[int]:
    """Greedy `generate()` of transformers' own model: the new token ids. `bidirectional=False` drops
    `mm_token_type_ids`, so the model masks image tokens causally (what a missing block mask would do)."""
    import torch
    from transformers.models.gemma4 import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    kwargs = dict(inputs)
    if not bidirectional:
        kwargs.pop("mm_token_type_ids")
    with torch.inference_mode():
        out = model.generate(**kwargs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def picture(name: str) -> Any:
    return random_image(*PICTURES[name])


def engine_request(host: Host, text: str, pictures: list[Any],
                   new_tokens: int = NEW_TOKENS) -> tuple[GenerationRequest, dict[str, Any]]:
    """The engine's greedy request for `text` (an `<|image|>` per picture) as transformers' processor expands it, and
    the reference inputs (`reference_prompt`)."""
    import dataclasses

    from server.engine.types import GenerationRequest
    from server.sampling.params import SamplingParams

    inputs = reference_prompt(text, pictures)
    ids = inputs["input_ids"][0].tolist()
    assert host.images is not None
    images = [host.images.prepare(picture, SOFT_TOKENS) for picture in pictures]
    starts = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN_ID and (i == 0 or ids[i - 1] != IMAGE_TOKEN_ID)]
    placed = tuple(dataclasses.replace(image, offset=start) for image, start in zip(images, starts, strict=True))
    return GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=new_tokens, sampling=SamplingParams(temperature=0.0),
                             ignore_eos=True, images=placed), inputs


def generate(engine: Engine, req: GenerationRequest) -> tuple[list[int], Finish]:
    """`req` through the running engine: its token ids and its finish."""
    import asyncio

    async def go() -> tuple[list[int], Finish]:
        done = await engine.submit(req).result()
        return done.token_ids, done.finish

    return asyncio.run(go())


def data_url(image: Any) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def chat_text(host: Host, content: str) -> str:
    """The prompt text the server renders for one user turn (the protocol's, then the template's)."""
    inputs = host.protocol.prompt_inputs([{"role": "user", "content": content}])
    return host.tokenizer.apply_chat_template(inputs.messages, add_generation_prompt=True, **inputs.template_kwargs)


def check_chat_images_give_transformers_tokens(host: Host, client: Any, checkpoint: Path, model: str) -> None:
    """Through the `openai` SDK, unmodified: a chat turn with two `image_url` parts (text around them; the second at
    `detail: low`) is prefilled as transformers' processor expands it (usage.prompt_tokens) and answers transformers'
    greedy tokens (compared by the logprobs' bytes: the SDK returns text, not ids)."""
    square, wide = picture("square"), picture("wide")
    content = [{"type": "text", "text": "Look at"}, {"type": "image_url", "image_url": {"url": data_url(square)}},
               {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": data_url(wide),
                                                                                    "detail": "low"}}]
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                            max_tokens=NEW_TOKENS, temperature=0, logprobs=True)
    inputs = reference_prompt(chat_text(host, f"Look at\n{IMAGE_TOKEN}\nand\n{IMAGE_TOKEN}"), [square, wide])
    assert answer.usage is not None and answer.usage.prompt_tokens == inputs["input_ids"].shape[1]
    expected = reference_generate(checkpoint, inputs, NEW_TOKENS)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    got = [bytes(item.bytes or []) for item in logprobs.content]
    assert got and got == [host.tokenizer.decode([t]).encode() for t in expected][: len(got)]


def check_greedy_with_images(host: Host, engine: Engine, checkpoint: Path, text: str, names: list[str],
                             bucket: int) -> None:
    """Greedy output for `text` with the named pictures equals transformers' generate() with the processor's
    pixel_values, the whole prompt computed (no cached prefix), in chunks of at most `bucket` tokens."""
    req, inputs = engine_request(host, text, [picture(n) for n in names])
    expected = reference_generate(checkpoint, inputs, NEW_TOKENS)
    engine.prefix_reuse = False  # every run computes its prompt: what the comparison is about
    try:
        tokens, finish = generate(engine, req)
    finally:
        engine.prefix_reuse = True
    assert tokens == expected
    assert finish.prompt_tokens == len(req.prompt_ids) and finish.prefill_calls >= -(-len(req.prompt_ids) // bucket)


def check_a_causal_only_mask_differs(checkpoint: Path) -> None:
    """The block mask matters for this checkpoint: without it transformers itself gives other tokens."""
    inputs = reference_prompt(TWO, [picture("square"), picture("wide")])
    assert reference_generate(checkpoint, inputs, NEW_TOKENS) != reference_generate(checkpoint, inputs, NEW_TOKENS,
                                                                                    bidirectional=False)


@contextmanager
def running_engine(host: Host, settings: Settings, ready_s: float) -> Iterator[Engine]:
    """An engine on `host`, started and ready (else the test fails saying why), stopped afterwards."""
    from server.app.runtime import build_engine

    engine = build_engine(host, settings)
    engine.start()
    assert engine.wait_ready(ready_s), engine.state_reason
    try:
        yield engine
    finally:
        engine.stop()


@contextmanager
def served_openai(host: Host, settings: Settings) -> Iterator[Any]:
    """The `openai` SDK on a live server of `host` (its own engine)."""
    from openai import OpenAI

    from server.app.runtime import build_engine
    from tests.support.api_fixtures import live_server

    with live_server(settings, build_engine(host, settings), host) as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
