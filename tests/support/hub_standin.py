"""A local stand-in for the few Hugging Face Hub routes `huggingface_hub` 2.x uses to download a repo.

Point `HF_ENDPOINT` (or `endpoint=`) at `HubStandIn.url`. Routes, as in huggingface_hub's own calls:

- `GET /api/models/{repo}[/revision/{rev}][?blobs=true]`  model_info / repo_info: `sha`, `siblings`
  (with `size`, `blobId`, `lfs{sha256,size,pointerSize}` when `blobs=true`, i.e. `files_metadata=True`);
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...`  list_repo_tree, used by snapshot_download;
- `HEAD|GET /{repo}/resolve/{rev}/{path}`  file metadata (`X-Repo-Commit`, `ETag`, `X-Linked-Etag` and
  `X-Linked-Size` for LFS files, `Content-Length`) and content, with `Range: bytes=N-` answered by a 206.

Knobs for failure tests: `truncate_once` (paths whose first GET is cut half-way, then the connection closed,
like a dropped network), `corrupt` (paths served with different bytes than the advertised hashes),
`requests` (every request seen: method, path, Range header).

The repo is a directory on disk; files ending in .pt/.safetensors/.bin are "LFS" files, as in real repos.
The HTTP side uses only the standard library: it must not share code paths with the client it tests.
`make_tiny_repo` builds a small artifact repo (what the server reads, plus files fetch must leave behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import torch

from server.model.artifacts import GraphSpec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".pt", ".safetensors", ".bin")
VOCAB, HIDDEN = 64, 16


class RepoFile:
    """One file of the repo, read from disk when asked (the repo may be a real 1.7 GB artifact dir)."""

    def __init__(self, path: str, disk: Path) -> None:
        self.path = path
        self.disk = disk
        self.lfs = path.endswith(LFS_SUFFIXES)
        self._sha256: str | None = None
        self._blob_id: str | None = None

    @property
    def size(self) -> int:
        return self.disk.stat().st_size

    @property
    def data(self) -> bytes:
        return self.disk.read_bytes()

    def _digest(self, digest: Any) -> str:
        with self.disk.open("rb") as handle:
            while block := handle.read(1 << 23):
                digest.update(block)
        return digest.hexdigest()

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = self._digest(hashlib.sha256())
        return self._sha256

    @property
    def blob_id(self) -> str:
        # git's object id; for LFS files the Hub reports the id of the pointer file, which nobody checks
        if self._blob_id is None:
            self._blob_id = self._digest(hashlib.sha1(f"blob {self.size}\0".encode()))  # noqa: S324
        return self._blob_id


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class HubStandIn:
    """A threaded HTTP server holding one repo. Use as a context manager."""

    repo_id: str
    root: Path
    commit: str = COMMIT
    truncate_once: set[str] = field(default_factory=set)
    corrupt: dict[str, bytes] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.files: dict[str, RepoFile] = {}
        for path in sorted(self.root.rglob("*")):
            if path.is_file():
                rel = path.relative_to(self.root).as_posix()
                self.files[rel] = RepoFile(rel, path)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, method: str, path: str, range_header: str | None) -> None:
        with self._lock:
            self.requests.append(Request(method, path, range_header))

    def gets(self, path: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(f"/resolve/{self.commit}/{path}")]

    # --- JSON bodies ---------------------------------------------------------------------------------------

    def model_info(self, blobs: bool) -> dict[str, Any]:
        siblings = []
        for f in self.files.values():
            entry: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                entry.update(size=f.size, blobId=f.blob_id)
                if f.lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(entry)
        return {"_id": "standin", "id": self.repo_id, "modelId": self.repo_id, "sha": self.commit,
                "private": False, "tags": [], "siblings": siblings}

    def tree(self, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        prefix = prefix.strip("/")
        entries: dict[str, dict[str, Any]] = {}
        for f in self.files.values():
            if prefix and not f.path.startswith(prefix + "/"):
                continue
            rest = f.path[len(prefix) + 1:] if prefix else f.path
            parts = rest.split("/")
            base = f"{prefix}/" if prefix else ""
            for depth in range(1, len(parts)):  # the folders on the way
                folder = base + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder})
            if recursive or len(parts) == 1:
                entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                entries[f.path] = entry
        return [entries[k] for k in sorted(entries)]


def _make_handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    api_re = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?P<rest>/.*)?)?$")
    resolve_re = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet test output
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self._route(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._route(head=False)

        def _route(self, head: bool) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.record(self.command, path, self.headers.get("Range"))
            query = parse_qs(url.query)
            if (m := api_re.match(path)) and not head:
                self._api(m, query)
            elif m := resolve_re.match(path):
                self._resolve(m["repo"], unquote(m["rev"]), m["path"], head)
            else:
                self._error(404, "Not Found", None)

        def _check_repo(self, repo: str, rev: str) -> bool:
            if repo != hub.repo_id:
                self._error(404, "Repository not found", "RepoNotFound")
                return False
            if rev not in ("main", hub.commit):
                self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                return False
            return True

        def _api(self, m: re.Match[str], query: dict[str, list[str]]) -> None:
            rev = unquote(m["rev"] or "main")
            if not self._check_repo(m["repo"], rev):
                return
            if m["kind"] == "tree":
                recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                body: Any = hub.tree(unquote(m["rest"] or ""), recursive)
            else:
                body = hub.model_info(blobs=query.get("blobs", ["false"])[0].lower() in ("true", "1"))
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _resolve(self, repo: str, rev: str, path: str, head: bool) -> None:
            if not self._check_repo(repo, rev):
                return
            f = hub.files.get(path)
            if f is None:
                self._error(404, "Entry not found", "EntryNotFound")
                return
            corrupt = hub.corrupt.get(path)
            total = len(corrupt) if corrupt is not None else f.size
            start = 0
            if not head and (rng := self.headers.get("Range")):
                m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
                if m is None:
                    self._error(416, "only bytes=N- ranges", None)
                    return
                start = int(m[1])
            length = total - start
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("ETag", f'"{f.sha256 if f.lfs else f.blob_id}"')
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(f.size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{total - 1}/{total}")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if head:
                return
            with hub._lock:
                cut = path in hub.truncate_once
                hub.truncate_once.discard(path)
            # A dropped connection sends half the promised body, then the socket closes.
            limit = length // 2 if cut else length
            if corrupt is not None:
                self.wfile.write(corrupt[start:start + limit])
            elif limit:
                with f.disk.open("rb") as handle:  # sendfile: the 641 MB demo table in well under a second
                    self.connection.sendfile(handle, offset=start, count=limit)
            if cut:
                self.wfile.flush()
                self.close_connection = True

        def _error(self, status: int, message: str, code: str | None) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
            self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def make_tiny_repo(root: Path) -> Path:
    """A small artifact repo: everything the server reads, plus files fetch must leave on the Hub."""
    (root / "cfg").mkdir(parents=True)
    (root / "cfg" / "config.json").write_text(
        f'{{"model_type": "gemma3_text", "vocab_size": {VOCAB}, "hidden_size": {HIDDEN}}}')
    (root / "cfg" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel"}}')
    (root / "cfg" / "generation_config.json").write_text('{"eos_token_id": 1}')
    torch.save(torch.randn(VOCAB, HIDDEN).to(torch.bfloat16), root / "embed_tokens.pt")
    (root / "graph.json").write_text(json.dumps(GraphSpec(max_total=64, prefill_bucket=16).to_json()))
    # Bigger than two of huggingface_hub's 10 MiB read chunks: cut half-way, one chunk has reached the disk,
    # so the retry must resume from there (smaller files restart from 0 without a Range request).
    (root / "model.pt").write_bytes(os.urandom(24 * 1024 * 1024 + 17))
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text('{"model_type": "gemma3_text"}')
    (root / "hf" / "model.safetensors").write_bytes(os.urandom(1024 * 1024))
    (root / "README.md").write_text("# not an artifact\n")
    (root / ".gitattributes").write_text("*.pt filter=lfs diff=lfs merge=lfs -text\n")
    return root
