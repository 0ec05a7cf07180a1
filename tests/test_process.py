"""Process-wide start-up policy."""

from __future__ import annotations

from server.app.process import release_freed_memory


def test_release_freed_memory_is_safe_to_call() -> None:
    release_freed_memory()
    release_freed_memory()
