"""Anthropic's `image` blocks on the Messages API, with the official `anthropic` SDK, unmodified.

The tiny vision Gemma-4 (tests/support/vision.py) served with `--vision host` on the hf graph, as tests/test_vision.py
serves it, once for the module. An image block is read by the chat path's own reader (translated onto a chat
`image_url` part): the engine is given the same prompt ids and the same images (their content hashes and offsets) as
chat with the same image as an `image_url` part, so the greedy answer is chat's, and chat's is transformers'
`generate()` with the processor's `pixel_values` (checked again here, token for token). Streamed, counted
(`count_tokens` = usage), inside a `tool_result`, from a `url` source (with --allow-image-urls), and bad images as
the SDK's `BadRequestError` naming the block.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from server.api.messages.schemas import MessagesRequest
from server.api.messages.translate import check_images
from server.app.runtime import Host, build_engine, load_host
from server.engine.engine import Engine
from server.errors import AnthropicError
from tests.support.api_fixtures import LiveServer, live_server
from tests.support.vision import (
    IMAGE_TOKEN,
    NEW_TOKENS,
    chat_text,
    data_url,
    picture,
    png_bytes,
    reference_generate,
    reference_prompt,
    tiny_vision_checkpoint,
    vision_export,
)
from tests.test_vision import BUCKET, MAX_TOTAL, MODEL, vision_settings

CAMERA = {"name": "camera", "description": "What the camera sees.", "input_schema": {"type": "object",
                                                                                     "properties": {}}}
CALL = {"id": "toolu_1", "name": "camera", "input": {}}


def image_block(image: Any, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": base64.b64encode(png_bytes(image)).decode()}}


def image_part(image: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


class Submitted:
    """What every request submitted to the engine: its prompt ids and its images (content hash, offset, budget)."""

    def __init__(self, engine: Engine) -> None:
        self.requests: list[tuple[tuple[int, ...], tuple[tuple[bytes, int, int], ...]]] = []
        submit_all = engine.submit_all

        def recording(requests: Sequence[Any]) -> Any:
            self.requests += [(r.prompt_ids, tuple((i.digest, i.offset, i.budget) for i in r.images)) for r in requests]
            return submit_all(requests)

        engine.submit_all = recording  # type: ignore[method-assign]

    @property
    def last(self) -> tuple[tuple[int, ...], tuple[tuple[bytes, int, int], ...]]:
        return self.requests[-1]


class Pictures(BaseHTTPRequestHandler):
    """Serves PNGs by path (`/wide.png`), for url sources."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = png_bytes(picture(self.path.strip("/").removesuffix(".png")))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return tiny_vision_checkpoint()


