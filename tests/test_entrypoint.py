"""entrypoint.sh: its decisions with a stub interpreter (fast), then for real on CPU.

- The stub (`PYTHON=stub`) records every `python -m server ...` call and answers with chosen exit codes, so the
  check -> fetch -> exec serve logic, the defaults of the four variables and the memory warning are proven
  in milliseconds, without a model.
- The real runs start the actual server through the script: the exported Gemma-3 270M demo with GRAPH=hf
  (health, a chat completion, SIGTERM -> exit 0), and an empty ARTIFACTS_DIR filled from a local Hub stand-in
  serving that demo's files, then served with GRAPH=null.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.model.artifacts import validate
from tests.support.hub_standin import HubStandIn, make_tiny_repo
from tests.support.wait import wait_serving

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "entrypoint.sh"
DEFAULT_REPO = "xbill9/gemma-4-26B-A4B-it-inferentia2-xlarge"
SWAP_COMMANDS = ("sudo fallocate -l 40G /swapfile", "sudo chmod 600 /swapfile", "sudo mkswap /swapfile",
                 "sudo swapon /swapfile")
HAVE_API = (ROOT / "server" / "app" / "serve.py").is_file()
needs_api = pytest.mark.skipif(not HAVE_API, reason="server/app/serve.py (the HTTP layer) has not landed yet")

STUB = """#!/usr/bin/env bash
# A stand-in interpreter: records `-m server CMD ARGS...` and answers with the exit code the test chose.
printf '%q ' "$@" >> "$STUB_LOG"; echo >> "$STUB_LOG"  # shell-quoted: spaces survive
if [[ -n "${STUB_REAL:-}" && "$3" != serve ]]; then exec "$STUB_REAL" "$@"; fi  # real check and fetch
case "$3" in
    check) echo "cfg/config.json: missing (stub reason)" >&2; exit "${STUB_CHECK_RC:-0}" ;;
    fetch) echo "stub fetch" >&2; exit "${STUB_FETCH_RC:-0}" ;;
    serve) echo "stub serve" >&2; exit 0 ;;
