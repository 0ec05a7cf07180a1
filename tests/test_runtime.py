"""The host's loaders."""

from __future__ import annotations

from server.runtime import release_freed_memory


def test_release_freed_memory_is_safe_to_call() -> None:
    release_freed_memory()
    release_freed_memory()
