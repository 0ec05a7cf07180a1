"""The real agent CLIs, unmodified, against the server (issue 33): Claude Code, Codex and OpenCode from npm.

The server is the in-process live server (tests/support/api_fixtures.py) on the hand-weighted tiny Gemma-4
(tests/support/agent_model.py) exported with a 40,960-token context, `--graph hf`: in-process so that the test sees
every prompt the engine ran (the tool result is in the prompt after the tool ran) and the server's own counters; the
HTTP side is the real app under uvicorn on 127.0.0.1, as `serve` runs it. Every CLI runs as a subprocess with a
scratch HOME and project, telemetry and update checks off (tests/support/agent_cli.py), and must exit 0 with the
model's text; every request it made must have been answered 2xx with no in-band stream error (the server's
`gemma4_http_requests_total` by status and `gemma4_errors_total`). A CLI that is not installed fails the test with
the command that installs it.

Measured and printed (`-s`): each CLI's prompt tokens on its first request, the prefix tokens the server reused on
its second invocation in the same project, and each test's wall time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app.runtime import build_engine, load_host
from server.config import Settings
from tests.support import agent_cli
from tests.support.agent_model import NOTES_FILE, PLAIN_TEXT, READ_TRIGGER, SHELL_TRIGGER, TOOL_TEXT, agent_artifacts
from tests.support.api_fixtures import LiveServer
from tests.support.gemma4_app import Prompts
from tests.support.models import cache_root

MODEL = "gemma4-agent"
# Claude Code asks for its own default model (claude-opus-5-5 today) and Codex for what its config names: the glob
# aliases let any of those names reach the one model.
SERVED = f"{MODEL},claude-*,gpt-*"
API_KEY = "sk-agents-test"
NOTES = "the owl and the octopus were here"  # the file the tool calls read: in the next prompt once the tool ran


@pytest.fixture(scope="module")
def artifacts() -> Path:
    return agent_artifacts(cache_root() / "agent-model")


@pytest.fixture(scope="module")
def server(artifacts: Path) -> Iterator[LiveServer]:
    host = load_host(artifacts, "hf", SERVED)
    config = Settings(artifacts=artifacts, graph="hf", host="127.0.0.1", port=0, served_model_name=SERVED,
                      api_key=API_KEY, lazy_grammar=True)
    engine = build_engine(host, config)
    live = LiveServer(config, engine, host)
    live.prompts = Prompts(engine)  # type: ignore[attr-defined]
    live.log = _Lines()  # type: ignore[attr-defined]  # the server's per-request lines (prompt, reused, ttft, total)
    api_log = logging.getLogger("server.api")
    api_log.addHandler(live.log)  # type: ignore[attr-defined]
    level = api_log.level
    api_log.setLevel(logging.INFO)  # its request lines are INFO; the test session's default would drop them
    live.start()
    try:
        yield live
    finally:
        live.stop()
        api_log.removeHandler(live.log)  # type: ignore[attr-defined]
        api_log.setLevel(level)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    (root / NOTES_FILE).write_text(NOTES + "\n", encoding="utf-8")
    return root


def _counters(url: str) -> dict[str, float]:
    """The server's request counts by status, and its error count (HTTP and in-band stream errors)."""
    counts: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gemma4_http_requests_total" and sample.labels.get("route") != "/metrics":
                key = f"{sample.labels['route']} {sample.labels['status']}"
                counts[key] = counts.get(key, 0.0) + sample.value
            elif sample.name in ("gemma4_errors_total", "gemma4_prefix_cache_hit_tokens_total"):
                key = sample.name if sample.name != "gemma4_errors_total" else f"errors {sample.labels['status']}"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


class Invocation:
    """One CLI run against the server: what it sent (the prompts the engine ran, the requests by status)."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.prompts: Prompts = server.prompts  # type: ignore[attr-defined]
        self.first_prompt = len(self.prompts.ids)
        self.first_line = len(server.log.lines)  # type: ignore[attr-defined]
        self.before = _counters(server.url)

    def finish(self, result: agent_cli.Run) -> list[tuple[int, ...]]:
        after = _counters(self.server.url)
        delta = {key: value - self.before.get(key, 0.0) for key, value in after.items()
                 if value != self.before.get(key, 0.0)}
        self.delta = delta
        self.lines = [line for line in self.server.log.lines[self.first_line:]  # type: ignore[attr-defined]
                      if "prompt=" in line]
        bad = {key: value for key, value in delta.items()
               if key.startswith("errors") or (" " in key and not key.split(" ")[-1].startswith("2"))}
        assert result.returncode == 0, result.why() + f"\nrequests: {delta}"
        assert not bad, f"requests not answered 2xx: {bad}; all: {delta}\n{result.why()}"
        assert any(key.split(" ")[-1].startswith("2") for key in delta if " " in key), f"no request reached: {delta}"
        return self.prompts.ids[self.first_prompt:]

    @property
    def reused(self) -> float:
        return self.delta.get("gemma4_prefix_cache_hit_tokens_total", 0.0)


def _text(server: LiveServer, ids: tuple[int, ...]) -> str:
    return str(server.host.tokenizer.decode(list(ids)))


def _report(name: str, result: agent_cli.Run, call: Invocation, prompts: list[tuple[int, ...]],
            reused: float | None = None) -> None:
    """For the issue's note (run with -s): the wall time, each prompt's size, what the second invocation reused, and
    the server's own line per request (prompt / reused / ttft: the prefill time)."""
    sizes = [len(p) for p in prompts]
    extra = "" if reused is None else f", prefix tokens reused on the second invocation {reused:.0f}"
    print(f"\nagents-cli {name}: {result.seconds:.1f} s, {len(prompts)} prompts, tokens per prompt {sizes}{extra}")
    for line in call.lines:
        print(f"agents-cli   {line}")


