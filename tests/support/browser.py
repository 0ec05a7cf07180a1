"""Debian's chromium driven by Playwright, for the tests that need a real browser (no browser download: the system
package is pointed at; a missing browser fails those tests, it does not skip them).

`browser` (one per module) and `page` (a fresh context per test) are the chat-page tests' fixtures by assignment
(`browser, page = support_browser.browser, support_browser.page`: pytest finds a fixture by its name in the module).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WAIT_MS = 120_000  # a page's default wait: generous, as the deadlines of tests/support/wait.py


@contextmanager
def launched_chromium() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), ("the browser tests need Debian's chromium: bash scripts/setup-test-machine.sh installs it "
                                   "(the README's test command runs it first)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launched_chromium() as launched:
        yield launched


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1100, "height": 700})
    opened = context.new_page()
    opened.set_default_timeout(WAIT_MS)
    try:
        yield opened
    finally:
        context.close()