esac
exit 99
"""


def _base_env(**extra: str) -> dict[str, str]:
    # The entrypoint's interface variables start unset, so the defaults are what is tested.
    drop = ("ARTIFACTS_DIR", "GRAPH", "HOST", "PORT", "HF_REPO", "HF_REVISION", "HF_TOKEN", "MIN_MEMORY_GB", "PYTHON")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("HF_")}
    env.update(extra)
    return env


@pytest.fixture
def stub(tmp_path: Path) -> tuple[Path, Path]:
    path = tmp_path / "python-stub"
    path.write_text(STUB)
    path.chmod(0o755)
    return path, tmp_path / "calls.log"


def _run_stub(stub: tuple[Path, Path], *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run the entrypoint with the stub; return its result and the calls, each re-joined by shlex."""
    path, log = stub
    result = subprocess.run(["bash", str(SCRIPT), *args], env=_base_env(PYTHON=str(path), STUB_LOG=str(log), **env),
                            capture_output=True, text=True, timeout=30)
    calls = [shlex.join(shlex.split(line)) for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def test_complete_directory_goes_straight_to_serve_with_the_defaults(stub: tuple[Path, Path]) -> None:
    result, calls = _run_stub(stub, MIN_MEMORY_GB="0")
    assert result.returncode == 0, result.stderr
    assert calls == [
        "-m server check --artifacts /data --graph auto",
        "-m server serve --artifacts /data --graph auto --host 0.0.0.0 --port 8080",
    ]


def test_variables_and_arguments_reach_serve(stub: tuple[Path, Path], tmp_path: Path) -> None:
    result, calls = _run_stub(stub, "--max-queue", "4", "--served-model-name", "a b", ARTIFACTS_DIR=str(tmp_path),
                              GRAPH="null", HOST="127.0.0.1", PORT="9999")
    assert result.returncode == 0, result.stderr
    assert calls[-1] == shlex.join(["-m", "server", "serve", "--artifacts", str(tmp_path), "--graph", "null", "--host",
                                    "127.0.0.1", "--port", "9999", "--max-queue", "4", "--served-model-name", "a b"])


def test_incomplete_directory_is_fetched_from_the_default_repo_then_served(stub: tuple[Path, Path]) -> None:
    result, calls = _run_stub(stub, STUB_CHECK_RC="1", MIN_MEMORY_GB="0")
    assert result.returncode == 0, result.stderr
    assert calls == [
        "-m server check --artifacts /data --graph auto",
        f"-m server fetch --repo {DEFAULT_REPO} --revision main --dest /data --graph auto",
        "-m server serve --artifacts /data --graph auto --host 0.0.0.0 --port 8080",
    ]
    assert "cfg/config.json: missing (stub reason)" in result.stderr, "the user must see why a fetch starts"


def test_repo_and_revision_come_from_the_environment(stub: tuple[Path, Path]) -> None:
    _, calls = _run_stub(stub, STUB_CHECK_RC="1", HF_REPO="me/mine", HF_REVISION="v2", GRAPH="null")
    assert calls[1] == "-m server fetch --repo me/mine --revision v2 --dest /data --graph null"


def test_a_failed_fetch_stops_with_its_exit_code_and_never_serves(stub: tuple[Path, Path]) -> None:
    result, calls = _run_stub(stub, STUB_CHECK_RC="1", STUB_FETCH_RC="3", MIN_MEMORY_GB="0")
    assert result.returncode == 3
    assert not any(" serve " in c for c in calls)
    assert "fetch failed (exit 3)" in result.stderr


def test_low_memory_warning_prints_the_swapfile_commands(stub: tuple[Path, Path]) -> None:
    result, calls = _run_stub(stub, GRAPH="jit", MIN_MEMORY_GB="100000")
    assert result.returncode == 0, "only a warning"
    assert "WARNING: RAM + swap is" in result.stderr and "~100000 GiB" in result.stderr
    for command in SWAP_COMMANDS:
        assert command in result.stderr
    assert calls[-1].startswith("-m server serve ")


@pytest.mark.parametrize("env", [{"GRAPH": "hf"}, {"GRAPH": "null"}, {"GRAPH": "jit", "MIN_MEMORY_GB": "0"}])
def test_no_memory_warning_without_a_compiled_graph_or_when_silenced(stub: tuple[Path, Path],
                                                                      env: dict[str, str]) -> None:
    result, _ = _run_stub(stub, **{"MIN_MEMORY_GB": "100000", **env})
    assert result.returncode == 0
    assert "swapfile" not in result.stderr


def test_no_swap_asked_for_a_graph_with_separate_weights(stub: tuple[Path, Path], tmp_path: Path) -> None:
    (tmp_path / "graph.json").write_text(json.dumps({"contract": "gemma4-optb/v2", "weights": "separate",
                                                     "weight_files": ["weights/tp0_sharded_checkpoint.safetensors"]}))
    result, calls = _run_stub(stub, GRAPH="jit", MIN_MEMORY_GB="100000", ARTIFACTS_DIR=str(tmp_path))
    assert result.returncode == 0 and calls[-1].startswith("-m server serve ")
    assert "swapfile" not in result.stderr
    # The same directory with its weights inside the graph still gets the warning.
    (tmp_path / "graph.json").write_text(json.dumps({"contract": "gemma4-optb/v2", "weights": "inside"}))
    result, _ = _run_stub(stub, GRAPH="jit", MIN_MEMORY_GB="100000", ARTIFACTS_DIR=str(tmp_path))
    assert "sudo swapon /swapfile" in result.stderr


def test_real_check_and_fetch_fill_an_empty_volume(stub: tuple[Path, Path], tmp_path: Path) -> None:
    """The real `check` and `fetch` (a stand-in Hub, a small repo), only `serve` stubbed: no HTTP layer needed."""
    data = tmp_path / "data"
    data.mkdir()  # as Docker creates the volume
    with HubStandIn("acme/tiny", make_tiny_repo(tmp_path / "repo")) as hub:
        result, calls = _run_stub(stub, STUB_REAL=sys.executable, ARTIFACTS_DIR=str(data), MIN_MEMORY_GB="0",
                                  HF_REPO="acme/tiny", HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"),
                                  HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert [c.split()[2] for c in calls] == ["check", "fetch", "serve"]
    assert f"{data}/embed_tokens.pt: missing" in result.stderr
    assert "complete for --graph auto" in result.stderr
    validate(data, "auto")
    assert not (data / "hf").exists()

    # The second start finds the volume complete: no fetch, no network.
    (tmp_path / "calls.log").unlink()
    result, calls = _run_stub(stub, STUB_REAL=sys.executable, ARTIFACTS_DIR=str(data), MIN_MEMORY_GB="0",
                              HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert [c.split()[2] for c in calls] == ["check", "serve"]


# --- the real thing ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """entrypoint.sh running the real server; stdout+stderr go to a file so a failure can show them."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = int(env["PORT"])
        self.log = log
        self._handle = log.open("w")
        self.proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=self._handle, stderr=subprocess.STDOUT,
                                     cwd=ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> None:
        wait_serving(self.proc, f"{self.url}/health", timeout, log=self.log)

    def terminate(self, timeout: float = 15) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._handle.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.close()


def _server_env(artifacts: Path, graph: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    return _base_env(PYTHON=sys.executable, ARTIFACTS_DIR=str(artifacts), GRAPH=graph, HOST="127.0.0.1",
                     PORT=str(_free_port()), PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf-home"),
                     HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", SHUTDOWN_GRACE="5", **extra)


@needs_api
@pytest.mark.slow
def test_serves_the_demo_answers_a_chat_and_exits_cleanly_on_sigterm(tmp_path: Path, servers: list[Server]) -> None:
    from tests.support.models import demo_dir

    server = Server(_server_env(demo_dir(), "hf", tmp_path), tmp_path / "server.log")
    servers.append(server)
    server.wait_healthy(timeout=180)
    # exec: the process we started is now the server itself, so a SIGTERM to it reaches uvicorn, not bash
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:4] == [b"-m", b"server", b"serve"], cmdline
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    model = models["data"][0]["id"]
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"].strip(), body
    assert body["usage"]["completion_tokens"] >= 1

    started = time.monotonic()
    code = server.terminate(timeout=15)
    assert code == 0, server.output()[-4000:]
    assert time.monotonic() - started < 15


@needs_api
@pytest.mark.slow
def test_empty_volume_is_fetched_from_the_hub_then_served(tmp_path: Path, servers: list[Server]) -> None:
    """The first start of a container: an empty /data, the Hub (here a local stand-in serving the demo's
    files: cfg/, the 641 MB embedding, graph.json, and an hf/ checkpoint that must stay behind), GRAPH=null."""
    from tests.support.models import demo_dir

    data = tmp_path / "data"
    data.mkdir()
    with HubStandIn("acme/demo-artifacts", demo_dir()) as hub:
        server = Server(_server_env(data, "null", tmp_path, HF_ENDPOINT=hub.url, HF_REPO="acme/demo-artifacts"),
                        tmp_path / "server.log")
        servers.append(server)
        server.wait_healthy(timeout=180)
    output = server.output()
    assert "is not complete for --graph null" in output and "embed_tokens.pt: missing" in output
    assert "fetching acme/demo-artifacts (revision main)" in output
    assert (data / "embed_tokens.pt").stat().st_size == (demo_dir() / "embed_tokens.pt").stat().st_size
    assert not (data / "hf").exists()
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": json.loads(httpx.get(f"{server.url}/v1/models", timeout=10).text)["data"][0]["id"],
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert server.terminate(timeout=15) == 0, server.output()[-4000:]


def test_stub_sees_exactly_what_a_shell_would_quote(stub: tuple[Path, Path], tmp_path: Path) -> None:
    """Paths with spaces survive the script's quoting (ARTIFACTS_DIR is user input)."""
    spaced = tmp_path / "my data"
    result, calls = _run_stub(stub, ARTIFACTS_DIR=str(spaced), MIN_MEMORY_GB="0")
    assert result.returncode == 0
    assert calls == [
        shlex.join(["-m", "server", "check", "--artifacts", str(spaced), "--graph", "auto"]),
        shlex.join(["-m", "server", "serve", "--artifacts", str(spaced), "--graph", "auto", "--host", "0.0.0.0",
                    "--port", "8080"]),
    ]
