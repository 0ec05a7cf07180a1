"""`ModelStructure`: what the host needs to know about the model, read from `cfg/` without a single weight.

The model is instantiated on the meta device (`accelerate.init_empty_weights()`, zero bytes of parameters)
so that facts like the embedding scale come from the model's own modules, not from a formula typed by hand:
a hand-typed `sqrt(hidden)` is exactly the kind of thing that silently goes wrong for the next model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from server.cache import AtomicFile

log = logging.getLogger(__name__)

# Bump when the fields or their derivation change: older cache entries are then ignored, never half-read.
_CACHE_SCHEMA = "1"


@dataclass(frozen=True, slots=True)
class ModelStructure:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    final_softcap: float | None
    embed_scale: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int | None
    # Sampling defaults of generation_config.json (temperature, top_k, top_p, ...), for unset request fields.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, cfg_dir: Path | str, cache_dir: Path | None = None) -> ModelStructure:
        """Derived through the meta-device model (`derive`), or read back from `cache_dir` where an earlier start
        derived it from byte-identical config files with the same transformers version.

        Why a cache: importing transformers and building the meta model is most of a server's start-up (~4 s of
        ~8), while the answer only changes when the config files or transformers do, and both are in the key.
        """
        cfg_dir = Path(cfg_dir)
        path = None if cache_dir is None else cache_dir / "structure" / f"{_cache_key(cfg_dir)}.json"
        if path is not None and path.is_file():
            try:
                return cls.from_json(path.read_text(encoding="utf-8"))
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("ignoring the unreadable structure cache %s: %s", path, exc)
        structure = cls.derive(cfg_dir)
        if path is not None:
            _write_atomically(path, structure.to_json())
        return structure

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelStructure:
        data = json.loads(text)
        data["layer_types"] = tuple(data["layer_types"])
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        return cls(**data)

    @classmethod
    def derive(cls, cfg_dir: Path | str) -> ModelStructure:
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg_dir = Path(cfg_dir)
        config = AutoConfig.from_pretrained(cfg_dir)
        text = config.get_text_config()
        if getattr(text, "hidden_size_per_layer_input", 0):
            # Per-layer embeddings (Gemma-4 E2B/E4B) need input ids inside the graph; the contract passes embeddings.
            raise ValueError(
                f"{cfg_dir}/config.json: per-layer input embeddings (hidden_size_per_layer_input="
                f"{text.hidden_size_per_layer_input}) are not supported by the embeddings-in graph contract"
            )
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(text)
        embedding = model.get_input_embeddings()
        scale = getattr(embedding, "scalar_embed_scale", None)
        if scale is None:
            buffer = getattr(embedding, "embed_scale", None)
            scale = float(buffer) if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta" else 1.0
        layer_types = tuple(getattr(text, "layer_types", None) or ("full_attention",) * text.num_hidden_layers)

        generation = _read_json(cfg_dir / "generation_config.json")
        eos = generation.get("eos_token_id", getattr(text, "eos_token_id", None))
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        defaults = {k: generation[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                    if generation.get(k) is not None}
        if generation.get("do_sample") is False:
            defaults["temperature"] = 0.0  # the model's authors ask for greedy decoding

        return cls(
            model_type=text.model_type,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            num_layers=int(text.num_hidden_layers),
            layer_types=layer_types,
            sliding_window=getattr(text, "sliding_window", None),
            final_softcap=getattr(text, "final_logit_softcapping", None),
            embed_scale=float(scale),
            eos_token_ids=eos_ids,
            bos_token_id=generation.get("bos_token_id", getattr(text, "bos_token_id", None)),
            pad_token_id=generation.get("pad_token_id", getattr(text, "pad_token_id", None)),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            generation_defaults=defaults,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _cache_key(cfg_dir: Path) -> str:
    """The config files' bytes and the transformers version that would derive the structure from them."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256(_CACHE_SCHEMA.encode())
    try:
        digest.update(version("transformers").encode())
    except PackageNotFoundError:
        digest.update(b"no transformers")
    for name in ("config.json", "generation_config.json"):
        path = cfg_dir / name
        digest.update(b"\0" + name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b""))
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """A cache is an optimisation: a read-only or full disk costs the next start time, never this one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with AtomicFile(path.parent, f".{path.name}.") as out:
            out.write(text.encode("utf-8"))
            out.commit(path)
    except OSError as exc:
        log.warning("could not cache the model structure in %s: %s", path.parent, exc)
