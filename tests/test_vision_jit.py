"""Images in through the compiled path (issue 27): `serve --graph jit --vision auto` on the recipe's `--vision` build,
token-exact against transformers' own Gemma-4.

The tiny vision Gemma-4 of tests/support/vision.py (a two-layer tower, `use_bidirectional_attention="vision"`, a
sliding window of 24 shorter than an image's soft tokens; its table rounded to bf16 as the artifact's is) is built
by the recipe on CPU as a v3 and a v2 artifact: `--vision --vision-budgets 70,280` (the recipe insists on the
processor's default 280; only 70 fits the one prefill bucket of 96, so that is what the server offers). The
two-image prompt takes two chunks, each image whole in one. `load_host(..., "jit")` with `--vision auto` must pick
the traced vision graph (`graph`), and the engine, which encodes each image with that graph and prefills its soft
tokens with their block ids, must give transformers' greedy `generate()` (the processor's `pixel_values`) token for
token for prompts with one and with two images, text around them; a causal-only mask would not. The openai SDK's
image parts (chat `image_url`, Responses `input_image`) reach the same server unmodified.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from server.app.runtime import Host, load_host
from server.config import Settings
from server.engine.engine import Engine
from server.graphs.vision import VisionGraph
from tests.support.recipe_helpers import SCRIPT
from tests.support.vision import (
    ONE,
    SOFT_TOKENS,
    TWO,
    check_a_causal_only_mask_differs,
    check_chat_images_give_transformers_tokens,
    check_greedy_with_images,
    data_url,
    picture,
    running_engine,
    served_openai,
    tiny_vision_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "tiny-vision-jit"
BUCKET, MAX_TOTAL = 96, 256  # one image (<= 70 soft tokens) and its markers fit a chunk; two images take two


def jit_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = dict(graph="jit", host="127.0.0.1", port=0, served_model_name=MODEL, lazy_grammar=True,
                                  vision="auto", image_tokens=SOFT_TOKENS, max_batch=1)
    return Settings(**{**values, **overrides})


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return tiny_vision_checkpoint(bf16_table=True)


def build(checkpoint: Path, out: Path, contract: str) -> Path:
    """The recipe's CPU build of `checkpoint` with the vision graph, the tiniest that holds the tests' prompts."""
    extra = ["--kv-slots", "1", "--decode-batches", "1"] if contract == "v3" else []
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
         "--contract", contract, "--max-total", str(MAX_TOTAL), "--prefill-buckets", str(BUCKET), "--quant", "none",
         "--weights", "separate", "--vision", "--vision-budgets", f"{SOFT_TOKENS},280", *extra],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module", params=["v3", "v2"])
def host(request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Host:
    contract = request.param
    artifacts = build(checkpoint, tmp_path_factory.mktemp(f"vision-jit-{contract}") / "artifacts", contract)
    return load_host(artifacts, "jit", MODEL, settings=jit_settings())


@pytest.fixture(scope="module")
def engine(host: Host) -> Iterator[Engine]:
    with running_engine(host, jit_settings(), 300) as engine:
        yield engine


def test_auto_serves_the_recipes_vision_graph(host: Host) -> None:
    assert host.graph_kind == "jit" and host.spec.block_ids
    assert host.vision.mode == "graph" and host.vision.budgets == (SOFT_TOKENS,)  # 280 does not fit a 96 chunk
    assert host.images is not None and host.info.images is not None
    assert host.vision.load is not None
    assert isinstance(host.vision.load(), VisionGraph)  # what the engine encodes images with: the traced tower


@pytest.mark.parametrize(("text", "names"), [(ONE, ["wide"]), (TWO, ["square", "wide"])])
def test_greedy_output_with_images_is_transformers_generate(host: Host, engine: Engine, checkpoint: Path,
                                                            text: str, names: list[str]) -> None:
    check_greedy_with_images(host, engine, checkpoint, text, names, BUCKET)


def test_a_causal_only_mask_would_give_other_tokens(checkpoint: Path) -> None:
    check_a_causal_only_mask_differs(checkpoint)


@pytest.fixture(scope="module")
def client(host: Host, engine: Engine) -> Iterator[OpenAI]:
    with served_openai(host, jit_settings()) as client:
        yield client


def test_the_openai_sdk_sends_images_unmodified(host: Host, client: OpenAI, checkpoint: Path) -> None:
    check_chat_images_give_transformers_tokens(host, client, checkpoint, MODEL)
    response = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                    {"type": "input_image", "image_url": data_url(picture("tall")), "detail": "auto"}]}])
    assert response.usage is not None and response.usage.input_tokens > 60  # the image's soft tokens count
