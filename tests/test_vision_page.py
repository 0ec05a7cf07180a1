"""The chat page takes an image (file picker or paste) on a server that reads them, shows it in the conversation and
sends it as an image_url part: the answer equals the API's to the same request."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page

from server.app.runtime import Host, build_engine, load_host
from tests.support import browser as support_browser
from tests.support.api_fixtures import LiveServer, live_server
from tests.support.vision import png_bytes, random_image, tiny_vision_checkpoint
from tests.test_vision import MODEL, exported, vision_settings


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return exported(tiny_vision_checkpoint(), tmp_path_factory.mktemp("page") / "artifacts")


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[LiveServer]:
    config = vision_settings()
    with live_server(config, build_engine(host, config), host) as live:
        yield live


browser, page = support_browser.browser, support_browser.page  # shared fixtures (pytest finds them by name)


def test_the_page_attaches_an_image_shows_it_and_sends_it(server: LiveServer, page: Page, tmp_path: Path) -> None:
    assert httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["images"] is True
    image = png_bytes(random_image(64, 64, seed=1))
    path = tmp_path / "square.png"
    path.write_bytes(image)
    page.goto(f"{server.url}/")
    page.wait_for_selector("#attach", state="visible")  # the model card said images
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "6")
    page.set_input_files("#image-file", str(path))
    page.wait_for_selector("#attached img")
    page.fill("#prompt", "What is this?")
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").last
    answer.locator(".stats").wait_for()
    assert page.locator(".msg.user img").count() == 1 and page.locator("#attached img").count() == 0
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    expected = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                  {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 6, "temperature": 0}).json()
    assert answer.locator(".content").text_content() == expected["choices"][0]["message"]["content"]


def test_a_server_without_images_offers_no_image_button(host: Host, page: Page) -> None:
    text_only = load_host(host.artifacts.root, "hf", MODEL)  # no image settings: images off
    config = vision_settings(vision="off")
    with live_server(config, build_engine(text_only, config), text_only) as live:
        assert httpx.get(f"{live.url}/v1/models", timeout=10).json()["data"][0]["images"] is False
        page.goto(f"{live.url}/")
        page.wait_for_selector(f"#model:has-text('{MODEL}')")
        assert page.locator("#attach").is_hidden()
        content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
        answer = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        assert answer.status_code == 400 and "text-only model" in answer.json()["error"]["message"]
