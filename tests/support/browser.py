"""Debian's chromium driven by Playwright, for the tests that need a real browser (no browser download: the system
package is pointed at; a missing browser fails those tests, it does not skip them)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Browser, sync_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@contextmanager
def launched_chromium() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "the browser tests need Debian's chromium: apt-get install -y chromium"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
