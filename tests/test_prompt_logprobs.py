"""Prompt logprobs (issue 26): `/v1/completions` with `echo` and `logprobs` scores the prompt, as OpenAI's legacy API
and vLLM do, for evaluation harnesses. Proven against transformers' own model over HTTP, on a tiny random Gemma-4:

- every prompt position's logprob and top_logprobs equal log_softmax of transformers' (soft-capped) logits, the
  first token's null, over prompts of several prefill chunks, stream and non-stream, on three devices: the `hf` graph
  (transformers caps its own logits), the same model with the cap left to the host (as every compiled graph leaves
  it: a stand-in device), and the recipe's compiled contract v3 (CPU trace, padded buckets, the host's soft-cap);
- lm-evaluation-harness's `local-completions` loglikelihood request, exactly as it sends it, parsed by its own
  `parse_logprobs` (reimplemented below from lm_eval/models/openai_completions.py), gives the reference
  loglikelihood and is_greedy;
- a scored request reuses no cached prefix (the cache has no logits for it), `max_tokens` 0 with echo scores the
  prompt alone, and the bounds (--max-prompt-logprobs, max_tokens 0 without echo) are 400s naming the field.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from server.app.runtime import Host, build_engine, graph_loader, load_host
from server.graphs.base import Graph
from server.graphs.hf import HFGraph
from server.tools.export import export
from tests.support.api_fixtures import LiveServer, WrappedGraph, live_server, metric, settings
from tests.support.models import reference_model, tiny_gemma4_checkpoint
from tests.support.recipe_helpers import SCRIPT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "gemma4-tiny"
MAX, BUCKET = 128, 16  # hf: a 40-token prompt is three prefill chunks
V3_MAX, V3_BUCKETS, WINDOW = 64, (8, 16), 12  # v3: 40 tokens = 16 + 16 + 8, across the sliding window
TOP = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma-4 with its embedding on the bf16 grid: the recipe's table is bf16 (tied: the lm_head too), so
    transformers' f32 model and every graph below run the same weights."""
    # the artifact's table is bf16 (tied: the lm_head too): the reference reads the same rows
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("plogp") / "checkpoint", sliding_window=WINDOW,
                                  bf16_table=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    return reference_model(checkpoint)


