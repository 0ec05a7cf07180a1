"""The README's settings table is `serve --help`: the same flags, env vars, defaults and meanings, in the same order."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from server.__main__ import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
HELP = re.compile(r"(?P<meaning>.*) \(default: (?P<default>.*)\) \[env (?P<env>\w+)\]", re.DOTALL)


def readme_rows() -> list[tuple[str, ...]]:
    section = README.read_text(encoding="utf-8").split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    return [tuple(cell.strip().replace("`", "") for cell in line.strip().strip("|").split(" | ")) for line in rows]


def help_rows() -> list[tuple[str, ...]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows = []
    for action in sub.choices["serve"]._actions:
        if action.dest == "help":
            continue
        match = HELP.fullmatch(action.help or "")
        assert match, action.help
        rows.append((action.option_strings[0], match["env"], match["default"], match["meaning"]))
    return rows


def test_the_readme_settings_table_is_serve_help() -> None:
    assert readme_rows() == help_rows()
