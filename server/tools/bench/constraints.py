"""What a constraint costs per token at V=262,144: `measure_constraints(tokenizer)` for `python -m server bench`.

Forces realistic documents through each constraint token by token (the tokens a model writing that document would
sample) and times, per token: `fill_mask` alone (the grammar engine), and fill + `TokenMask.apply_filled_` on a [V] row
(what the sampler adds), in wall time and in this thread's CPU time (on a shared host the wall-time tail is mostly
other processes taking the core). Also the one-time vocabulary build and the per-request compile. Goal (issue 12): under
0.5 ms per token at p50. Requests without a constraint pay nothing: they never build one.

Run alone: `python -m server bench constraints CFG_DIR` (a tokenizer directory: the demo's cfg/ has the real 262k
Gemma tokenizer; tests/support/gemma4_tokenizer.py builds a Gemma-4-format one, which adds the tool-call case).
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from server.constraints.constraint import Constraint, build_matcher
from server.constraints.planner import plan_constraint
from server.constraints.vocab import GrammarVocab
from server.protocol import protocol_of
from server.sampling.mask import TokenMask
from server.sampling.params import SamplingParams
from server.sampling.sampler import Sampler
from server.tools.bench.report import percentile, report

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 60},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de", "ja"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "address", "verified"],
    "additionalProperties": False,
}
PEOPLE = [
    {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "languages": ["en", "fr"],
     "address": {"city": "London", "zip": "W1 4AB"}, "verified": True},
    {"name": "Katherine Johnson", "age": 101, "languages": ["en"], "address": {"city": "Hampton", "zip": "23669"},
     "verified": False},
    {"name": "Émilie du Châtelet", "age": 42, "email": "emilie@example.fr", "languages": ["fr", "de", "en"],
     "address": {"city": "Paris", "zip": "75004"}, "verified": True},
]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer"}},
    "required": ["city", "unit"]}}}


SOFTCAP = 30.0  # Gemma's final-logit soft-cap: the sampler applies it to the allowed entries in the mask's pass


def _walk(build: Any, documents: Sequence[list[int]], mask: TokenMask, logits: torch.Tensor,
          repeats: int) -> tuple[list[float], list[float], list[float]]:
    fill_ms, total_ms, cpu_ms = [], [], []
    row = logits.clone()
    for _ in range(repeats):
        for ids in documents:
            constraint: Constraint = build()
            for token in ids:
                row.copy_(logits)
                cpu_start, start = time.thread_time(), time.perf_counter()
                constraint.fill_mask(mask.bits)
                filled = time.perf_counter()
                mask.apply_filled_(row, SOFTCAP)
                done, cpu_done = time.perf_counter(), time.thread_time()
                fill_ms.append((filled - start) * 1e3)
                total_ms.append((done - start) * 1e3)
                cpu_ms.append((cpu_done - cpu_start) * 1e3)
                if not constraint.accept(token):
                    raise RuntimeError(f"the bench document was refused at token {token}")
    return fill_ms, total_ms, cpu_ms


def measure_constraints(tokenizer: Any, *, vocab_size: int = 262_144, stop_ids: Sequence[int] | None = None,
                        repeats: int = 5, source: Path | None = None) -> dict[str, float]:
    """Per-token mask cost (p50/p99, ms) for json_schema and json_object, plus Gemma-4 tool calls when the
    tokenizer is Gemma-4's. `tokenizer`: a HostTokenizer; `source`: its tokenizer.json, to time the vocabulary's build
    from a cached token table as well (a later start's) as from the tokenizer (the first start's)."""
    stops = list(stop_ids) if stop_ids is not None else [tokenizer.eos_token_id]
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-grammar-vocab-") as cache:
        start = time.perf_counter()
        vocab = GrammarVocab.from_tokenizer(tokenizer, vocab_size, stops, cache_dir=Path(cache), source=source)
        results["constraint_vocab_build_s"] = time.perf_counter() - start
        if source is not None:
            start = time.perf_counter()
            vocab = GrammarVocab.from_tokenizer(tokenizer, vocab_size, stops, cache_dir=Path(cache), source=source)
            assert vocab.from_cache, "the first build wrote the token table"
            results["constraint_vocab_build_s_cached"] = time.perf_counter() - start
    mask = TokenMask(vocab_size)
    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(0)) * 3.0  # [V]

    cases: dict[str, tuple[dict[str, Any], list[str]]] = {
        "json_schema": ({"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}},
                        [json.dumps(person, ensure_ascii=False) for person in PEOPLE]),
        "json_object": ({"response_format": {"type": "json_object"}},
                        [json.dumps(person, ensure_ascii=False) for person in PEOPLE]),
    }
    calls = protocol_of(tokenizer).calls
    if calls is not None:
        written = ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,unit:<|"|>celsius<|"|>}<tool_call|>',
                   '<|tool_call>call:get_weather{city:<|"|>San Francisco<|"|>,unit:<|"|>fahrenheit<|"|>}<tool_call|>']
        cases["tool_call"] = ({"tools": [WEATHER_TOOL], "tool_choice": "required"}, written)
    for name, (request, texts) in cases.items():
        start = time.perf_counter()
        spec = plan_constraint(vocab, calls, **request)  # the first compile (later ones copy the cached grammar)
        results[f"constraint_compile_ms_{name}"] = (time.perf_counter() - start) * 1e3
        assert spec is not None
        documents = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        build = functools.partial(build_matcher, vocab, spec)
        fill_ms, total_ms, cpu_ms = _walk(build, documents, mask, logits, repeats)
        # apply_cpu: CPU time of this thread, what the step costs when no other process takes the core away.
        for label, times in (("mask", fill_ms), ("mask_apply", total_ms), ("mask_apply_cpu", cpu_ms)):
            for q in (50, 99):
                results[f"constraint_{label}_ms_p{q}_{name}"] = percentile(times, q)
        plain, constrained = _sampler_walk(build, documents, logits, vocab_size, repeats)
        results["sampler_ms_p50_plain_greedy"] = percentile(plain, 50)
        results[f"sampler_ms_p50_constrained_greedy_{name}"] = percentile(constrained, 50)
        results[f"sampler_ms_p99_constrained_greedy_{name}"] = percentile(constrained, 99)
    return results


def _sampler_walk(build: Any, documents: Sequence[list[int]], logits: torch.Tensor, vocab_size: int,
                  repeats: int) -> tuple[list[float], list[float]]:
    """The whole sampler step (greedy), plain and constrained (mask + soft-cap + argmax + accept), per token, ms."""
    params = SamplingParams(temperature=0.0)
    plain_ms, constrained_ms = [], []
    for _ in range(repeats):
        for ids in documents:
            constraint: Constraint = build()
            plain = Sampler(params, vocab_size, [], SOFTCAP)
            sampler = Sampler(params, vocab_size, [], SOFTCAP, constraint=constraint)
            for token in ids:
                start = time.perf_counter()
                plain.sample(logits)
                middle = time.perf_counter()
                sampler.sample(logits)
                constraint.accept(token)  # the document's token, as the model would have written it
                sampler.accept(token)
                done = time.perf_counter()
                plain_ms.append((middle - start) * 1e3)
                constrained_ms.append((done - middle) * 1e3)
    return plain_ms, constrained_ms


def run(cfg: Path, json_path: Path | None = None) -> int:
    """`python -m server bench constraints CFG_DIR`: the mask's cost on that directory's tokenizer."""
    from server.model.tokenizer import HostTokenizer

    tokenizer = HostTokenizer.from_dir(cfg)
    generation = cfg / "generation_config.json"
    stops = None
    if generation.is_file():
        eos = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        stops = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else None
    torch.set_num_threads(1)  # as the server's sampler runs
    report(measure_constraints(tokenizer, stop_ids=stops, source=cfg / "tokenizer.json"), json_path)
    return 0