@pytest.fixture(scope="module")
def host(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Host:
    artifacts = vision_export(checkpoint, tmp_path_factory.mktemp("vision") / "artifacts", prefill_bucket=BUCKET,
                              max_total=MAX_TOTAL)
    return load_host(artifacts, "hf", MODEL, settings=vision_settings(allow_image_urls=True))


@pytest.fixture(scope="module")
def live(host: Host) -> Iterator[tuple[LiveServer, Submitted]]:
    config = vision_settings(allow_image_urls=True)
    engine = build_engine(host, config)
    submitted = Submitted(engine)
    with live_server(config, engine, host) as server:
        yield server, submitted


@pytest.fixture(scope="module")
def client(live: tuple[LiveServer, Submitted]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live[0].url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(live: tuple[LiveServer, Submitted]) -> OpenAI:
    return OpenAI(base_url=f"{live[0].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def submitted(live: tuple[LiveServer, Submitted]) -> Submitted:
    return live[1]


@pytest.fixture(scope="module")
def pictures_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Pictures)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_image_blocks_are_chats_image_url_parts_and_transformers_tokens(
        host: Host, checkpoint: Path, client: anthropic.Anthropic, chat: OpenAI, submitted: Submitted) -> None:
    square, wide = picture("square"), picture("wide")
    blocks = [{"type": "text", "text": "Look at"}, image_block(square), {"type": "text", "text": "and"},
              image_block(wide)]
    m = client.messages.create(model=MODEL, max_tokens=NEW_TOKENS, messages=[{"role": "user", "content": blocks}],  # type: ignore[list-item,misc]
                               extra_body={"temperature": 0})
    sent = submitted.last
    parts = [{"type": "text", "text": "Look at"}, image_part(square), {"type": "text", "text": "and"}, image_part(wide)]
    answer = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
                                          max_tokens=NEW_TOKENS, temperature=0, logprobs=True)
    assert submitted.last == sent and len(sent[1]) == 2  # the same prompt ids, the same images at the same offsets
    assert text_of(m) == (answer.choices[0].message.content or "")
    assert answer.usage is not None and m.usage.output_tokens == answer.usage.completion_tokens
    prompt_tokens = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert prompt_tokens == answer.usage.prompt_tokens == len(sent[0])
    # ... and chat's greedy tokens are transformers' own for that prompt and those pixels
    inputs = reference_prompt(chat_text(host, f"Look at\n{IMAGE_TOKEN}\nand\n{IMAGE_TOKEN}"), [square, wide])
    assert tuple(inputs["input_ids"][0].tolist()) == sent[0]
    expected = reference_generate(checkpoint, inputs, NEW_TOKENS)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    got = [bytes(item.bytes or []) for item in logprobs.content]
    assert got[: len(expected)] == [host.tokenizer.decode([t]).encode() for t in expected][: len(got)]
    # streamed: the same answer; counted: the same prompt
    with client.messages.stream(model=MODEL, max_tokens=NEW_TOKENS, messages=[{"role": "user", "content": blocks}],  # type: ignore[list-item,misc]
                                extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert submitted.last == sent and text_of(final) == text_of(m) and final.stop_reason == m.stop_reason
    count = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": blocks}])  # type: ignore[list-item,misc]
    assert count.input_tokens == prompt_tokens


def test_an_image_in_a_tool_result_is_a_chat_tool_messages_image(client: anthropic.Anthropic, chat: OpenAI,
                                                                 submitted: Submitted) -> None:
    tall = picture("tall")
    result = {"type": "tool_result", "tool_use_id": CALL["id"], "content": [{"type": "text", "text": "It shows:"},
                                                                             image_block(tall)]}
    conversation = [{"role": "user", "content": "What does the camera see?"},
                    {"role": "assistant", "content": [{"type": "tool_use", **CALL}]},
                    {"role": "user", "content": [result]}]
    m = client.messages.create(model=MODEL, max_tokens=NEW_TOKENS, tools=[CAMERA], messages=conversation,  # type: ignore[arg-type,list-item]
                               extra_body={"temperature": 0})
    sent = submitted.last
    answer = chat.chat.completions.create(model=MODEL, max_tokens=NEW_TOKENS, temperature=0, messages=[  # type: ignore[misc,list-item]
        {"role": "user", "content": "What does the camera see?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL["id"], "type": "function", "function": {"name": "camera", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": CALL["id"], "content": [{"type": "text", "text": "It shows:"},
                                                                  image_part(tall)]}],
        tools=[{"type": "function", "function": {"name": "camera", "description": CAMERA["description"],
                                                 "parameters": CAMERA["input_schema"]}}])
    assert submitted.last == sent and len(sent[1]) == 1
    assert text_of(m) == (answer.choices[0].message.content or "")
    count = client.messages.count_tokens(model=MODEL, tools=[CAMERA], messages=conversation)  # type: ignore[arg-type,list-item]
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(sent[0])
    # with is_error, the error's text comes first, then the image
    failed = {**result, "is_error": True}
    client.messages.create(model=MODEL, max_tokens=1, tools=[CAMERA],  # type: ignore[arg-type]
                           messages=[*conversation[:2], {"role": "user", "content": [failed]}])  # type: ignore[list-item]
    assert len(submitted.last[1]) == 1 and submitted.last[0] != sent[0]


def test_a_url_source_is_read_when_the_server_allows_it(client: anthropic.Anthropic, submitted: Submitted,
                                                        pictures_url: str) -> None:
    question = {"type": "text", "text": "What is this?"}
    client.messages.create(model=MODEL, max_tokens=1, messages=[  # type: ignore[list-item]
        {"role": "user", "content": [question, image_block(picture("wide"))]}])
    inline = submitted.last
    client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [  # type: ignore[list-item]
        question, {"type": "image", "source": {"type": "url", "url": f"{pictures_url}/wide.png"}}]}])
    assert submitted.last == inline


