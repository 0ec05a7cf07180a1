"""Issue 15 part 3: the rough edges a new user hit following the README. Each test is one of them.

- the README's `openai` SDK example runs as written against whatever is served (here the demo artifacts);
- `--help` reads as user help: no internal note, every flag explained, no default printed twice;
- a bad `--port` and a port already in use fail at once (one line, exit 2), before anything loads;
- `demo --graph null` serves the demo's tokenizer with the null graph;
- `check --graph jit` on the demo's export points at `--graph hf`, not at fetching the 26B into the demo's cache.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.__main__ import build_parser, main
from tests.support.api_fixtures import ROOT, free_port, live_server, settings
from tests.support.models import cache_root, demo_dir
from tests.support.wait import wait_serving

README = ROOT / "README.md"


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# ------------------------------------------------------------------ the README's SDK example


def readme_sdk_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    # the streaming quick-start example (the "Thinking, tools and JSON" section has examples of its own)
    (example,) = [b for b in blocks if "from openai import OpenAI" in b and "stream=True" in b]
    return "\n".join(line[3:] if line.startswith("   ") else line for line in example.splitlines())  # list indent


def test_the_readme_sdk_example_runs_against_whatever_is_served() -> None:
    code = readme_sdk_example()
    assert "http://127.0.0.1:8080/v1" in code
    # served under a name the example does not know: it must ask the server (the 26B's name used to be hard-coded)
    with live_server(settings(served_model_name="some-other-model")) as live:
        done = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8080", live.url)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) > 10, done.stdout  # the null graph's (sampled) answer, streamed and printed


# ------------------------------------------------------------------ --help


def subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_help_is_for_users_every_flag_explained_each_default_once() -> None:
    top = run("--help").stdout
    assert "only reader of the environment" not in top and "`python -m server {" not in top
    assert "python -m server demo" in top
    for name, parser in subparsers().items():
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"{name} {action.option_strings}: no help text"
            assert action.help.count("(default:") <= 1, f"{name} {action.option_strings}: {action.help}"
        text = run(name, "--help").stdout
        assert "(default: None)" not in text and not re.search(r"\(default: [^)]*\)\s*\(default:", text), text


# ------------------------------------------------------------------ the port, before anything loads


@pytest.mark.parametrize("args, env", [(["--port", "70000"], {}), ([], {"PORT": "70000"}), (["--port", "-1"], {})])
def test_a_port_out_of_range_is_one_line_and_exit_2(args: list[str], env: dict[str, str]) -> None:
    done = run("serve", "--artifacts", "/nonexistent", *args, env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "1..65535" in done.stderr, done.stderr


@pytest.fixture
def occupied_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def test_a_port_in_use_fails_before_anything_loads(occupied_port: int, tmp_path: Path) -> None:
    # /nonexistent: had the server loaded first, it would fail on the artifacts (exit 1) instead
    done = run("serve", "--artifacts", "/nonexistent", "--port", str(occupied_port))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: cannot listen on 127.0.0.1:{occupied_port}: Address already in use"
    # the demo: nothing exported into (or even created in) its cache before the bind fails
    cache = tmp_path / "cache"
    done = run("demo", "--port", str(occupied_port), "--cache-dir", str(cache))
    assert done.returncode == 2 and "Address already in use" in done.stderr and not cache.exists(), done.stderr


# ------------------------------------------------------------------ demo --graph


def test_demo_graph_defaults_to_hf_and_offers_null() -> None:
    assert build_parser().parse_args(["demo"]).demo_graph == "hf"
    assert build_parser().parse_args(["demo"]).demo_model is None  # then DEMO_MODEL, then the default chat model
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--graph", "jit"])


def test_demo_graph_null_serves_the_demo_tokenizer_on_the_null_graph() -> None:
    demo_dir()  # exported once (the shared test cache), so the demo starts in seconds
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "demo", "--model", "gemma-3-270m", "--graph", "null",
                             "--port", str(port), "--cache-dir", str(cache_root())],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # once bound, connections wait in the backlog until the app serves: a long request timeout
        wait_serving(proc, f"{url}/health", 120, request_timeout=60)
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "gemma-3-270m"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " a a a"  # the null graph's favourite
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "(null graph)" in output, output


# ------------------------------------------------------------------ check on the demo's directory


def test_check_jit_on_the_demo_export_points_at_hf_not_at_fetching_into_it(capsys: pytest.CaptureFixture[str]) -> None:
    root = demo_dir()
    assert main(["check", "--artifacts", str(root), "--graph", "jit"]) == 1
    message = capsys.readouterr().err
    assert "--graph hf" in message and "--dest NEW_DIR" in message and f"--dest {root}" not in message, message
    assert main(["check", "--artifacts", str(root), "--graph", "hf"]) == 0