def _tool_round_trip(server: LiveServer, prompts: list[tuple[int, ...]]) -> None:
    """The tool ran and its result (the file's text) came back in a later prompt, after which the model answered."""
    texts = [_text(server, p) for p in prompts]
    assert any(NOTES in text for text in texts), "the tool's result (the file's text) reached no prompt"


def _claude(server: LiveServer, home: Path, project: Path, *args: str) -> agent_cli.Run:
    argv = [str(agent_cli.cli("claude")), "-p", *args]
    return agent_cli.run(argv, project, agent_cli.claude_env(home, server.url, API_KEY))


def test_claude_code_plain(server: LiveServer, project: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    call = Invocation(server)
    result = _claude(server, home, project, "Say hello.")
    prompts = call.finish(result)
    assert PLAIN_TEXT in result.stdout, result.why()
    again = Invocation(server)  # the second invocation in the same project: its system prompt and tools are cached
    second = _claude(server, home, project, "Say hello again.")
    again.finish(second)
    assert PLAIN_TEXT in second.stdout, second.why()
    _report("claude -p", result, call, prompts, again.reused)


def test_claude_code_stream_json(server: LiveServer, project: Path, tmp_path: Path) -> None:
    import json

    call = Invocation(server)
    result = _claude(server, tmp_path / "home", project, "--output-format", "stream-json", "--verbose", "Say hello.")
    prompts = call.finish(result)
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    final = [event for event in events if event.get("type") == "result"]
    assert final and final[-1].get("subtype") == "success" and not final[-1].get("is_error"), result.why()
    assert PLAIN_TEXT in final[-1]["result"], final[-1]
    _report("claude -p --output-format stream-json", result, call, prompts)


def test_claude_code_read_tool(server: LiveServer, project: Path, tmp_path: Path) -> None:
    call = Invocation(server)
    result = _claude(server, tmp_path / "home", project, "--allowedTools", "Read", "--",
                     f"Read {NOTES_FILE} for me {READ_TRIGGER}")
    prompts = call.finish(result)
    _tool_round_trip(server, prompts)
    assert TOOL_TEXT in result.stdout, result.why()
    _report("claude -p with a Read", result, call, prompts)


def _codex(server: LiveServer, home: Path, project: Path, prompt: str) -> agent_cli.Run:
    argv = [str(agent_cli.cli("codex")), "exec", "--skip-git-repo-check", "--sandbox", "read-only", prompt]
    return agent_cli.run(argv, project, agent_cli.codex_env(home, server.url, API_KEY, MODEL))


def test_codex_exec_plain(server: LiveServer, project: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    call = Invocation(server)
    result = _codex(server, home, project, "Say hello.")
    prompts = call.finish(result)
    assert PLAIN_TEXT in result.stdout, result.why()
    again = Invocation(server)
    second = _codex(server, home, project, "Say hello again.")
    again.finish(second)
    _report("codex exec", result, call, prompts, again.reused)


def test_codex_exec_shell_tool(server: LiveServer, project: Path, tmp_path: Path) -> None:
    call = Invocation(server)
    result = _codex(server, tmp_path / "home", project, f"Show me {NOTES_FILE} {SHELL_TRIGGER}")
    prompts = call.finish(result)
    _tool_round_trip(server, prompts)
    assert TOOL_TEXT in result.stdout, result.why()
    _report("codex exec with exec_command", result, call, prompts)


def test_opencode_run_plain(server: LiveServer, project: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = agent_cli.opencode_env(home, server.url, API_KEY, MODEL)
    call = Invocation(server)
    result = agent_cli.run([str(agent_cli.cli("opencode")), "run", "Say hello."], project, env)
    prompts = call.finish(result)
    assert PLAIN_TEXT in result.stdout, result.why()
    again = Invocation(server)
    second = agent_cli.run([str(agent_cli.cli("opencode")), "run", "Say hello again."], project, env)
    again.finish(second)
    assert PLAIN_TEXT in second.stdout, second.why()
    _report("opencode run", result, call, prompts, again.reused)


def test_installed_versions_are_the_pinned_ones(tmp_path: Path) -> None:
    """The CLIs under the prefix are the versions scripts/setup-test-machine.sh pins (a stale install would test
    another client than the one the README names)."""
    for name, version in agent_cli.PINNED.items():
        out = agent_cli.run([str(agent_cli.cli(name)), "--version"], tmp_path, agent_cli.base_env(tmp_path))
        assert version in out.stdout, (name, out.stdout, out.stderr)
