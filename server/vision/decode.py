"""Image bytes from an image part's URL, and the picture they hold, bounded before anything large is allocated.

Torch-free (Pillow and the standard library only). Every refusal is an `ImageError` whose message says what was
wrong with the image; the caller names the part (`messages[0].content[1]`) and makes it a 400.

- data: URLs are always taken (base64 only: an image is binary); http(s) URLs only when the server allows them, with
  a size limit (read at most that many bytes, whatever Content-Length says), a time limit for the whole download and
  at most `MAX_REDIRECTS` redirects, each to http(s) again. Any other scheme (file:, ftp:, ...) is refused.
- The pixel bound is checked on the header (Pillow reads the size before any pixel): a decompression bomb (a few KB
  that declare 100k x 100k pixels) is refused without being decoded. Pillow's own bomb check stays on too.
- A truncated file fails when its pixels are read (Pillow raises); the image is loaded here, so the failure is ours to
  report, not the processor's.
- An animated image gives its first frame; every mode is converted to RGB, as the Gemma-4 processor would.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
import warnings
from typing import Any

URL_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3


class ImageError(ValueError):
    """An image part this server cannot take (the message says why); a 400 naming the part."""


def image_bytes(url: str, *, max_bytes: int, allow_urls: bool) -> bytes:
    """The encoded image a part's `url` holds (a data: URL) or names (http(s), when `allow_urls`)."""
    if not isinstance(url, str) or not url:
        raise ImageError("the image URL is empty")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, max_bytes)
    if scheme in ("http", "https"):
        if not allow_urls:
            raise ImageError("http(s) image URLs are off on this server (--allow-image-urls); send the image as a "
                             "data: URL (data:image/png;base64,...)")
        return _download(url, max_bytes)
    raise ImageError(f"an image URL must be a data: URL{' or http(s)' if allow_urls else ''}, got scheme "
                     f"{scheme or 'none'!r}")


def _data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("a data: URL needs a comma before its data (data:image/png;base64,...)")
    if not header.lower().endswith(";base64"):
        raise ImageError("a data: URL image must be base64 (data:image/png;base64,...)")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:  # base64 is 4/3 the bytes: refuse before decoding
        raise ImageError(f"the image is larger than this server takes ({max_bytes} bytes, --max-image-bytes)")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 is malformed") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is larger than this server takes ({max_bytes} bytes, --max-image-bytes)")
    return data


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ImageError(f"the image URL redirected to a non-http(s) URL ({newurl[:100]})")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, max_bytes: int) -> bytes:
    opener = urllib.request.build_opener(_Redirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "gemma4-optb"}),
                         timeout=URL_TIMEOUT_S) as response:
            data = response.read(max_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:  # urllib's answer past max_redirections, or to a redirect to another scheme
            raise ImageError(f"the image URL's redirect was not followed (more than {MAX_REDIRECTS}, or to a non-http(s) "
                             "URL)") from None
        raise ImageError(f"the image URL answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageError(f"the image URL could not be read ({reason})") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is larger than this server takes ({max_bytes} bytes, --max-image-bytes)")
    return data


def decode_image(data: bytes, *, max_pixels: int) -> Any:
    """The picture `data` holds, as a loaded RGB `PIL.Image.Image`, or an ImageError saying why not."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            width, height = image.size
            if width < 1 or height < 1:
                raise ImageError(f"the image has no pixels ({width} x {height})")
            if width * height > max_pixels:
                raise ImageError(f"the image has {width} x {height} pixels, more than this server takes ({max_pixels}, "
                                 "--max-image-pixels)")
            image.seek(0)
            image.load()  # every pixel now: a truncated file fails here
            return image.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError("the data is not an image Pillow can read (PNG, JPEG, WebP, GIF, ...)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError("the image declares more pixels than it can hold (a decompression bomb)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageError(f"the image is damaged or truncated ({exc})") from None
