"""`python -m server export`: a transformers checkpoint directory or a `.gguf` file -> an artifact dir for `--graph hf`.

Writes cfg/ (config, generation config, tokenizer, chat template, and the image processor's settings when the model
reads images: preprocessor_config.json, or processor_config.json, which is all transformers 5 saves), embed_tokens.pt,
hf/ and graph.json; with `vision="host"` also vision.safetensors (the vision tower and its projection, what
`serve --vision host` runs on the CPU).
Reading a GGUF through transformers takes ~15 s (SmolLM2 135M) to ~35 s (Gemma-3 270M, whose 262k-token vocabulary
the GGUF reader parses slowly: once here, not three times, see `_one_gguf_parse`) and `save_pretrained` refuses a
GGUF-loaded model, so we build a fresh model from its config, give it the state dict, and save that: it reloads in
~0.1 s. Each step logs what it does and how far along it is (transformers draws bars for the weights only).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from server.graphs.base import DTYPES
from server.model.artifacts import (
    CFG_DIR,
    GRAPH_JSON,
    HF_DIR,
    IMAGE_PROCESSOR_FILES,
    VISION_FILE,
    GraphSpec,
    image_processor_file,
)

log = logging.getLogger(__name__)


# Gemma's turn format (system text folds into the first user turn, as Gemma's own templates do).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' }}"
    "{%- if message['role'] == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


# The tokens that end a model's chat turn, by family: Gemma's, ChatML's (SmolLM2, Qwen), Llama-3's.
_TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>")
_HEARTBEAT_S = 10.0


def _add_turn_end_eos(generation: object, tokenizer: object, template: str | None) -> None:
    """A chat turn ends with the template's turn-end token: make it an eos id, as instruction-tuned configs do (a
    GGUF's generation config often lists only the tokenizer's eos, and then `<end_of_turn>` would not stop)."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    eos = getattr(generation, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    added = [token for text in _TURN_ENDS if (token := vocab.get(text)) is not None and token not in ids
             and (template is None or text in template)]
    if added:
        generation.eos_token_id = [*ids, *added]  # type: ignore[attr-defined]


def _vision_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module] | None:
    """The modules transformers' Gemma-4 runs on an image (`get_image_features`): the tower, then `embed_vision`'s
    projection into the language model's width. None for a model that reads no images."""
    inner = getattr(model, "model", None)
    tower, embed = getattr(inner, "vision_tower", None), getattr(inner, "embed_vision", None)
    return None if tower is None or embed is None else {"vision_tower": tower, "embed_vision": embed}


