"""`python -m server fetch`: download a Hub repo's artifacts into a directory, safely.

In order, each step ending the run with a clear message (never a traceback) when it fails:

1. ask the Hub for the file list with sizes and hashes (`model_info(files_metadata=True)`) and resolve the
   revision to one commit, so the sizes checked, the files downloaded and the hashes verified are of the same commit;
2. keep the files `artifacts.ALLOW_PATTERNS` selects (never the 50 GB `hf/` checkpoint the server does not read);
3. refuse to start when the disk cannot hold what is still missing: better now than at 95 % of a 25 GB file;
4. `huggingface_hub.snapshot_download` into the directory: its own progress bars; an interrupted transfer
   resumes with an HTTP Range request (within the run); files already complete are not fetched again;
5. verify every file against the Hub: sizes for all, sha256 for LFS files, the git blob id for small files;
6. `artifacts.validate(dest, graph)`: the directory must be usable by the selected graph.

Exit codes (the container entrypoint passes them on): 0 ok, 1 Hub or network error, 3 not enough disk space,
4 a downloaded file does not match the Hub (removed, so a re-run fetches it again), 5 downloaded but not usable.

huggingface_hub is imported lazily so `python -m server --help` and `check` stay fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.errors import ArtifactError
from server.model.artifacts import ALLOW_PATTERNS, validate

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_HUB = 1
EXIT_DISK = 3
EXIT_CORRUPT = 4
EXIT_INVALID = 5

# Left free on top of the download: a disk filled to the last byte breaks the server's logs and the
# Neuron runtime's scratch files long after the download itself succeeded.
HEADROOM_BYTES = 256 * 1024 * 1024
# Our own bookkeeping beside huggingface_hub's `.cache/huggingface/` in the destination.
STATE_DIR = Path(".cache") / "gemma4-optb"
HF_STATE_DIR = Path(".cache") / "huggingface"

FreeBytes = Callable[[Path], int]


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of the repo at the resolved commit, as the Hub describes it."""

    path: str
    size: int | None
    sha256: str | None  # LFS files: the content's sha256
    blob_id: str | None  # small (non-LFS) files: the git blob sha1 of the content


