"""Compressed request bodies: `Content-Encoding` gzip, deflate and zstd decoded (`decoded`) with a bound on the decoded
size, so a small body that expands to gigabytes (a "bomb") is a 413 after at most `limit` bytes of output, never an
out-of-memory or a stall. An encoding this server cannot decode is a 415 naming it.

Why: OpenAI's clients may compress what they send (Codex CLI links a zstd request compressor, behind a feature flag;
0.171.0 with an API key sends plain JSON, see docs/api.md), and a proxy in front of the server may add gzip. Each
decoder is fed in bounded steps: zlib's `max_length`, zstd's stream reader read in chunks, so the work per request is
bounded by `limit` however the body was made.
"""

from __future__ import annotations

import io
import zlib

import zstandard

from server.errors import APIError

SUPPORTED = ("gzip", "deflate", "zstd", "identity")
_CHUNK = 64 * 1024  # decoded bytes per step


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The decoded request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def _malformed(encoding: str, why: str) -> APIError:
    return APIError(400, f"The request body is not valid {encoding} data: {why[:200]}", code="invalid_request")


def codings(header: str | None) -> list[str]:
    """The codings of a Content-Encoding header in the order they were applied; 415 for one not supported."""
    names = [name.strip().lower() for name in (header or "").split(",") if name.strip()]
    for name in names:
        if name not in SUPPORTED:
            raise APIError(415, f"Content-Encoding {name[:40]!r} is not supported (supported: gzip, deflate, zstd).",
                           code="unsupported_media_type")
    return [name for name in names if name != "identity"]


def _zlib(body: bytes, wbits: int, limit: int, name: str) -> bytes:
    """gzip (wbits 31, every member of a multi-member file) or zlib-wrapped deflate (15), at most `limit` bytes."""
    out = bytearray()
    data = body
    while data:
        decoder = zlib.decompressobj(wbits)
        try:
            while not decoder.eof:
                chunk = decoder.decompress(data, _CHUNK)
                out += chunk
                if len(out) > limit:
                    raise _too_large(limit)
                data = decoder.unconsumed_tail
                if not chunk and not data:
                    raise _malformed(name, "truncated")
        except zlib.error as exc:
            raise _malformed(name, str(exc)) from None
        data = decoder.unused_data
        if data and wbits != 31:  # gzip: the next member follows; deflate is one stream
            raise _malformed(name, "data after the end of the stream")
    return bytes(out)


def _zstd(body: bytes, limit: int) -> bytes:
    """Every frame of `body`, at most `limit` bytes. The stream reader bounds the output (read in chunks) but ends a
    truncated frame silently, so a second pass, frame by frame, checks each frame ends: bounded too, since the same
    data was just seen to decode within the limit."""
    size = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
        while chunk := reader.read(_CHUNK):
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
        out = bytearray()
        data = body
        while data:
            frame = zstandard.ZstdDecompressor().decompressobj()
            out += frame.decompress(data)
            if not frame.eof:
                raise _malformed("zstd", "truncated")
            data = frame.unused_data
    except zstandard.ZstdError as exc:
        raise _malformed("zstd", str(exc)) from None
    return bytes(out)


def decoded(body: bytes, header: str | None, limit: int) -> bytes:
    """`body` with the codings of `header` undone (last applied first), each result at most `limit` bytes."""
    for name in reversed(codings(header)):
        if name == "gzip":
            body = _zlib(body, 31, limit, name)
        elif name == "deflate":  # HTTP's deflate is zlib-wrapped; some clients send raw deflate
            body = _zlib(body, 15 if body[:1] and (body[0] & 0x0F) == 8 and int.from_bytes(body[:2]) % 31 == 0
                         else -15, limit, name)
        else:
            body = _zstd(body, limit)
    return body
