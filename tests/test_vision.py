"""Images in (issue 27), token-exact against transformers' own Gemma-4.

The tiny vision Gemma-4 (tests/support/vision.py: a two-layer tower, `use_bidirectional_attention="vision"`) is
exported with `--vision host` and served with the hf graph: greedy output for prompts with one and with two images
(text around them) equals `Gemma4ForConditionalGeneration.generate()` with the processor's `pixel_values`, token for
token, with prefill chunks smaller than the prompt (the plan keeps each image whole). The same prompt under a
causal-only mask gives other tokens, so the block mask is what makes the match. Prefix reuse keys on the image's
content: the same image again reuses its KV, another image behind the same placeholder ids does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from server.app.runtime import Host, load_host
from server.config import Settings
from server.engine.engine import Engine
from server.model.artifacts import ArtifactDir, GraphSpec
from server.tools.export import export
from server.vision.load import VisionUnavailable, plan_vision
from tests.support.vision import (
    NEW_TOKENS,
    ONE,
    TWO,
    check_a_causal_only_mask_differs,
    check_chat_images_give_transformers_tokens,
    check_greedy_with_images,
    data_url,
    engine_request,
    generate,
    picture,
    random_image,
    reference_generate,
    running_engine,
    served_openai,
    tiny_vision_checkpoint,
    vision_export,
)

MODEL = "tiny-vision"
BUCKET, MAX_TOTAL = 96, 256  # two images (~124 soft tokens) and their text take two chunks or more


def vision_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = dict(graph="hf", host="127.0.0.1", port=0, served_model_name=MODEL, lazy_grammar=True,
                                  vision="host", image_tokens=70)
    return Settings(**{**values, **overrides})


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return tiny_vision_checkpoint()


def exported(checkpoint: Path, dest: Path) -> Host:
    artifacts = vision_export(checkpoint, dest, prefill_bucket=BUCKET, max_total=MAX_TOTAL)
    return load_host(artifacts, "hf", MODEL, settings=vision_settings())


def running(host: Host) -> AbstractContextManager[Engine]:
    return running_engine(host, vision_settings(max_batch=1), 120)


@pytest.fixture(scope="module")
def host(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Host:
    return exported(checkpoint, tmp_path_factory.mktemp("vision") / "artifacts")


@pytest.fixture(scope="module")
def engine(host: Host) -> Iterator[Engine]:
    with running(host) as engine:
        yield engine


@pytest.mark.parametrize(("text", "names"), [(ONE, ["wide"]), (TWO, ["square", "wide"])])
def test_greedy_output_with_images_is_transformers_generate(host: Host, engine: Engine, checkpoint: Path,
                                                            text: str, names: list[str]) -> None:
    check_greedy_with_images(host, engine, checkpoint, text, names, BUCKET)


def test_a_causal_only_mask_would_give_other_tokens(checkpoint: Path) -> None:
    check_a_causal_only_mask_differs(checkpoint)


def test_the_same_image_reuses_its_kv_and_another_behind_the_same_ids_does_not(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # A window longer than the prompts: the hf graph's caches can rewind (see tiny_vision_checkpoint).
    checkpoint = tiny_vision_checkpoint(sliding_window=MAX_TOTAL)
    host = exported(checkpoint, tmp_path_factory.mktemp("reuse") / "artifacts")
    with running(host) as engine:
        reuse(host, engine, checkpoint)


def reuse(host: Host, engine: Engine, checkpoint: Path) -> None:
    first, _ = engine_request(host, ONE, [picture("wide")])
    _, finish = generate(engine, first)
    again, _ = engine_request(host, ONE.replace("briefly", "at length"), [picture("wide")])
    image_end = again.images[0].span[1]
    tokens, finish = generate(engine, again)
    assert finish.reused_tokens >= image_end  # the image's KV came from the first request
    other, inputs = engine_request(host, ONE.replace("briefly", "at length"), [random_image(96, 64, seed=7)])
    assert other.prompt_ids == again.prompt_ids and other.images[0].digest != again.images[0].digest
    tokens, finish = generate(engine, other)
    assert finish.reused_tokens <= other.images[0].offset
    assert tokens == reference_generate(checkpoint, inputs, NEW_TOKENS)


# ---------------------------------------------------------------- the HTTP routes, through the openai SDK


@pytest.fixture(scope="module")
def client(host: Host, engine: Engine) -> Iterator[OpenAI]:
    with served_openai(host, vision_settings()) as client:
        yield client


def test_chat_image_url_parts_give_transformers_tokens(host: Host, client: OpenAI, checkpoint: Path) -> None:
    check_chat_images_give_transformers_tokens(host, client, checkpoint, MODEL)


def test_responses_input_image_is_read(client: OpenAI) -> None:
    response = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                    {"type": "input_image", "image_url": data_url(picture("tall")), "detail": "auto"}]}])
    assert response.usage is not None and response.usage.input_tokens > 60  # the image's soft tokens count


@pytest.mark.parametrize(("url", "says"), [
    ("data:image/png;base64,AAAA", "not an image"),
    ("data:image/png;base64,@@@", "malformed"),
    ("data:text/plain,hello", "base64"),
    ("http://127.0.0.1:9/x.png", "--allow-image-urls"),
    ("file:///etc/passwd", "data: URL"),
])
def test_bad_images_are_400s_naming_the_part(client: OpenAI, url: str, says: str) -> None:
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1)  # type: ignore[misc,list-item]
    assert says in caught.value.message
    assert caught.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]


def test_an_export_without_the_tower_serves_no_images(checkpoint: Path, tmp_path: Path) -> None:
    artifacts = export(checkpoint, tmp_path / "artifacts", prefill_bucket=BUCKET, max_total=MAX_TOTAL)  # --vision off
    assert not (artifacts / "vision.safetensors").exists()
    assert (artifacts / "cfg" / "preprocessor_config.json").is_file()  # the processor's settings are always kept
    auto = load_host(artifacts, "hf", MODEL, settings=vision_settings(vision="auto"))
    assert auto.images is None and auto.info.images is None and "export --vision host" in auto.vision.reason
    with pytest.raises(VisionUnavailable, match="vision.safetensors"):
        load_host(artifacts, "hf", MODEL, settings=vision_settings(vision="host"))
    # a graph that takes no image blocks would mask images causally: refused, not served wrong
    with pytest.raises(VisionUnavailable, match="block_ids"):
        plan_vision("host", ArtifactDir(artifacts), "jit", GraphSpec(), None)  # built without --vision


def test_an_exported_tower_is_transformers_own(host: Host, checkpoint: Path) -> None:
    import torch
    from transformers.models.gemma4 import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert host.images is not None and host.vision.load is not None
    encoder = host.vision.load()
    image = host.images.prepare(picture("tall"), 70)  # the only budget a 96-token chunk holds
    pixels, positions = torch.from_numpy(image.pixel_values)[None], torch.from_numpy(image.position_ids)[None]
    with torch.inference_mode():
        (expected,) = model.model.get_image_features(pixels, positions, return_dict=True).pooler_output
    soft = encoder.encode(pixels, positions, 70)
    assert soft.shape == (image.soft_tokens, 64) and torch.equal(soft, expected)