def _png(name: str = "wide") -> str:
    return base64.b64encode(png_bytes(picture(name))).decode()


BAD = [
    ({"type": "base64", "media_type": "image/png", "data": "AAAA"}, "messages[0].content[1].image.source.base64.data",
     "not a JPEG, PNG, GIF or WebP"),
    ({"type": "base64", "media_type": "image/jpeg", "data": _png()},
     "messages[0].content[1].image.source.base64.media_type", "sent as image/jpeg, but its data is image/png"),
    ({"type": "base64", "media_type": "image/bmp", "data": _png()},
     "messages[0].content[1].image.source.base64.media_type", "image/webp"),
    ({"type": "base64", "media_type": "image/png", "data": _png()[:200]}, "messages[0].content[1]", "truncated"),
    ({"type": "base64", "media_type": "image/png", "data": _png() + "@@@"}, "messages[0].content[1]", "malformed"),
    ({"type": "url", "url": "file:///etc/passwd"}, "messages[0].content[1].image.source.url.url", "http(s)"),
    ({"type": "file", "file_id": "file_1"}, "messages[0].content[1].image.source", "Files API"),
]


@pytest.mark.parametrize(("source", "param", "says"), BAD)
def test_bad_images_are_bad_requests_naming_the_block(client: anthropic.Anthropic, source: dict[str, Any], param: str,
                                                      says: str) -> None:
    content = [{"type": "text", "text": "x"}, {"type": "image", "source": source}]
    for call in (lambda: client.messages.create(model=MODEL, max_tokens=1, messages=[  # type: ignore[list-item]
                     {"role": "user", "content": content}]),
                 lambda: client.messages.count_tokens(model=MODEL, messages=[  # type: ignore[list-item]
                     {"role": "user", "content": content}])):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call()
        error = caught.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(f"{param}:"), error
        assert says in error["message"], error


def test_an_image_in_a_tool_result_or_an_assistant_turn_is_named_too(client: anthropic.Anthropic) -> None:
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png()[:200]}}
    conversation = [{"role": "user", "content": "What does the camera see?"},
                    {"role": "assistant", "content": [{"type": "tool_use", **CALL}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": CALL["id"],
                                                  "content": [{"type": "text", "text": "It shows:"}, bad]}]}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=1, tools=[CAMERA], messages=conversation)  # type: ignore[arg-type,list-item]
    assert caught.value.body["error"]["message"].startswith("messages[2].content[0].content[1]: "), caught.value.body  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=1, messages=[  # type: ignore[list-item]
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": [image_block(picture("wide"))]},
            {"role": "user", "content": "And?"}])
    message = caught.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith("messages[1].content: block 0 has type 'image', which assistant messages cannot have")


def test_a_server_that_downloads_nothing_refuses_url_sources_naming_the_block() -> None:
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = MessagesRequest.model_validate({"max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, image_block(picture("wide")), url]}]})
    check_images(body, None, allow_urls=True)  # a server that reads images and downloads them takes both
    with pytest.raises(AnthropicError) as caught:
        check_images(body, None, allow_urls=False)
    assert caught.value.param == "messages[0].content[2]" and "--allow-image-urls" in caught.value.message
    with pytest.raises(AnthropicError) as caught:
        check_images(body, "--vision off", allow_urls=True)
    assert caught.value.param == "messages[0].content[1]" and caught.value.message.endswith("--vision off")
