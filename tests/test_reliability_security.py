"""Security: the API key (flag, env, file; constant-time; both headers; every protected route), a loopback
bind by default, no route that reads a path from a request (checked statically and with an audit hook while
path-like strings are sent everywhere), pickles refused when loading artifacts, and fetch's size check.

tests/test_api_openai.py covers the basic key check and the 413s, tests/test_fetch.py pinning and hashes;
this file adds what they leave out.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.routing import Route

import server.api as api_package
from server.__main__ import build_parser, main
from server.api import app as app_module
from server.config import Settings
from server.errors import ArtifactError
from server.model.artifacts import validate
from server.model.embedding import open_table
from server.tools.fetch import RemoteFile, verify
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.models import demo_dir

KEY = "sk-reliability-ключ"  # non-ASCII on purpose: clients send it as UTF-8 bytes
HI = [{"role": "user", "content": "Hi"}]
OPEN = {"/health", "/metrics", "/", "/openapi.json"}  # "/": the chat page, and the API description: no secret


def cli_settings(args: list[str], environ: dict[str, str]) -> Settings:
    return Settings.from_cli(build_parser().parse_args(["serve", *args]), environ)


# ------------------------------------------------------------------------------------------- configuration


def test_api_key_from_flag_env_or_file_and_an_empty_file_is_refused(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n", encoding="utf-8")
    assert cli_settings([], {"API_KEY_FILE": str(key_file)}).api_key == KEY
    assert cli_settings(["--api-key-file", str(key_file)], {}).api_key == KEY
    assert cli_settings([], {"API_KEY": "from-env"}).api_key == "from-env"
    assert cli_settings(["--api-key", "flag"], {"API_KEY": "env", "API_KEY_FILE": str(key_file)}).api_key == "flag"
    assert cli_settings([], {"API_KEY": "env", "API_KEY_FILE": str(key_file)}).api_key == "env"
    assert cli_settings([], {}).api_key is None
    assert KEY not in repr(cli_settings(["--api-key-file", str(key_file)], {}))  # never in a log line

    # a secret that did not mount must not turn authentication off: refused at start-up, exit 2, no traceback
    empty = tmp_path / "empty"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        cli_settings([], {"API_KEY_FILE": str(empty)})
    missing = tmp_path / "missing"
    for environ in ({"API_KEY_FILE": str(empty)}, {"API_KEY_FILE": str(missing)}):
        assert main(["serve", "--artifacts", str(tmp_path), "--graph", "null"], environ) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "Traceback" not in err and str(tmp_path) in err


def test_the_server_binds_to_loopback_unless_told_otherwise() -> None:
    assert Settings().host == "127.0.0.1"
    assert cli_settings([], {}).host == "127.0.0.1"
    assert cli_settings([], {"HOST": "0.0.0.0"}).host == "0.0.0.0"  # what the container's entrypoint sets
    root = Path(__file__).resolve().parents[1]
    assert "HOST=0.0.0.0" in (root / "Dockerfile").read_text()


def test_the_key_is_compared_in_constant_time() -> None:
    source = inspect.getsource(app_module._require_key)
    assert "hmac.compare_digest" in source
    assert "== expected" not in source and "expected ==" not in source and "!= expected" not in source


# ------------------------------------------------------------------------------------------- the key on the wire


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    key_file = tmp_path_factory.mktemp("secrets") / "api-key"
    key_file.write_text(KEY + "\n", encoding="utf-8")
    key = cli_settings(["--api-key-file", str(key_file)], {}).api_key
    with live_server(settings(api_key=key)) as live:
        yield live


def _protected_requests(live: LiveServer) -> list[tuple[str, str, dict[str, Any] | None]]:
    """One valid request for every route of the app except the open ones (so a new route cannot slip by)."""
    bodies: dict[str, dict[str, Any] | None] = {
        "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
        "/v1/completions": {"prompt": "x", "max_tokens": 1},
        "/generate": {"prompt": "x", "max_new_tokens": 1},
        "/tokenize": {"prompt": "x"},
        "/detokenize": {"tokens": [2]},
        "/v1/models": None,
        "/v1/models/{model:path}": None,
        "/v1/responses": {"input": "x", "max_output_tokens": 1},
        "/v1/responses/{response_id}": None,  # GET and DELETE: the id of a response stored for each request
        "/v1/responses/{response_id}/input_items": None,
        "/v1/messages": {"model": "gemma-test", "messages": HI, "max_tokens": 1},
        "/v1/messages/count_tokens": {"model": "gemma-test", "messages": HI},
    }
    requests = []
    for route in live.app.routes:
        assert isinstance(route, Route), f"unexpected mount or websocket route {route}"
        if route.path in OPEN:
            continue
        assert route.path in bodies, f"new route {route.path}: add it to this test"
        methods = route.methods or ()
        method = "POST" if "POST" in methods else "DELETE" if "DELETE" in methods else "GET"
        requests.append((method, route.path.replace("{model:path}", "gemma-test"), bodies[route.path]))
    return requests


def _concrete(client: httpx.Client, path: str) -> str:
    """A stored response's id in place of `{response_id}` (a fresh one each time: DELETE removes it)."""
    if "{response_id}" not in path:
        return path
    r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1},
                    headers={"Authorization": b"Bearer " + KEY.encode()})
    assert r.status_code == 200, r.text
    return path.replace("{response_id}", r.json()["id"])


