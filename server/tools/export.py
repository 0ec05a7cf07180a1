"""`python -m server export`: a transformers checkpoint directory or a `.gguf` file -> an artifact dir for `--graph hf`.

Writes cfg/ (config, generation config, tokenizer, chat template), embed_tokens.pt, hf/ and graph.json.
Reading a GGUF through transformers takes ~40-55 s and `save_pretrained` refuses a GGUF-loaded model,
so we build a fresh model from its config, give it the state dict, and save that: it reloads in ~0.1 s.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from server.graphs.base import DTYPES
from server.model.artifacts import CFG_DIR, GRAPH_JSON, HF_DIR, GraphSpec

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


def _add_turn_end_eos(generation: object, tokenizer: object) -> None:
    """Chat turns end with <end_of_turn>: make it an eos id, as Gemma's instruction-tuned configs do."""
    turn_end = tokenizer.get_vocab().get("<end_of_turn>")  # type: ignore[attr-defined]
    if turn_end is None:
        return
    eos = getattr(generation, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
    if turn_end not in ids:
        generation.eos_token_id = [*ids, turn_end]  # type: ignore[attr-defined]


def export(source: Path | str, dest: Path | str, *, prefill_bucket: int = 128, max_total: int = 512,
           dtype: str = "float32") -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    source, dest = Path(source), Path(dest)
    torch_dtype = DTYPES[dtype]
    spec = GraphSpec(max_total=max_total, prefill_bucket=prefill_bucket, input_dtype=dtype,
                     softcap_in_graph=True, graph_file=None, tp=1)  # validates the numbers
    GraphSpec.from_json(spec.to_json())

    if source.is_file() and source.suffix == ".gguf":
        log.info("reading GGUF %s (slow, once)", source)
        loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # A fresh model from the same config saves where the GGUF-loaded one refuses to.
        config = AutoConfig.for_model(**loaded.config.to_dict())
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.load_state_dict(loaded.state_dict(), strict=False)
        model.tie_weights()
        model.generation_config = loaded.generation_config
        del loaded
    elif source.is_dir():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        raise FileNotFoundError(f"{source}: expected a transformers checkpoint directory or a .gguf file")
    model.eval()

    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    cfg, hf = staging / CFG_DIR, staging / HF_DIR
    cfg.mkdir(parents=True)
    model.save_pretrained(hf)
    model.config.save_pretrained(cfg)
    generation = model.generation_config if model.generation_config is not None else GenerationConfig()
    _add_turn_end_eos(generation, tokenizer)
    generation.save_pretrained(cfg)
    tokenizer.save_pretrained(cfg)
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) and "<start_of_turn>" in tokenizer.get_vocab():
        template = GEMMA_CHAT_TEMPLATE  # GGUF exports of Gemma often carry no template; the turn tokens are there
    if isinstance(template, str) and not (cfg / "chat_template.jinja").is_file():
        (cfg / "chat_template.jinja").write_text(template, encoding="utf-8")
    table = model.get_input_embeddings().weight.detach().to(torch_dtype).contiguous()  # [V, H]
    torch.save(table.clone(), staging / "embed_tokens.pt")
    (staging / GRAPH_JSON).write_text(json.dumps(spec.to_json(), indent=2) + "\n", encoding="utf-8")

    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)  # atomic: a half-written export never looks complete
    log.info("exported %s -> %s", source, dest)
    return dest
