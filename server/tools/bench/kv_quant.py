"""int8 KV on real weights: `python -m server bench kv-quant` (issue 34).

The recipe's `--kv-quant int8` stores K and V as int8 with one f32 scale per (slot, head, position) and attends over
what it reads back. This measures what that costs a real model: each demo model (Gemma-3 270M: sliding and global
layers; SmolLM2-135M) reads the same English text twice through transformers, once with its plain cache and once
with a cache that round-trips every K and V it stores through the recipe's own quantizer (server/graphs/kv_quant.py,
the same function SlotRingCache.update calls), and at every position we compare the next-token distributions: mean
KL(p_ref || p_int8) in nats and top-1 agreement.

Why a Cache subclass: transformers' attention layers (both kinds: a sliding layer's window cache and a global
layer's full one) call `past_key_values.update(k, v, layer_idx)` and attend over what it returns, so quantizing in
`update` is exactly "attention reads the stored int8 K/V", for the chunk's own tokens too, as the recipe's prefill
does (it writes the chunk into the slot, then attends over the slot). The text is prefilled in chunks so later
chunks read earlier ones from the stored cache, and `layers` limits which layers quantize (the test proves each
layer kind is really affected). The text: Python's own `pydoc_data/topics.py` (offline, always installed).

Thresholds (issue 34): int8 KV is a default only where top-1 agreement >= 99% and mean KL <= 0.01 nats.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from server.graphs.kv_quant import round_trip

TOP1_MIN = 0.99  # the bar for making int8 KV a default
KL_MAX = 0.01  # nats, mean over positions
# Whether int8 KV is the long-context default: only where it holds on both models (docs/contract-v3.md says why it
# is not); tests/test_kv_quant.py holds this to the measurement, so a quantizer that comes to hold says so.
LONG_CONTEXT_DEFAULT = False
DEFAULT_TOKENS = 8192  # SmolLM2-135M's whole context (max_position_embeddings 8192); Gemma-3 270M holds 32k


def english_text() -> str:
    """Python's own help topics (pydoc_data/topics.py): ~700 kB of English prose and examples, present offline."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def bf16_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The builds' unquantized KV (bf16 states): the noise floor a stored-narrower cache is judged beside."""
    return x.to(torch.bfloat16).to(x.dtype)


def stored_kv_cache(config: Any, store: Callable[[torch.Tensor], torch.Tensor] = round_trip,
                    layers: Collection[int] | None = None) -> Any:
    """A transformers DynamicCache whose K/V go through `store` (default: int8 as the recipe stores them) before
    attention reads them, in all layers or `layers`; `.calls` counts the updates per layer, so a caller can check
    that every layer read its cache."""
    from transformers import DynamicCache

    class StoredKVCache(DynamicCache):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(config=config)
            self.calls: Counter[int] = Counter()

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.calls[layer_idx] += 1
            if layers is None or layer_idx in layers:
                key_states, value_states = store(key_states), store(value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return StoredKVCache()


def _hidden(model: Any, ids: torch.Tensor, cache: Any, chunk: int) -> torch.Tensor:
    """[1, N] ids prefilled `chunk` tokens at a time through `cache` -> the final hidden states [N, H]."""
    out = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            step = model.model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True)
            out.append(step.last_hidden_state[0])
    return torch.cat(out)


def _log_probs(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """[n, H] -> log-probabilities [n, V] f32, with the model's own head (and final softcap, where it has one)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits, dim=-1)


@dataclass(frozen=True)
class KVQuantResult:
    tokens: int
    mean_kl: float  # nats: mean over positions of KL(p_ref || p_int8)
    max_kl: float
    top1_agreement: float  # share of positions whose argmax agrees
    layers_quantized: int
    seconds: float

    @property
    def holds(self) -> bool:
        return self.top1_agreement >= TOP1_MIN and self.mean_kl <= KL_MAX