def test_every_protected_route_needs_the_key_and_takes_it_either_way(keyed: LiveServer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.api")
    good = KEY.encode()
    refused = 0
    with httpx.Client(base_url=keyed.url, timeout=30) as client:
        for method, path, body in _protected_requests(keyed):
            for headers in ({}, {"Authorization": b"Bearer " + good[:-1]}, {"Authorization": b"Bearer " + good + b"x"},
                            {"Authorization": b"Basic " + good}, {"X-Api-Key": b"sk-reliability"},
                            {"Authorization": b"Bearer"}, {"X-Api-Key": KEY.encode("cp1251")}):
                r = client.request(method, _concrete(client, path), json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                error = r.json()["error"]  # OpenAI's shape, or Anthropic's on its Messages API
                if path.startswith("/v1/messages"):
                    assert r.json()["type"] == "error" and error["type"] == "authentication_error", r.text
                else:
                    assert error["code"] == "invalid_api_key", r.text
                assert r.headers["www-authenticate"] == "Bearer"
                assert KEY not in r.text
                refused += 1
            for headers in ({"Authorization": b"Bearer " + good}, {"authorization": b"bearer  " + good},
                            {"X-Api-Key": good}, {"Authorization": b"Bearer wrong", "X-Api-Key": good}):
                r = client.request(method, _concrete(client, path), json=body, headers=headers)
                assert r.status_code == 200, (path, headers, r.text)
        for path in OPEN:
            assert client.get(path).status_code == 200
        metrics = client.get("/metrics").text
    assert f'gemma4_errors_total{{status="401"}} {float(refused)}' in metrics
    lines = [r for r in caplog.records if "-> 401" in r.getMessage()]
    assert len(lines) == refused and not any(KEY in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------- no route reads paths


def test_no_module_of_the_http_layer_touches_the_filesystem() -> None:
    """Static: the request path (server/api) has no file API at all; artifacts are loaded before serving."""
    banned = ("open(", "read_text", "read_bytes", "write_text", "FileResponse", "StaticFiles", "os.path", "Path(",
              "torch.load", "pickle", "import pathlib", "from pathlib", "os.listdir", "os.scandir")
    folder = Path(api_package.__file__).parent
    for source in sorted(folder.rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        found = [word for word in banned if word in text]
        assert not found, f"{source.name} uses {found}"


class OpenAudit:
    """Records every file the process opens while armed (an audit hook: catches C and Python opens alike)."""

    def __init__(self) -> None:
        self.armed = False
        self.opened: list[str] = []
        self._lock = threading.Lock()
        sys.addaudithook(self._hook)  # cannot be removed; idle unless armed

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.armed and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], str | bytes):
            with self._lock:
                self.opened.append(os.fsdecode(args[0]))


def test_path_like_strings_anywhere_in_a_request_are_never_opened(keyed: LiveServer, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-CONTENT")
    paths = [str(secret), f"file://{secret}", f"../../../..{secret}", "/etc/passwd", "~/.ssh/id_rsa"]
    auth = {"Authorization": f"Bearer {KEY}".encode()}
    audit = OpenAudit()
    audit.armed = True  # the hook sees opens (a self-check, so an empty record below means something)
    (tmp_path / "probe").write_text("x")
    audit.armed = False
    assert audit.opened == [str(tmp_path / "probe")]
    audit.opened.clear()
    with httpx.Client(base_url=keyed.url, timeout=30, headers=auth) as client:
        client.post("/v1/completions", json={"prompt": "warm", "max_tokens": 1})  # imports done, caches filled
        audit.armed = True
        answers: list[httpx.Response] = []
        for p in paths:
            answers += [
                client.post("/v1/chat/completions", json={"model": p, "messages": HI}),
                client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": p}], "max_tokens": 2}),
                client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "text", "text": "x"}, {"type": "file", "file": {"path": p, "file_id": p}}]}]}),
                client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": f"file://{p}"}}]}]}),
                client.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "suffix": p, "user": p}),
                client.post("/tokenize", json={"prompt": p, "model": "gemma-test"}),
                client.post("/generate", json={"prompt": p, "max_new_tokens": 1}),
                client.get(f"/v1/models/{p}"),
                client.get(f"/{p.lstrip('/')}"),
                client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": p}),
            ]
        audit.armed = False
    assert all(r.status_code in (200, 400, 404) for r in answers), [(r.status_code, r.text[:100]) for r in answers]
    assert all("TOPSECRET" not in r.text and "root:" not in r.text for r in answers)
    touched = [o for o in audit.opened if any(marker in o for marker in ("secret", "passwd", ".ssh", "file:"))]
    assert not touched, touched
    assert [r.status_code for r in answers[::10]] == [404] * len(paths)  # a path as the model name: unknown model


