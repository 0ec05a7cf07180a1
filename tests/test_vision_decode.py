"""Image bytes and pictures, bounded (server.vision.decode): every refusal is an ImageError saying what was wrong,
before anything large is allocated; http(s) downloads only when allowed, with size and redirect limits. And the
prefill plan never splits an image block (server.engine.buckets)."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import zlib
from collections.abc import Iterator

import pytest
from PIL import Image

from server.engine.buckets import chunk_spans
from server.vision.decode import MAX_REDIRECTS, ImageError, decode_image, image_bytes

LIMIT = 1 << 20


def png(width: int = 8, height: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def bomb(width: int, height: int) -> bytes:
    """A tiny PNG that declares width x height pixels (one all-zero deflate stream would fill them)."""
    import struct

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale
    rows = zlib.compress(b"\0" * (1 + (width + 7) // 8) * 64)  # a few rows only: the rest is missing
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def test_a_data_url_png_decodes_to_rgb() -> None:
    picture = decode_image(image_bytes(data_url(png(12, 7)), max_bytes=LIMIT, allow_urls=False), max_pixels=10_000)
    assert picture.mode == "RGB" and picture.size == (12, 7)


@pytest.mark.parametrize(("url", "says"), [
    ("", "empty"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64", "comma"),
    ("data:image/png;base64,!!!!", "malformed"),
    ("ftp://example.com/x.png", "scheme 'ftp'"),
    ("file:///etc/passwd", "scheme 'file'"),
    ("https://example.com/x.png", "--allow-image-urls"),
])
def test_bad_urls_are_refused(url: str, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        image_bytes(url, max_bytes=LIMIT, allow_urls=False)


def test_too_many_bytes_are_refused_before_decoding() -> None:
    with pytest.raises(ImageError, match="--max-image-bytes"):
        image_bytes(data_url(b"\0" * 5000), max_bytes=1000, allow_urls=False)


@pytest.mark.parametrize(("data", "says"), [
    (b"not an image at all", "not an image"),
    (png(64, 64)[:-40], "truncated"),
    (bomb(8000, 8000), "--max-image-pixels"),  # ours, on the header: 64 M > the 50 M bound
    (bomb(100_000, 100_000), "decompression bomb"),  # Pillow's own, already when it opens it
])
def test_bad_pictures_are_refused(data: bytes, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        decode_image(data, max_pixels=50_000_000)


def test_a_decompression_bomb_under_our_bound_is_still_refused_by_pillows() -> None:
    # Pillow's own check (twice its MAX_IMAGE_PIXELS) stays on beneath a generous server bound
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_image(bomb(20_000, 20_000), max_pixels=10**12)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.startswith("/hop"):
            hop = int(self.path[4:] or 0)
            self.send_response(302)
            self.send_header("Location", f"/hop{hop + 1}" if hop < 10 else "/img")
            self.end_headers()
            return
        if self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        body = png() if self.path == "/img" else b"\0" * 4096
        self.send_response(200 if self.path in ("/img", "/big") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


def test_allowed_urls_download_within_their_limits(site: str) -> None:
    assert image_bytes(f"{site}/img", max_bytes=LIMIT, allow_urls=True) == png()
    assert image_bytes(f"{site}/hop{10 - MAX_REDIRECTS + 1}", max_bytes=LIMIT, allow_urls=True) == png()
    with pytest.raises(ImageError, match="redirect was not followed"):
        image_bytes(f"{site}/hop0", max_bytes=LIMIT, allow_urls=True)
    with pytest.raises(ImageError, match="redirect was not followed"):
        image_bytes(f"{site}/to-file", max_bytes=LIMIT, allow_urls=True)
    with pytest.raises(ImageError, match="--max-image-bytes"):
        image_bytes(f"{site}/big", max_bytes=1000, allow_urls=True)
    with pytest.raises(ImageError, match="HTTP 404"):
        image_bytes(f"{site}/missing", max_bytes=LIMIT, allow_urls=True)


@pytest.mark.parametrize(("start", "stop", "buckets", "blocks"), [
    (0, 300, [128], [(120, 190)]),
    (0, 300, [16, 64, 128], [(10, 80), (100, 220)]),
    (0, 96, [16, 64], [(64, 94)]),
    (40, 400, [32, 128], [(50, 170), (171, 291)]),
])
def test_the_prefill_plan_never_splits_an_image_block(start: int, stop: int, buckets: list[int],
                                                      blocks: list[tuple[int, int]]) -> None:
    spans = chunk_spans(start, stop, buckets, blocks)
    assert spans[0][0] == start and spans[-1][1] == stop
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(end - begin <= max(buckets) for begin, end in spans)
    for first, last in blocks:
        assert any(begin <= first and last <= end for begin, end in spans), (first, last, spans)


def test_a_block_longer_than_the_largest_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than the largest prefill chunk"):
        chunk_spans(0, 300, [64], [(10, 90)])
