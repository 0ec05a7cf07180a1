"""`AtomicFile`: how the start-up caches under `--cache-dir` write their entries (model structure, tokenizer copy, the
grammar vocabulary's token table), from any layer: it is plain file work, below every package.

Several servers may start at once on one cache and any of them may die mid-write, so an entry is written under a
temporary name beside its destination and renamed onto it once whole: readers see no file or the whole file.
The temporary names end in `.partial`, so a cache can recognise (and clear) what a dead start left behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from types import TracebackType


class AtomicFile:
    """A binary file being written in `directory`; `commit(destination)` publishes it, leaving the block without
    a commit (or with an exception) deletes it."""

    def __init__(self, directory: Path, prefix: str) -> None:
        fd, self._partial = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".partial")
        self._file = os.fdopen(fd, "wb")
        self._committed = False

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def commit(self, destination: Path) -> None:
        with contextlib.suppress(OSError):  # mkstemp's 0600 would hide the entry from other users of the cache
            os.fchmod(self._file.fileno(), 0o644)
        self._file.close()
        os.replace(self._partial, destination)
        self._committed = True

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if not self._committed:
            self._file.close()
            with contextlib.suppress(OSError):
                os.unlink(self._partial)
