"""`server.tools.fetch` against a local stand-in of the Hub: allow-list, resume, disk check, verification, errors.

The happy path and the unreachable-Hub case run the real CLI (`python -m server fetch`) in a subprocess with
`HF_ENDPOINT`/`HF_HOME` set, as the container does: huggingface_hub reads its environment at import. The rest
call `fetch()` in-process with `endpoint=`, which needs no environment, and is faster.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.model.artifacts import validate
from server.tools.fetch import EXIT_CORRUPT, EXIT_DISK, EXIT_HUB, EXIT_INVALID, HEADROOM_BYTES, check_disk_space, fetch
from tests.support.hub_standin import COMMIT, HubStandIn, make_tiny_repo

REPO = "acme/tiny-artifacts"
ROOT = Path(__file__).resolve().parents[1]
WANTED = {"cfg/config.json", "cfg/tokenizer.json", "cfg/generation_config.json", "embed_tokens.pt", "graph.json",
          "model.pt"}
UNWANTED = {"hf/config.json", "hf/model.safetensors", "README.md", ".gitattributes"}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_repo(tmp_path_factory.mktemp("hub") / "repo")


@pytest.fixture
def hub(repo_dir: Path) -> Iterator[HubStandIn]:
    with HubStandIn(REPO, repo_dir) as standin:
        yield standin


def _env(hub_url: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=str(ROOT))
    return env


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server", "fetch", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts}


def test_cli_fetch_takes_only_the_allow_list_pins_the_commit_and_validates(
    hub: HubStandIn, repo_dir: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "data"
    result = _cli(["--repo", REPO, "--dest", str(dest)], _env(hub.url, tmp_path))
    assert result.returncode == 0, result.stderr

    assert _files(dest) == WANTED
    for name in WANTED:
        assert (dest / name).read_bytes() == (repo_dir / name).read_bytes(), name
    validate(dest, "jit")
    resolved = [r.path for r in hub.requests if "/resolve/" in r.path]
    assert resolved and all(f"/resolve/{COMMIT}/" in p for p in resolved), "every file must come from one commit"
    assert not any(r.path.endswith(tuple(UNWANTED)) for r in hub.requests if "/resolve/" in r.path)
    assert "complete for --graph auto" in result.stderr


def test_cli_fetch_unreachable_hub_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result = _cli(["--repo", REPO, "--dest", str(tmp_path / "data")], _env(dead, tmp_path))
    assert result.returncode == EXIT_HUB
    assert "cannot list acme/tiny-artifacts@main on the Hub" in result.stderr
    assert "Traceback" not in result.stderr


def test_interrupted_transfer_resumes_with_a_range_request(hub: HubStandIn, repo_dir: Path, tmp_path: Path) -> None:
    hub.truncate_once.add("model.pt")
    dest = tmp_path / "data"
    assert fetch(REPO, dest, endpoint=hub.url) == 0
    gets = hub.gets("model.pt")
    assert len(gets) == 2, gets
    size = (repo_dir / "model.pt").stat().st_size
    assert gets[0].range is None
    assert gets[1].range is not None and gets[1].range.startswith("bytes=")
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < size, "the second request must continue the first, not start over"
    assert (dest / "model.pt").read_bytes() == (repo_dir / "model.pt").read_bytes()


def test_second_fetch_downloads_nothing_and_clears_orphaned_partials(hub: HubStandIn, tmp_path: Path) -> None:
    dest = tmp_path / "data"
    assert fetch(REPO, dest, endpoint=hub.url) == 0
    # What a killed container leaves: a uniquely named partial huggingface_hub will never reuse.
    orphan = dest / ".cache" / "huggingface" / "download" / "abc123.deadbeef.0a1b2c3d.incomplete"
    orphan.write_bytes(b"x" * 4096)
    hub.requests.clear()
    assert fetch(REPO, dest, endpoint=hub.url) == 0
    assert not [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert not orphan.exists()


def test_disk_space_refusal_names_needed_and_free_bytes(
    hub: HubStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dest = tmp_path / "data"
    with caplog.at_level(logging.ERROR, logger="server.tools.fetch"):
        code = fetch(REPO, dest, endpoint=hub.url, free_bytes=lambda _: 12345)
    assert code == EXIT_DISK
    message = caplog.text
    assert "not enough disk space" in message and "12345 bytes" in message
    needed = sum(len(hub.files[n].data) for n in WANTED)
    assert f"need {needed} bytes" in message
    assert not [r for r in hub.requests if "/resolve/" in r.path], "nothing may be downloaded after a refusal"
    assert _files(dest) == set()


def test_disk_check_counts_only_what_is_still_missing(hub: HubStandIn, repo_dir: Path, tmp_path: Path) -> None:
    from server.tools.fetch import list_remote_files

    commit, files = list_remote_files(REPO, revision=None, token=None, endpoint=hub.url)
    assert commit == COMMIT and {f.path for f in files} == WANTED
    dest = tmp_path / "data"
    for name in WANTED - {"model.pt"}:  # all complete but the graph, of which a stale half-copy lies there
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes((repo_dir / name).read_bytes())
    model = (repo_dir / "model.pt").read_bytes()
    (dest / "model.pt").write_bytes(model[:1000])
    missing = len(model) - 1000
    assert check_disk_space(dest, files, lambda _: missing + HEADROOM_BYTES) == missing
    with pytest.raises(Exception, match=f"need {missing} bytes"):
        check_disk_space(dest, files, lambda _: missing + HEADROOM_BYTES - 1)


def test_hash_mismatch_is_reported_the_file_removed_and_a_rerun_heals(
    hub: HubStandIn, repo_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = (repo_dir / "model.pt").read_bytes()
    graph_json = (repo_dir / "graph.json").read_bytes()
    hub.corrupt["model.pt"] = bytes([model[0] ^ 0xFF]) + model[1:]  # same size: only the hash can tell
    hub.corrupt["graph.json"] = graph_json.replace(b"64", b"65")  # a small non-LFS file: git blob id
    dest = tmp_path / "data"
    with caplog.at_level(logging.ERROR, logger="server.tools.fetch"):
        assert fetch(REPO, dest, endpoint=hub.url) == EXIT_CORRUPT
    assert f"model.pt: sha256 {__import__('hashlib').sha256(hub.corrupt['model.pt']).hexdigest()}" in caplog.text
    assert f"the Hub says {hub.files['model.pt'].sha256}" in caplog.text
    assert "graph.json: git-sha1" in caplog.text
    assert not (dest / "model.pt").exists() and not (dest / "graph.json").exists()

    hub.corrupt.clear()
    assert fetch(REPO, dest, endpoint=hub.url) == 0
    assert (dest / "model.pt").read_bytes() == model


def test_pinned_revision_and_unknown_revision(
    hub: HubStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert fetch(REPO, tmp_path / "pinned", revision=COMMIT, endpoint=hub.url) == 0
    assert any(f"/revision/{COMMIT}" in r.path for r in hub.requests)
    with caplog.at_level(logging.ERROR, logger="server.tools.fetch"):
        assert fetch(REPO, tmp_path / "nope", revision="no-such-branch", endpoint=hub.url) == EXIT_HUB
    assert "no-such-branch" in caplog.text and "RevisionNotFound" in caplog.text


def test_downloaded_but_not_usable_for_the_graph(
    hub: HubStandIn, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="server.tools.fetch"):
        assert fetch(REPO, tmp_path / "data", graph="hf", endpoint=hub.url) == EXIT_INVALID
    assert "hf/config.json: missing" in caplog.text  # the allow-list never takes hf/: say so, do not crash