class FetchError(Exception):
    """A step failed; `code` is the process exit code, the message says what and what to do."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def fetch(repo: str, dest: Path | str, *, revision: str | None = None, token: str | None = None, graph: str = "auto",
          endpoint: str | None = None, free_bytes: FreeBytes | None = None) -> int:
    """Download `repo` (at `revision`, default the main branch) into `dest`, verify, validate; return an exit code.

    `endpoint` overrides `HF_ENDPOINT`; `free_bytes(dest)` replaces the disk-space probe (both for tests).
    """
    dest = Path(dest)
    try:
        (dest / STATE_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("fetch: cannot create %s: %s", dest, exc)
        return EXIT_HUB

    from filelock import FileLock, Timeout  # a dependency of huggingface_hub

    # huggingface_hub's HTTP client logs every request at INFO: hundreds of lines that bury the progress bars
    # and our own messages in the container log. Warnings and errors still show.
    for noisy in ("httpx", "httpx2", "httpcore"):
        if logging.getLogger(noisy).level == logging.NOTSET:  # unless someone configured it on purpose
            logging.getLogger(noisy).setLevel(logging.WARNING)

    # One fetch per directory: two would fight over the same temporary files, and the lock lets
    # `_remove_orphans` know that every partial download it finds belongs to a process that died.
    lock = FileLock(str(dest / STATE_DIR / "fetch.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.error("fetch: another fetch is already writing into %s; wait for it to finish", dest)
        return EXIT_HUB
    try:
        _fetch_locked(repo, dest, revision=revision, token=token, graph=graph, endpoint=endpoint,
                      free_bytes=free_bytes or _disk_free)
    except FetchError as exc:
        log.error("fetch: %s", exc)
        return exc.code
    except Exception as exc:  # noqa: BLE001 - e.g. a permission error while verifying: a message, not a traceback
        log.error("fetch: failed: %s", _reason(exc))
        return EXIT_HUB
    finally:
        lock.release()
    return EXIT_OK


def _fetch_locked(repo: str, dest: Path, *, revision: str | None, token: str | None, graph: str, endpoint: str | None,
                  free_bytes: FreeBytes) -> None:
    commit, files = list_remote_files(repo, revision=revision, token=token, endpoint=endpoint)
    where = f"{repo}@{commit[:12]}" if commit else repo
    if not files:
        raise FetchError(EXIT_HUB, f"{where} has no file matching {', '.join(ALLOW_PATTERNS)}: is it an artifact repo?")

    reclaimed = _remove_orphans(dest)
    if reclaimed:
        log.info("fetch: removed %s of partial downloads left by an interrupted fetch", _human(reclaimed))
    check_disk_space(dest, files, free_bytes)

    total = sum(f.size or 0 for f in files)
    log.info("fetch: %d files (%s) of %s into %s", len(files), _human(total), where, dest)
    _download(repo, dest, commit=commit or revision, token=token, endpoint=endpoint)

    bad = verify(dest, files)
    if bad:
        raise FetchError(EXIT_CORRUPT, "downloaded files do not match the Hub (removed, so the next fetch downloads them "
                                       "again):\n  - " + "\n  - ".join(bad))
    try:
        validate(dest, graph)
    except ArtifactError as exc:
        raise FetchError(EXIT_INVALID, f"downloaded {where}, but: {exc}") from None
    log.info("fetch: %s complete for --graph %s (%s, verified)", dest, graph, where)


def list_remote_files(repo: str, *, revision: str | None, token: str | None,
                      endpoint: str | None) -> tuple[str | None, list[RemoteFile]]:
    """The commit `revision` resolves to, and the allow-listed files there with their sizes and hashes."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    try:
        info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True, token=token)
    except Exception as exc:  # noqa: BLE001 - every failure here is "the Hub said no / is unreachable"
        raise FetchError(EXIT_HUB, f"cannot list {repo}@{revision or 'main'} on the Hub: {_reason(exc)}") from None
    siblings = filter_repo_objects(info.siblings or [], allow_patterns=list(ALLOW_PATTERNS), key=lambda s: s.rfilename)
    files = [RemoteFile(s.rfilename, size=s.size, sha256=None, blob_id=s.blob_id) if s.lfs is None else
             RemoteFile(s.rfilename, size=s.lfs.size, sha256=s.lfs.sha256, blob_id=None) for s in siblings]
    return info.sha, sorted(files, key=lambda f: f.path)


def check_disk_space(dest: Path, files: Iterable[RemoteFile], free_bytes: FreeBytes | None = None) -> int:
    """Raise `FetchError(EXIT_DISK)` unless `dest` can hold the files still missing; return the bytes needed.

    A local file of the right size counts as done (its content is verified after the download). A local file
    of another size is deleted by huggingface_hub before it downloads the new one, so only the growth counts.
    """
    growth = []  # bytes still to come, one entry per file to download
    for remote in files:
        local = dest / remote.path
        have = local.stat().st_size if local.is_file() else None
        if remote.size is not None and have != remote.size:
            growth.append(max(0, remote.size - (have or 0)))
    pending, needed = len(growth), sum(growth)
    if pending == 0:
        return 0
    free = (free_bytes or _disk_free)(dest)
    if needed + HEADROOM_BYTES > free:
        raise FetchError(EXIT_DISK, f"not enough disk space in {dest}: {pending} files still to download need {needed} "
                         f"bytes ({_human(needed)}) + {_human(HEADROOM_BYTES)} headroom, but only {free} bytes "
                         f"({_human(free)}) are free. Free some space or mount a larger volume at the artifact "
                         "directory, then run again (files already complete are kept).")
    return needed


def _download(repo: str, dest: Path, *, commit: str | None, token: str | None, endpoint: str | None) -> None:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo, revision=commit, local_dir=dest, allow_patterns=list(ALLOW_PATTERNS), token=token,
                          endpoint=endpoint)
    except Exception as exc:  # noqa: BLE001 - network and Hub errors of any kind: a message, not a traceback
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:  # something else filled the disk meanwhile
            raise FetchError(EXIT_DISK, f"the disk holding {dest} filled up during the download: {exc}") from None
        raise FetchError(EXIT_HUB, f"download of {repo} failed: {_reason(exc)}. Run again to continue.") from None


