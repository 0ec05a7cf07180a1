"""The chat page's HTML (static/chat.html beside this file), read once at start-up and handed to the app: the HTTP
layer (server/api) itself touches no file."""

from __future__ import annotations

from importlib.resources import files


def chat_page_html() -> bytes:
    return files(__package__).joinpath("static", "chat.html").read_bytes()
