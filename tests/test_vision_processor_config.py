"""Images from a checkpoint transformers 5 saves (issue 36): `Gemma4ForConditionalGeneration.save_pretrained` +
`Gemma4Processor.save_pretrained`, which writes the image processor's settings into processor_config.json only (no
preprocessor_config.json), and a chat template of its own that writes image parts (`{"type": "image"}`) itself.

- `export --vision host` takes processor_config.json; asked for vision without either file it refuses at export time;
  `serve --vision host` on an export without them names the fix.
- The prompt ids the engine receives for chat messages with one and two 64x64 images equal
  `Gemma4Processor.apply_chat_template(..., tokenize=True)`'s (the template places the image token; the server's
  "\\n" between content parts is not added around it), and greedy answers are transformers' `generate()`'s.

`Gemma4Processor` insists on a video processor, whose class needs torchvision (absent beside the CPU torch): its slot
takes the image processor here (the same settings; no video is processed).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from server.app.runtime import Host, build_engine, load_host
from server.config import Settings
from server.model.artifacts import ArtifactDir, GraphSpec
from server.tools.export import export
from server.vision.load import VisionUnavailable, plan_vision
from tests.support.api_fixtures import live_server
from tests.support.gemma4_app import Prompts
from tests.support.vision import (
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    image_processor,
    random_image,
    reference_generate,
    tiny_vision_config,
    tiny_vision_model,
    vision_cfg_dir,
)

MODEL = "tiny-vision-t5"
BUCKET, MAX_TOTAL = 192, 256  # two images (~2 x 66 soft tokens at 64x64) and their text in one chunk
NEW_TOKENS = 6
# The tests' Gemma-4 template, writing image parts as the image token, in place (as the published templates do).
TEXT_PARTS = "{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
ALL_PARTS = ("{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
             "{%- elif part['type'] == 'image' -%}" + IMAGE_TOKEN + "{%- endif -%}{%- endfor -%}")


def processor(template: str) -> Any:
    from transformers import AutoTokenizer, processing_utils
    from transformers.models.gemma4 import Gemma4AudioFeatureExtractor, Gemma4Processor

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def without_torchvision(self: Any, name: str, argument: Any) -> Any:
        return None if name == "video_processor" else check(self, name, argument)

    tokenizer = AutoTokenizer.from_pretrained(vision_cfg_dir())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processing_utils.ProcessorMixin, "check_argument_for_proper_class", without_torchvision)
        return Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor(),
                               tokenizer=tokenizer, video_processor=image_processor(), chat_template=template)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The checkpoint as transformers 5 saves it, and its processor."""
    template = (vision_cfg_dir() / "chat_template.jinja").read_text(encoding="utf-8")
    assert TEXT_PARTS in template
    proc = processor(template.replace(TEXT_PARTS, ALL_PARTS))
    dest = tmp_path_factory.mktemp("t5") / "checkpoint"
    tiny_vision_model(tiny_vision_config({"sliding_window": 24})).save_pretrained(dest)
    proc.save_pretrained(dest)
    assert (dest / "processor_config.json").is_file() and not (dest / "preprocessor_config.json").exists()
    assert "image_processor" in json.loads((dest / "processor_config.json").read_text(encoding="utf-8"))
    return dest, proc


def settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = dict(graph="hf", host="127.0.0.1", port=0, served_model_name=MODEL, lazy_grammar=True,
                                  vision="host", image_tokens=70)
    return Settings(**{**values, **overrides})


@pytest.fixture(scope="module")
def artifacts(saved: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(saved[0], tmp_path_factory.mktemp("t5") / "artifacts", prefill_bucket=BUCKET, max_total=MAX_TOTAL,
                  vision="host")


@pytest.fixture(scope="module")
def host(artifacts: Path) -> Host:
    assert (artifacts / "cfg" / "processor_config.json").is_file()
    return load_host(artifacts, "hf", MODEL, settings=settings())


def test_an_export_without_the_image_processor_settings_is_refused(saved: tuple[Path, Any], artifacts: Path,
                                                                   tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(saved[0], bare)
    (bare / "processor_config.json").unlink()
    with pytest.raises(ValueError, match=r"preprocessor_config\.json or processor_config\.json"):
        export(bare, tmp_path / "never", prefill_bucket=BUCKET, max_total=MAX_TOTAL, vision="host")
    assert not (tmp_path / "never").exists() and not (tmp_path / "never.partial").exists()
    # an export that lost them (copied by hand, say): serve --vision host names the fix
    copied = tmp_path / "copied"
    shutil.copytree(artifacts, copied)
    (copied / "cfg" / "processor_config.json").unlink()
    with pytest.raises(VisionUnavailable, match="export again from a checkpoint that has them"):
        plan_vision("host", ArtifactDir(copied), "hf", GraphSpec.from_json(
            json.loads((copied / "graph.json").read_text(encoding="utf-8"))), None)


@pytest.fixture(scope="module")
def served(host: Host) -> Iterator[tuple[OpenAI, Prompts]]:
    config = settings()
    engine = build_engine(host, config)
    prompts = Prompts(engine)
    with live_server(config, engine, host) as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120), prompts


@pytest.mark.parametrize("count", [1, 2])
def test_prompt_ids_with_images_are_the_processors_and_answers_transformers(
        saved: tuple[Path, Any], host: Host, served: tuple[OpenAI, Prompts], count: int) -> None:
    import base64
    import io

    import torch

    checkpoint, proc = saved
    client, prompts = served
    pictures = [random_image(64, 64, seed=seed) for seed in range(count)]

    def url(picture: Any) -> str:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    words = ["Describe", "and compare it with"][:count]
    sent: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    for word, picture in zip(words, pictures, strict=True):
        sent += [{"type": "text", "text": word}, {"type": "image_url", "image_url": {"url": url(picture)}}]
        theirs += [{"type": "text", "text": word}, {"type": "image", "image": picture}]
    sent.append({"type": "text", "text": "briefly."})
    theirs.append({"type": "text", "text": "briefly."})
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": sent}],  # type: ignore[misc]
                                            max_tokens=NEW_TOKENS, temperature=0, logprobs=True)
    expected = proc.apply_chat_template([{"role": "user", "content": theirs}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    assert list(prompts.last) == ids  # the 84 vs 83 (one image), 150 vs 148 (two): one "\n" per join
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    inputs = {"input_ids": expected["input_ids"], "mm_token_type_ids": (expected["input_ids"] == IMAGE_TOKEN_ID).long(),
              "pixel_values": expected["pixel_values"], "image_position_ids": expected["image_position_ids"]}
    assert inputs["mm_token_type_ids"].sum() > 0 and isinstance(inputs["pixel_values"], torch.Tensor)
    tokens = reference_generate(checkpoint, inputs, NEW_TOKENS)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    got = [bytes(item.bytes or []) for item in logprobs.content]
    assert got and got == [host.tokenizer.decode([t]).encode() for t in tokens][: len(got)]