def verify(dest: Path, files: Iterable[RemoteFile]) -> list[str]:
    """Compare local files with the Hub's sizes and hashes; delete and name the ones that differ.

    Hashes of files that passed are remembered (by size and mtime) in `.cache/gemma4-optb/verified.json`,
    so a second fetch into a complete directory does not re-read 25 GB.
    """
    record_path = dest / STATE_DIR / "verified.json"
    try:
        record: dict[str, Any] = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    problems: list[str] = []
    for remote in files:
        local = dest / remote.path
        if not local.is_file():
            problems.append(f"{remote.path}: missing after the download")
            continue
        stat = local.stat()
        if remote.size is not None and stat.st_size != remote.size:
            problems.append(f"{remote.path}: size {stat.st_size} bytes, the Hub says {remote.size}")
            _discard(dest, remote.path, record)
            continue
        expected, algorithm = (remote.sha256, "sha256") if remote.sha256 else (remote.blob_id, "git-sha1")
        if not expected:
            continue
        known = record.get(remote.path)
        if known == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "digest": expected}:
            continue
        # Only big files are worth a line: hashing 25 GB takes minutes, and the user should know why it is quiet.
        log.log(logging.INFO if stat.st_size >= 64 << 20 else logging.DEBUG, "fetch: verifying %s (%s, %s)",
                remote.path, _human(stat.st_size), algorithm)
        actual = _digest(local, algorithm)
        if actual != expected:
            problems.append(f"{remote.path}: {algorithm} {actual}, the Hub says {expected}")
            _discard(dest, remote.path, record)
            continue
        record[remote.path] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "digest": expected}
    try:
        record_path.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
    except OSError as exc:  # only a cache: the next fetch hashes again
        log.warning("fetch: cannot record verified hashes in %s: %s", record_path, exc)
    return problems


def _discard(dest: Path, path: str, record: dict[str, Any]) -> None:
    # huggingface_hub trusts its own `.metadata` file over the content, so a corrupt file would be kept
    # forever; deleting the file makes the next snapshot_download fetch it again.
    record.pop(path, None)
    (dest / path).unlink(missing_ok=True)
    (dest / HF_STATE_DIR / "download" / f"{path}.metadata").unlink(missing_ok=True)


def _remove_orphans(dest: Path) -> int:
    """Delete partial downloads of dead fetches; return the bytes freed.

    huggingface_hub writes each file to a uniquely named `*.incomplete` under `.cache/huggingface/download/`,
    resumes it only within the same process, and deletes it on a clean failure. A killed container leaves it
    behind, never to be reused: tens of GB the disk check would otherwise count as used. We hold the fetch
    lock, so no live fetch owns one.
    """
    freed = 0
    for orphan in (dest / HF_STATE_DIR / "download").rglob("*.incomplete"):  # none when the directory is missing
        try:
            size = orphan.stat().st_size
            orphan.unlink()
            freed += size
        except OSError:
            continue
    return freed


def _digest(path: Path, algorithm: str) -> str:
    """The content's sha256, or its git object id ("git-sha1": what the Hub reports as `blobId` for files not in LFS).
    hashlib streams the file: a 25 GB graph never sits in a 16 GB host's RAM."""
    with path.open("rb") as handle:
        if algorithm == "sha256":
            return hashlib.file_digest(handle, "sha256").hexdigest()
        header = f"blob {path.stat().st_size}\0".encode()
        return hashlib.file_digest(handle, lambda: hashlib.sha1(header)).hexdigest()  # noqa: S324 - git's id


def _disk_free(dest: Path) -> int:
    return shutil.disk_usage(dest).free


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"


def _reason(exc: BaseException) -> str:
    """One line for the user: the exception's kind and message (the traceback only at debug level)."""
    log.debug("fetch: details", exc_info=exc)
    text = " ".join(str(exc).split())  # huggingface_hub's messages span lines: the useful part is often not the first
    if len(text) > 400:
        text = text[:400] + "..."
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
