"""The chat page's HTML (server/static/chat.html), read once while the app is built, before serving: the HTTP
layer (server/api) itself touches no file."""

from __future__ import annotations

from importlib.resources import files


def chat_page_html() -> bytes:
    return files("server").joinpath("static", "chat.html").read_bytes()