# ------------------------------------------------------------------------------------------- artifacts


class Exploit:
    """A pickle that runs code when loaded without weights_only: it would create `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["bare", "beside-the-weight"])
def test_a_pickle_bearing_embedding_table_is_refused_and_validation_says_so(tmp_path: Path, payload: str) -> None:
    marker = tmp_path / "pwned"
    root = tmp_path / "artifacts"
    root.mkdir()
    (root / "cfg").symlink_to(demo_dir() / "cfg")
    table = root / "embed_tokens.pt"
    torch.save(Exploit(marker) if payload == "bare" else {"weight": torch.zeros(4, 4), "extra": Exploit(marker)}, table)

    with pytest.raises(Exception, match="(?i)weights.only|unpickl|unsupported global") as caught:
        open_table(table)
    assert "system" in str(caught.value)
    with pytest.raises(ArtifactError) as invalid:
        validate(root, "null")
    assert "embed_tokens.pt: cannot be read" in str(invalid.value)
    assert main(["check", "--artifacts", str(root), "--graph", "null"]) == 1
    assert not marker.exists(), "the payload ran"


def test_fetch_verification_checks_every_size_and_discards_what_differs(tmp_path: Path) -> None:
    good, short, tampered = b"x" * 100, b"y" * 90, b"z" * 100
    for name, data in (("good.bin", good), ("short.bin", short), ("tampered.bin", tampered), ("nohash.bin", short)):
        (tmp_path / name).write_bytes(data)
    remote = [
        RemoteFile("good.bin", 100, hashlib.sha256(good).hexdigest(), None),
        RemoteFile("short.bin", 100, hashlib.sha256(b"y" * 100).hexdigest(), None),  # a truncated download
        RemoteFile("tampered.bin", 100, hashlib.sha256(good).hexdigest(), None),  # same size, other bytes
        RemoteFile("nohash.bin", 100, None, None),  # the Hub gave no hash: the size still counts
    ]
    problems = verify(tmp_path, remote)
    assert len(problems) == 3, problems
    assert any(p.startswith("short.bin: size 90 bytes") for p in problems)
    assert any(p.startswith("tampered.bin: sha256") for p in problems)
    assert any(p.startswith("nohash.bin: size 90 bytes") for p in problems)
    assert (tmp_path / "good.bin").exists()
    assert not any((tmp_path / n).exists() for n in ("short.bin", "tampered.bin", "nohash.bin"))
