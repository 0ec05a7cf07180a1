"""The tiny random Gemma-4 served over HTTP, as the API tests use it: its host (the Gemma-4 tokenizer and template),
a live server around a module's own graph, the prompts the engine ran, and a scripted graph's answer set from text.

The fixtures here (`host`, `prompts`, `script`, `client`) are the test modules' by assignment (`host = gemma4_app.host`:
pytest finds a fixture by its name in the module; an import of it would read as unused to ruff). `script` drives the
module's own `graph` fixture, `client` and `prompts` its `server` (a `gemma4_server`): each module keeps its graph and
server.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from server.app.runtime import Host, build_engine, load_host
from server.config import Settings
from server.engine.engine import Engine
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.gemma4_tokenizer import gemma4_cfg_dir
from tests.support.models import tiny_gemma4_checkpoint

MODEL = "gemma4-tiny"
MAX_TOTAL = 512


def gemma4_host(root: Path, max_total: int = MAX_TOTAL) -> Host:
    """The tiny random Gemma-4 exported under `root`, with the Gemma-4 tokenizer and template (one prefill call)."""
    from server.tools.export import export

    checkpoint = tiny_gemma4_checkpoint(root / "checkpoint")
    artifacts = export(checkpoint, root / "artifacts", prefill_bucket=max_total, max_total=max_total, dtype="float32")
    cfg, source = artifacts / "cfg", gemma4_cfg_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(source / name, cfg / name)
    (cfg / "special_tokens_map.json").unlink(missing_ok=True)
    return load_host(artifacts, "hf", MODEL)


@contextmanager
def gemma4_server(host: Host, graph: Any, config: Settings | None = None, *, prefix_reuse: bool = True,
                  wait_grammar: bool = True) -> Iterator[LiveServer]:
    """A live server on `graph` (a module's stand-in device around the host's graph). `wait_grammar`: build the
    grammar vocabulary up front, once per module (13-60 s), so that no constrained request's time includes it."""
    config = config or settings(served_model_name=MODEL)
    engine = build_engine(host, config, load=lambda: graph, prefix_reuse=prefix_reuse)
    prompts = Prompts(engine)  # before the app exists, so that whatever it keeps of the engine submits through it
    with live_server(config, engine, host) as live:
        live.prompts = prompts  # type: ignore[attr-defined]  # the `prompts` fixture's
        if wait_grammar:
            live.app.state.grammar.wait(600)
        yield live


class Prompts:
    """The prompt ids every request submitted to the engine (a pass-through: the engine runs them as always)."""

    def __init__(self, engine: Engine) -> None:
        self.ids: list[tuple[int, ...]] = []
        submit_all = engine.submit_all

        def recording(requests: Sequence[Any]) -> Any:
            self.ids.extend(request.prompt_ids for request in requests)
            return submit_all(requests)

        engine.submit_all = recording  # type: ignore[method-assign]

    @property
    def last(self) -> tuple[int, ...]:
        return self.ids[-1]


def chat_prompt(server: LiveServer, prompts: Prompts, messages: list[dict[str, Any]], **fields: Any) -> tuple[int, ...]:
    """The prompt the chat route renders for these messages (one token is enough to have it submitted)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                                              **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return prompts.last


def chat_chunks(server: LiveServer, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A streamed chat completion's chunks, parsed (the stream answered 200 and no chunk is an in-band error)."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            yield chunk


_SHARED: dict[str, Host] = {}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    """One tiny Gemma-4 host for the whole session, whichever module asks first: ten modules serve it, and each
    used to export it again and build its grammar vocabulary again (262k tokens, 13-60 s). A Host is a frozen value;
    its graph is built per module from it (graph_loader), so no module sees another's device state."""
    if "host" not in _SHARED:
        _SHARED["host"] = gemma4_host(tmp_path_factory.getbasetemp() / "gemma4-shared")
    return _SHARED["host"]


@pytest.fixture(scope="module")
def prompts(server: LiveServer) -> Prompts:
    """What the module's server (a `gemma4_server`) submitted to its engine."""
    return server.prompts  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def script(host: Host, graph: Any) -> Iterator[Callable[[str], None]]:
    """Sets the module's scripted graph to force this text's tokens; the graph runs free again after the test."""
    def set_script(text: str) -> None:
        graph.script = host.tokenizer.encode(text, add_special_tokens=False)

    yield set_script
    graph.script = None
