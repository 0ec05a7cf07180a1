"""docs/settings.md is `--help`: serve's table holds the same flags, env vars, defaults and meanings in the same order,
and every flag of every command (bench's parts too) is in that command's table. `--help` names values as the table
does: a setting by its environment variable, a closed set by its choices."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from server.__main__ import build_parser
from server.config import OPTIONS

SETTINGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
HELP = re.compile(r"(?P<meaning>.*) \(default: (?P<default>.*)\) \[env (?P<env>\w+)\]", re.DOTALL)


def sections() -> dict[str, str]:
    """`## \\`python -m server CMD\\`...` heading -> its text, keyed by CMD."""
    found = {}
    for part in SETTINGS_DOC.read_text(encoding="utf-8").split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        match = re.match(r"`python -m server (\w+)`", heading)
        assert match, heading
        found[match[1]] = body
    return found


def table_rows(text: str, *, nested: bool = False) -> list[tuple[str, ...]]:
    """The rows of the command's own table, or (`nested`) of a part's table, indented under its list item."""
    rows = [line.strip() for line in text.splitlines() if re.match(r"\s+\| `" if nested else r"\| `", line)]
    return [tuple(cell.strip().replace("`", "") for cell in line.strip("|").split(" | ")) for line in rows]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subs[0].choices) if subs else {}


def help_rows() -> list[tuple[str, ...]]:
    rows = []
    for action in subcommands(build_parser())["serve"]._actions:
        if action.dest == "help":
            continue
        match = HELP.fullmatch(action.help or "")
        assert match, action.help
        rows.append((action.option_strings[0], match["env"], match["default"], match["meaning"]))
    return rows


def test_the_settings_table_is_serve_help() -> None:
    assert table_rows(sections()["serve"]) == help_rows()


def documented_flags(text: str, *, nested: bool = False) -> set[str]:
    return {row[0].split()[0] for row in table_rows(text, nested=nested)}


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
            for action in parser._actions
            if action.dest != "help" and not isinstance(action, argparse._SubParsersAction)}


def test_every_flag_of_every_command_is_documented() -> None:
    docs = sections()
    commands = subcommands(build_parser())
    assert set(docs) == set(commands)
    for name, parser in commands.items():
        documented = documented_flags(docs[name])
        if name == "demo":  # serve's settings but --artifacts and --graph, plus demo's own table
            documented |= documented_flags(docs["serve"]) - {"--artifacts", "--graph"}
        assert flags_of(parser) == documented, name
        for part_name, part in subcommands(parser).items():  # bench load / bench constraints
            assert f"`python -m server {name} {part_name} " in docs[name], part_name
            part_text = docs[name].split(f"`python -m server {name} {part_name} ", 1)[1].split("\n- ", 1)[0]
            assert flags_of(part) == documented_flags(part_text, nested=True), part_name


def test_help_names_a_settings_value_by_its_environment_variable_or_its_choices() -> None:
    serve = subcommands(build_parser())["serve"]
    text = serve.format_usage()
    for option in OPTIONS:
        if option.choices:
            assert f"{option.flag} {{{','.join(option.choices)}}}" in text
        elif option.kind.__name__ != "_switch":
            assert re.search(rf"{option.flag} {option.env}\]", text), option.flag
    # and bench's --cache-dir says what bench keeps there, not the demo's export
    bench = subcommands(build_parser())["bench"]
    (cache,) = [a for a in bench._actions if a.dest == "cache_dir"]
    assert "26B's shapes" in (cache.help or "") and "demo" not in (cache.help or "")
