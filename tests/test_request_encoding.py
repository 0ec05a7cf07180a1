"""Compressed request bodies (`Content-Encoding` gzip, deflate, zstd) on every JSON route, against a live server on the
demo's null graph: decoded and answered as the plain body is; a bomb (a small body that decodes past the body limit)
is a 413 after at most the limit's worth of output; corrupt data a 400; an unknown coding a 415 before the body is read.
The decoder's bounds are also checked alone (server.api.content_encoding)."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from collections.abc import Callable, Iterator

import httpx
import pytest
import zstandard

from server.api.content_encoding import decoded
from server.errors import APIError
from tests.support.api_fixtures import LiveServer, live_server, settings

LIMIT = 64 * 1024


def _deflate(data: bytes) -> bytes:
    return zlib.compress(data)


def _raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-15)
    return compressor.compress(data) + compressor.flush()


CODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress, "deflate": _deflate, "zstd": zstandard.ZstdCompressor().compress,
}

ROUTES = {
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with live_server(settings(max_body_bytes=LIMIT)) as server:
        yield server


def post(live: LiveServer, path: str, body: bytes, encoding: str | None) -> httpx.Response:
    headers = {"Content-Type": "application/json", **({"Content-Encoding": encoding} if encoding else {})}
    return httpx.post(f"{live.url}{path}", content=body, headers=headers, timeout=60)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("encoding", CODERS)
def test_every_route_answers_a_compressed_body_as_the_plain_one(live: LiveServer, path: str, encoding: str) -> None:
    model = httpx.get(f"{live.url}/v1/models", timeout=30).json()["data"][0]["id"]  # /v1/messages needs a name
    raw = json.dumps({**ROUTES[path], "model": model, "temperature": 0}).encode()
    plain = post(live, path, raw, None)
    packed = post(live, path, CODERS[encoding](raw), encoding)
    assert plain.status_code == 200, plain.text
    assert packed.status_code == 200, packed.text
    keys = ("output", "choices", "content")
    first, second = plain.json(), packed.json()
    for key in keys:
        if key in first:
            assert _text(first[key]) == _text(second[key])


def _text(value: object) -> str:
    """The generated text of any route's answer (ids and timestamps differ between two answers)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                if key == "text" and isinstance(child, str) or key == "content" and isinstance(child, str):
                    found.append(child)
                else:
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(value)
    return "".join(found)


def test_two_codings_in_order_and_raw_deflate(live: LiveServer) -> None:
    raw = json.dumps(ROUTES["/v1/responses"]).encode()
    assert post(live, "/v1/responses", gzip.compress(CODERS["zstd"](raw)), "zstd, gzip").status_code == 200
    assert post(live, "/v1/responses", _raw_deflate(raw), "deflate").status_code == 200
    assert post(live, "/v1/responses", raw, "identity").status_code == 200


@pytest.mark.parametrize("encoding", CODERS)
def test_a_bomb_is_a_413_quickly(live: LiveServer, encoding: str) -> None:
    bomb = CODERS[encoding](b"[" + b" " * (64 * 1024 * 1024) + b"]")  # 64 MiB of JSON in a few KiB
    assert len(bomb) < LIMIT
    start = time.perf_counter()
    r = post(live, "/v1/responses", bomb, encoding)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "decoded" in r.json()["error"]["message"]
    assert time.perf_counter() - start < 10  # stopped at the limit, not after decoding 64 MiB
    assert httpx.get(f"{live.url}/health").status_code == 200


@pytest.mark.parametrize("encoding", CODERS)
def test_corrupt_or_truncated_data_is_a_400(live: LiveServer, encoding: str) -> None:
    packed = CODERS[encoding](json.dumps(ROUTES["/v1/responses"]).encode() * 20)
    for body in (packed[: len(packed) // 2], b"not compressed at all"):
        r = post(live, "/v1/responses", body, encoding)
        assert r.status_code == 400, (encoding, r.text)
        assert encoding in r.json()["error"]["message"]


def test_an_unknown_coding_is_a_415_naming_it(live: LiveServer) -> None:
    for path in ROUTES:
        r = post(live, path, b"\x00" * 10, "br")
        assert r.status_code == 415, r.text
        assert "'br'" in r.json()["error"]["message"]


def test_the_decoder_bounds_each_step_of_output() -> None:
    data = b"x" * (LIMIT + 1)
    for name, coder in CODERS.items():
        assert decoded(coder(data[:LIMIT]), name, LIMIT) == data[:LIMIT]
        with pytest.raises(APIError) as caught:
            decoded(coder(data), name, LIMIT)
        assert caught.value.status == 413
    two_members = gzip.compress(b'{"a":') + gzip.compress(b"1}")  # a multi-member gzip file is one body
    assert decoded(two_members, "gzip", LIMIT) == b'{"a":1}'
    with pytest.raises(APIError) as caught:
        decoded(_deflate(b"{}") + b"junk", "deflate", LIMIT)
    assert caught.value.status == 400