def reference_hidden(model: Any, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The unquantized cache's final hidden states [N, H] over `ids` [1, N] (to share between comparisons)."""
    return _hidden(model, ids, _plain_cache(model.config), chunk)


def compare(model: Any, ids: torch.Tensor, *, chunk: int = 1024, layers: Collection[int] | None = None,
            store: Callable[[torch.Tensor], torch.Tensor] = round_trip, reference: torch.Tensor | None = None,
            head_rows: int = 256) -> KVQuantResult:
    """The plain cache (or its `reference_hidden`, given) against one stored through `store` (default int8) over
    `ids` [1, N]: KL and top-1 at every position."""
    start = time.perf_counter()
    n_layers = model.config.num_hidden_layers
    if reference is None:
        reference = reference_hidden(model, ids, chunk)
    cache = stored_kv_cache(model.config, store, layers)
    quantized = _hidden(model, ids, cache, chunk)
    chunks = -(-ids.shape[1] // chunk)
    if sorted(cache.calls.items()) != [(i, chunks) for i in range(n_layers)]:  # every layer read its cache each chunk
        raise RuntimeError(f"the stored cache saw updates {dict(cache.calls)}, expected {chunks} per layer")
    kls, agree = [], 0
    with torch.inference_mode():
        for at in range(0, reference.shape[0], head_rows):  # the [n, V] head in slices: V is 262k for Gemma
            ref, q = _log_probs(model, reference[at:at + head_rows]), _log_probs(model, quantized[at:at + head_rows])
            kls.append((ref.exp() * (ref - q)).sum(-1).clamp_min(0))  # [n]; tiny negatives are f32 rounding
            agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
    kl = torch.cat(kls)
    return KVQuantResult(tokens=int(ids.shape[1]), mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                         top1_agreement=agree / ids.shape[1],
                         layers_quantized=n_layers if layers is None else len(set(layers)),
                         seconds=time.perf_counter() - start)


def _plain_cache(config: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=config)


def load(artifacts: Path) -> tuple[Any, Any]:
    """An export (`python -m server export`, the demo's cache) -> (transformers model in f32, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.model.artifacts import CFG_DIR, HF_DIR

    model = AutoModelForCausalLM.from_pretrained(artifacts / HF_DIR, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(artifacts / CFG_DIR)


def text_ids(tokenizer: Any, tokens: int) -> torch.Tensor:
    ids = tokenizer(english_text(), return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        raise ValueError(f"the text holds {ids.shape[1]} tokens, fewer than the {tokens} asked for")
    return ids


def measure(models: Iterable[tuple[str, Path]], tokens: int = DEFAULT_TOKENS, chunk: int = 1024,
            progress: Callable[[str], None] | None = None, bf16_baseline: bool = True) -> dict[str, Any]:
    """Each (name, export dir) over `tokens` tokens of the text -> the figures, and whether int8 KV holds on all.

    Beside each int8 figure, the same comparison for a bf16 KV (what the builds store unquantized): how much of
    the difference is the int8 grid and how much is any narrower storage on positions whose top two are near ties.
    """
    progress = progress or _say
    results: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "threads": torch.get_num_threads(),
                               "top1_min": TOP1_MIN, "kl_max_nats": KL_MAX}
    holds = True
    for name, artifacts in models:
        model, tokenizer = load(artifacts)
        limit = getattr(model.config, "max_position_embeddings", tokens)
        if tokens > limit:
            raise ValueError(f"{name} holds {limit} positions, fewer than --tokens {tokens}")
        ids = text_ids(tokenizer, tokens)
        progress(f"{name}: {tokens} tokens through the f32 cache ...")
        reference = reference_hidden(model, ids, chunk)
        for kind, store in (("int8", round_trip), ("bf16", bf16_round_trip))[:2 if bf16_baseline else 1]:
            progress(f"{name}: {tokens} tokens, f32 cache vs {kind} KV ...")
            found = compare(model, ids, chunk=chunk, store=store, reference=reference)
            results |= {f"{name}.{kind}.mean_kl": found.mean_kl, f"{name}.{kind}.max_kl": found.max_kl,
                        f"{name}.{kind}.top1_agreement": found.top1_agreement,
                        f"{name}.{kind}.seconds": round(found.seconds, 1)}
            if kind == "int8":
                holds = holds and found.holds
        del model
    results["int8_kv_holds"] = holds
    return results


def _say(message: str) -> None:
    print(message, flush=True)  # progress of a run that takes minutes, seen as it happens


def run(models: Iterable[tuple[str, Path]], tokens: int, json_path: Path | None, bf16_baseline: bool = True) -> int:
    from server.tools.bench.report import report

    report(measure(models, tokens, bf16_baseline=bf16_baseline), json_path)
    return 0