def _save_vision(modules: Mapping[str, torch.nn.Module], path: Path, dtype: torch.dtype) -> None:
    """One safetensors file, keys `vision_tower.*` and `embed_vision.*` (the modules' own state dicts, buffers
    included): what server.vision.host loads into the same transformers modules."""
    from safetensors.torch import save_file

    tensors = {f"{prefix}.{key}": value.detach().to(dtype if value.is_floating_point() else value.dtype).contiguous()
               for prefix, module in modules.items() for key, value in module.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """One parse of the GGUF for the whole export: transformers reads the file anew for the config, the weights and the
    tokenizer, and parsing the metadata of Gemma's 262k-token vocabulary costs ~13 s each time on two cores (two
    thirds of the demo's first start). The reader is a read-only memory map, so sharing it changes nothing read."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = shared  # type: ignore[misc, assignment]  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
        readers.clear()


@contextmanager
def logged_step(number: int, total: int, what: str, every_s: float = _HEARTBEAT_S) -> Iterator[None]:
    """Log a step of the export as it starts and ends, and every 10 s between: some steps take half a minute on two
    cores without a word from transformers, and a silent start looks like a hung one."""
    log.info("export %d/%d: %s ...", number, total, what)
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(every_s):
            log.info("export %d/%d: still %s (%.0f s)", number, total, what, time.monotonic() - start)

    ticker = threading.Thread(target=heartbeat, name="export-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log.info("export %d/%d: %s: done in %.1f s", number, total, what, time.monotonic() - start)


def export(source: Path | str, dest: Path | str, *, prefill_bucket: int = 128, max_total: int = 512,
           dtype: str = "float32", sampling: Mapping[str, Any] | None = None, vision: str = "off") -> Path:
    """`sampling`: generation-config fields to write (e.g. a model card's recommended temperature), which the server
    takes as defaults for requests that leave them unset; a GGUF carries none. `vision`: "host" also writes the
    vision tower's weights (a model without one is refused), "off" leaves them out (the text-only export)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source, dest = Path(source), Path(dest)
    torch_dtype = DTYPES[dtype]
    spec = GraphSpec(max_total=max_total, prefill_bucket=prefill_bucket, input_dtype=dtype,
                     softcap_in_graph=True, graph_file=None, tp=1)  # validates the numbers
    GraphSpec.from_json(spec.to_json())

    if vision == "host" and source.is_dir() and image_processor_file(source) is None:  # serve would refuse it
        raise ValueError(f"{source}: --vision host needs the image processor's settings beside the checkpoint: "
                         f"{' or '.join(IMAGE_PROCESSOR_FILES)} (with an image_processor entry), as "
                         "Gemma4Processor.save_pretrained (or the image processor's own) writes them; found neither")
    if source.is_file() and source.suffix == ".gguf":
        with _one_gguf_parse():
            with logged_step(1, 4, f"reading the weights of {source.name}"):
                loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch_dtype)
                # A fresh model from the same config saves where the GGUF-loaded one refuses to. Without the GGUF's
                # quantization entry: the checkpoint we save holds plain float weights, and says so.
                values = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
                model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values), dtype=torch_dtype)
                model.load_state_dict(loaded.state_dict(), strict=False)
                model.tie_weights()
                model.generation_config = loaded.generation_config
                del loaded
            with logged_step(2, 4, "reading the tokenizer from the GGUF"):
                tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    elif source.is_dir():
        with logged_step(1, 4, f"reading the checkpoint {source}"):
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        with logged_step(2, 4, "reading the tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        raise FileNotFoundError(f"{source}: expected a transformers checkpoint directory or a .gguf file")
    model.eval()
    if vision not in ("off", "host"):
        raise ValueError(f"vision must be 'off' or 'host', got {vision!r}")
    towers = _vision_modules(model)
    if vision == "host" and towers is None:
        raise ValueError(f"{source}: --vision host needs a model with a vision tower (vision_tower + embed_vision); "
                         "this one has none")

    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    cfg, hf = staging / CFG_DIR, staging / HF_DIR
    cfg.mkdir(parents=True)
    with logged_step(3, 4, f"writing the checkpoint {HF_DIR}/"):
        model.save_pretrained(hf)
    with logged_step(4, 4, f"writing {CFG_DIR}/ (config, generation config, tokenizer, chat template) and the embedding table"):
        model.config.save_pretrained(cfg)
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) and "<start_of_turn>" in tokenizer.get_vocab():
            template = GEMMA_CHAT_TEMPLATE  # GGUF exports of Gemma often carry no template; the turn tokens are there
        generation = model.generation_config if model.generation_config is not None else GenerationConfig()
        _add_turn_end_eos(generation, tokenizer, template if isinstance(template, str) else None)
        for key, value in (sampling or {}).items():
            setattr(generation, key, value)
        generation.save_pretrained(cfg)
        tokenizer.save_pretrained(cfg)
        if isinstance(template, str) and not (cfg / "chat_template.jinja").is_file():
            (cfg / "chat_template.jinja").write_text(template, encoding="utf-8")
        table = model.get_input_embeddings().weight.detach().to(torch_dtype).contiguous()  # [V, H]
        torch.save(table.clone(), staging / "embed_tokens.pt")
        for name in IMAGE_PROCESSOR_FILES if towers is not None and source.is_dir() else ():
            if (source / name).is_file():  # the image processor's settings, for the host (either file, as saved)
                shutil.copyfile(source / name, cfg / name)
        if vision == "host" and towers is not None:
            _save_vision(towers, staging / VISION_FILE, torch_dtype)
        (staging / GRAPH_JSON).write_text(json.dumps(spec.to_json(), indent=2) + "\n", encoding="utf-8")

    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)  # atomic: a half-written export never looks complete
    log.info("exported %s -> %s", source, dest)
    return dest
