"""schemathesis against the running demo (`python -m server demo --graph null`, a real process) and its own
/openapi.json: every route, a bounded number of generated requests per route (valid and invalid bodies, boundary
values, wrong types), and every answer checked: no 5xx, a status the description lists, in a content type it lists,
matching its schema, within `MAX_RESPONSE_S`.

Why a pytest test and not a step of .ci/run: the README's test command runs it, so a developer's run and CI's are the
same; the server's start, readiness and stop are Python (as every other live-server test's), not shell job control.
The command it runs is printed on failure, to reproduce by hand. Derandomized (`--seed`): the same requests every run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.api_fixtures import ROOT, free_port
from tests.support.models import cache_root, demo_dir
from tests.support.wait import answers, wait_serving

MAX_EXAMPLES = 30  # per operation and phase: ~2,000 requests; 60 made it one of the longest tests in CI (minutes)
MAX_RESPONSE_S = 30  # a request for 8 choices of a whole 1024-token context took ~7 s on the null graph, unloaded,
# and past 30 s on a loaded 2-core host; with CONTEXT it is a quarter of that
CONTEXT = 256  # --max-model-len: the coverage phase's boundary values ask for whole contexts, thousands of times
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
SEED = 23


def schemathesis_command(url: str) -> list[str]:
    return [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", CHECKS,
            "--max-response-time", str(MAX_RESPONSE_S), "--max-examples", str(MAX_EXAMPLES),
            "--phases", "examples,coverage,fuzzing,stateful", "--seed", str(SEED), "--workers", "1", "--no-color",
            "--request-timeout", str(2 * MAX_RESPONSE_S)]


def test_schemathesis_finds_nothing_on_the_running_demo(tmp_path: Path) -> None:
    demo_dir()  # the demo's export, built once (and shared with the other tests) before the server needs it
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"  # a file, not a pipe nobody reads while the fuzzer runs (a full pipe would block it)
    with log.open("w") as out:
        # The Gemma demo: its export is the one demo_dir() made, and its 262k tokenizer is the larger surface.
        server = subprocess.Popen([sys.executable, "-m", "server", "demo", "--model", "gemma-3-270m", "--graph", "null",
                                   "--port", str(port), "--cache-dir", str(cache_root()), "--log-level", "warning",
                                   "--max-model-len", str(CONTEXT)],
                                  cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        wait_serving(server, f"{url}/health", 300, log=log)
        # A constrained request waits for the grammar vocabulary (built once after start-up); ask for one first, so
        # the fuzzer's own constrained requests meet a built vocabulary and the time bound measures the server.
        warm = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}})
        assert warm.status_code == 200, warm.text
        operations = sum(len(methods) for methods in httpx.get(f"{url}/openapi.json").json()["paths"].values())
        command = schemathesis_command(url)
        began = time.monotonic()
        # In tmp_path: schemathesis keeps a cache directory (.schemathesis/) in its working directory.
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        took = time.monotonic() - began
        report = run.stdout[-6000:] + run.stderr[-2000:] + "\nserver log:\n" + log.read_text()[-3000:]
        assert run.returncode == 0, f"{' '.join(command)}\n(exit {run.returncode} after {took:.0f} s)\n{report}"
        cases = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert cases is not None and cases.group(1) == cases.group(2) and int(cases.group(1)) > 1000, report
        # Every route ran, but GET /openapi.json itself: schemathesis leaves out the operation it loaded the schema from.
        assert f"Tested: {operations - 1}" in run.stdout, report
        print(f"schemathesis: {cases.group(1)} requests, all passed, in {took:.0f} s")
        assert answers(f"{url}/health"), "the server stopped serving"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