@pytest.fixture(scope="module")
def hf_host(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Host:
    artifacts = export(checkpoint, tmp_path_factory.mktemp("plogp-hf") / "artifacts", prefill_bucket=BUCKET,
                       max_total=MAX, dtype="float32")
    return load_host(artifacts, "hf", MODEL)


def host_capped(host: Host) -> Callable[[], Graph]:
    """A stand-in device: the hf graph with transformers' final soft-cap switched off, left to the host as a compiled
    graph leaves it (graph.json `softcap_in_graph: false`)."""

    def load() -> Graph:
        graph = graph_loader(host)()
        assert isinstance(graph, HFGraph)
        config = graph.model.config
        graph.host_softcap, config.final_logit_softcapping = config.final_logit_softcapping, None
        assert graph.host_softcap == 30.0
        return graph

    return load


@pytest.fixture(scope="module")
def v3_host(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Host:
    out = tmp_path_factory.mktemp("plogp-v3") / "artifacts"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
           "--contract", "v3", "--max-total", str(V3_MAX), "--prefill-buckets", ",".join(map(str, V3_BUCKETS)),
           "--kv-slots", "2", "--decode-batches", "1,2", "--quant", "none"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_host(out, "jit", MODEL)


@dataclass
class Served:
    server: LiveServer
    tol: float  # logprob tolerance against transformers (a traced graph sums in another order)


@contextmanager
def _serve(host: Host, load: Callable[[], Graph] | None = None, **overrides: Any) -> Iterator[Served]:
    config = settings(served_model_name=MODEL, **overrides)
    with live_server(config, build_engine(host, config, load=load), host) as live:
        yield Served(live, 1e-4 if host.graph_kind == "hf" else 2e-3)


@pytest.fixture(scope="module", params=["hf", "hf-host-softcap", "jit-v3"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    if request.param == "jit-v3":
        host, load = request.getfixturevalue("v3_host"), None
    else:
        host = request.getfixturevalue("hf_host")
        load = host_capped(host) if request.param == "hf-host-softcap" else None
    with _serve(host, load) as live:
        yield live


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]  # BOS + ordinary tokens


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits (its final soft-cap applied) at every position: [T, V]."""
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def complete(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=300)


def completed(server: LiveServer, **body: Any) -> dict[str, Any]:
    r = complete(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(host: Host, token: int) -> str:
    return host.tokenizer.decode([token])


def check_scored(logprobs: dict[str, Any], ids: list[int], ref: torch.Tensor, host: Host, tol: float,
                 top: int = TOP) -> None:
    """`logprobs`' first len(ids) entries are the prompt's, as transformers' log_softmax gives them."""
    assert logprobs["tokens"][: len(ids)] == [text_of(host, t) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [0]
    for token in ids[:-1]:
        offsets.append(offsets[-1] + len(text_of(host, token)))
    assert logprobs["text_offset"][: len(ids)] == offsets
    for i in range(1, len(ids)):
        row = ref[i - 1]  # [V]: position i - 1 predicts token i
        assert logprobs["token_logprobs"][i] == pytest.approx(float(row[ids[i]]), abs=tol), i
        values, best = torch.topk(row, top)
        want = {text_of(host, t): v for t, v in zip(best.tolist(), values.tolist(), strict=True)}
        want.setdefault(text_of(host, ids[i]), float(row[ids[i]]))
        got = logprobs["top_logprobs"][i]
        assert got.keys() == want.keys(), i
        assert list(got.values()) == pytest.approx(list(want.values()), abs=tol), i


def test_prompt_logprobs_equal_transformers_log_softmax(served: Served, reference: torch.nn.Module) -> None:
    ids = prompt_of(40, seed=1)
    ref = reference_logprobs(reference, ids)
    body = completed(served.server, prompt=ids, echo=True, logprobs=TOP, max_tokens=2, temperature=0)
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    check_scored(logprobs, ids, ref, served.server.host, served.tol)
    assert len(logprobs["token_logprobs"]) == len(ids) + 2
    # The first completion token: greedy from the last prompt position, with the sampler's own logprob.
    first = int(ref[-1].argmax())
    assert logprobs["tokens"][len(ids)] == text_of(served.server.host, first)
    assert logprobs["token_logprobs"][len(ids)] == pytest.approx(float(ref[-1, first]), abs=served.tol)
    echo = served.server.host.tokenizer.decode(ids)
    assert choice["text"].startswith(echo)
    assert logprobs["text_offset"][len(ids)] == len(echo)  # the completion's offsets within `text`, as before
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_streamed_prompt_logprobs_come_first_and_equal_the_body(served: Served) -> None:
    ids = prompt_of(37, seed=2)
    request = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    chunks = []
    with httpx.stream("POST", f"{served.server.url}/v1/completions", json={**request, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                chunks.append(chunk["choices"][0])
    echo = served.server.host.tokenizer.decode(ids)
    assert chunks[0]["text"] == echo and len(chunks[0]["logprobs"]["tokens"]) == len(ids)
    merged: dict[str, list[Any]] = {key: [] for key in chunks[0]["logprobs"]}
    for chunk in chunks:
        for key, values in (chunk["logprobs"] or {}).items():
            merged[key] += values
    (whole,) = completed(served.server, **request)["choices"]
    assert merged == whole["logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_a_scored_prompt_reuses_no_cached_prefix(served: Served, reference: torch.nn.Module) -> None:
    """The same prompt twice (which a plain request would take whole from the cache, kept logits and all): the second
    is prefilled and scored again, every position."""
    server = served.server
    ids = prompt_of(33, seed=3)
    completed(server, prompt=ids, max_tokens=1, temperature=0)  # the prompt is now in a slot, with its logits
    hits = metric(server.url, "gemma4_prefix_cache_hit_tokens_total")
    first = completed(server, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    second = completed(server, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert metric(server.url, "gemma4_prefix_cache_hit_tokens_total") == hits
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    check_scored(second["choices"][0]["logprobs"], ids, reference_logprobs(reference, ids), server.host, served.tol,
                 top=1)


def lm_eval_parse_logprobs(outputs: list[dict[str, Any]], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's `LocalCompletionsAPI.parse_logprobs` (lm_eval/models/openai_completions.py), as it
    reads a loglikelihood response: the continuation's logprobs are token_logprobs[ctxlen:-1] (the last entry is the
    one generated token), greedy when each equals the best of its top_logprobs."""
    res = []
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
            assert ctxlen > 0, "Context length must be greater than 0"
            logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = True
            for tok, top in zip(tokens_logprobs, top_logprobs, strict=False):
                if tok != max(top.values()):
                    is_greedy = False
                    break
            res.append((logprobs, is_greedy))
    return res


def expected_loglikelihood(model: torch.nn.Module, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ref = reference_logprobs(model, context + continuation)
    rows = ref[len(context) - 1 : -1]  # [C, V]: the rows that predict the continuation
    wanted = torch.tensor(continuation)
    return float(rows.gather(1, wanted[:, None]).sum()), bool((rows.argmax(1) == wanted).all())


def greedy_continuation(model: torch.nn.Module, context: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([context]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None)
    return out[0, len(context):].tolist()


def test_lm_eval_local_completions_loglikelihood(served: Served, reference: torch.nn.Module) -> None:
    """The request lm-eval's `local-completions` sends for loglikelihood tasks (`_create_payload(generate=False)`:
    tokenized requests, a batch of prompts), and its own parse of our answer."""
    context = prompt_of(21, seed=4)
    continuations = [greedy_continuation(reference, context, 4), prompt_of(6, seed=5)[1:]]
    inputs = [context + c for c in continuations]
    payload = {"model": MODEL, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    r = httpx.post(f"{served.server.url}/v1/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    got = lm_eval_parse_logprobs([r.json()], [len(context)] * len(inputs))
    want = [expected_loglikelihood(reference, context, c) for c in continuations]
    assert [g[1] for g in got] == [w[1] for w in want] == [True, False]
    for (loglikelihood, _), (expected, _) in zip(got, want, strict=True):
        assert loglikelihood == pytest.approx(expected, abs=served.tol * 10)


def test_max_tokens_zero_scores_the_prompt_alone(served: Served, reference: torch.nn.Module) -> None:
    """vLLM's shape of the same request (`max_tokens` 0 with echo): the prompt's entries only, no token generated."""
    ids = prompt_of(20, seed=6)
    body = completed(served.server, prompt=ids, echo=True, logprobs=TOP, max_tokens=0, temperature=0)
    (choice,) = body["choices"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    check_scored(choice["logprobs"], ids, reference_logprobs(reference, ids), served.server.host, served.tol)
    assert choice["text"] == served.server.host.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    # Without logprobs, the prompt alone is echoed and nothing runs on the device.
    plain = completed(served.server, prompt=ids, echo=True, max_tokens=0)
    assert plain["choices"][0]["text"] == choice["text"] and plain["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------------------------------------------------- bounds


@pytest.fixture(scope="module")
def bounded(hf_host: Host) -> Iterator[Served]:
    with _serve(hf_host, max_prompt_logprobs=20) as live:
        yield live


def test_prompt_logprobs_beyond_the_bound_are_a_400(bounded: Served) -> None:
    server = bounded.server
    assert complete(server, prompt=prompt_of(20, 7), echo=True, logprobs=1, max_tokens=1).status_code == 200
    refused = complete(server, prompt=prompt_of(21, 7), echo=True, logprobs=1, max_tokens=1)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "--max-prompt-logprobs" in error["message"] and "21" in error["message"]
    listed = complete(server, prompt=[prompt_of(5, 7), prompt_of(21, 7)], echo=True, logprobs=0, max_tokens=1)
    assert listed.status_code == 400 and listed.json()["error"]["param"] == "prompt[1]"
    # Not scored (echo alone, or logprobs alone): not bounded by it.
    assert complete(server, prompt=prompt_of(21, 7), echo=True, max_tokens=1).status_code == 200
    assert complete(server, prompt=prompt_of(21, 7), logprobs=1, max_tokens=1).status_code == 200


def test_max_tokens_zero_needs_echo(bounded: Served) -> None:
    refused = complete(bounded.server, prompt=prompt_of(5, 8), max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


class LastOnly(WrappedGraph):
    """A stand-in device that hands back only the last position's logits, whatever it is asked."""

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        return self.inner.forward(embeds, positions, last_only=True, on_submit=on_submit)


def test_a_graph_without_every_position_fails_the_request_by_name(hf_host: Host) -> None:
    load = graph_loader(hf_host)
    with _serve(hf_host, lambda: LastOnly(load(), "last-only")) as served:
        failed = complete(served.server, prompt=prompt_of(5, 9), echo=True, logprobs=1, max_tokens=1)
        assert failed.status_code == 500
        assert "prompt logprobs need every position" in failed.json()["error"]["message"]
        # Its other requests are served as before.
        assert complete(served.server, prompt=prompt_of(5, 9), max_tokens=1).status_code == 200
