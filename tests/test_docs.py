"""The README is a front door to docs/: every relative link in them reaches a file, and every #anchor a heading there
(GitHub's slugs), so moving a section cannot leave a link pointing nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)  # no headings in code
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_slug_follows_github() -> None:
    assert slug("Host overhead (`python -m server bench`)") == "host-overhead-python--m-server-bench"
    assert slug("inf2.xlarge quick start") == "inf2xlarge-quick-start"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.is_file(), f"{page.name}: {target}"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: {target} (headings: {sorted(anchors(dest))})"


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name  # every reference page is linked from the front door
