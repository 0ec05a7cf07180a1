"""lm-evaluation-harness (PyPI, unmodified) against the server equals it against transformers (issue 36).

A local task pair of our own (tests/support/lm_eval_tasks.py: a few dozen multiple-choice items scored by
loglikelihood, a few short-answer items generated greedily) runs twice per model, with no network: `local-completions`
(loglikelihood through `echo` + `logprobs`, token-id prompts from lm-eval's own tokenization) and
`local-chat-completions` (generate_until) against the server, and `hf` (lm-eval's HFLM) on the same weights in
transformers. Per item, the loglikelihoods agree within 1e-3, the accuracy is identical, and the greedy answers are
the same text. The models:

- both demos of `python -m server demo` (SmolLM2-135M-Instruct, Gemma-3 270M), transformers reading the same GGUF;
- the tiny Gemma-4 through the recipe's CPU v3 build (loglikelihood), transformers on the same checkpoint (its
  embedding on the bf16 grid, as the artifact's table is).

Gemma's tokenizer adds BOS and lm-eval's API models do not unless told (`add_bos_token=True`), so they are told: the
server scores the tokens it is sent, and the hf side's context starts with BOS.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from server.app.runtime import build_engine, load_host
from server.tools.demo import GEMMA3, SMOLLM2, demo_artifacts, demo_source
from tests.support import models
from tests.support.api_fixtures import ROOT, free_port, live_server, settings
from tests.support.harness import Harness
from tests.support.lm_eval_tasks import GEN_TASK, MC_TASK, MULTIPLE_CHOICE, SHORT_ANSWER, write_tasks
from tests.support.recipe_helpers import SCRIPT
from tests.support.smollm2 import smollm2_cache  # noqa: F401 (a pytest fixture)
from tests.support.wait import wait_serving

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOLERANCE = 1e-3  # per item, nats: the bar
TINY = "gemma4-tiny"
V3_MAX, V3_BUCKETS, WINDOW = 64, (8, 16), 12  # the tiny build: every item fits, prompts cross the sliding window
API_BATCH = 4  # prompts per /v1/completions request: lm-eval's batch_size, the demo's KV slots


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    root = tmp_path_factory.mktemp("lm-eval")
    worker = Harness(root, write_tasks(root / "tasks"))
    try:
        yield worker
    finally:
        worker.close()


@contextmanager
def demo_server(model: str, cache: Path) -> Iterator[str]:
    """`python -m server demo --model MODEL` on an export already in `cache`; yields its base URL."""
    url = f"http://127.0.0.1:{(port := free_port())}"
    env = {k: v for k, v in os.environ.items() if k != "DEMO_MODEL"}
    proc = subprocess.Popen([sys.executable, "-m", "server", "demo", "--model", model, "--cache-dir", str(cache),
                             "--port", str(port)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(proc, f"{url}/health", 300)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def api_args(url: str, model: str, tokenizer: Path, max_length: int, *, bos: bool, chat: bool = False) -> dict[str, Any]:
    if chat:  # lm-eval sends the messages; the server renders its own chat template
        return {"base_url": f"{url}/v1/chat/completions", "model": model, "max_length": max_length}
    return {"base_url": f"{url}/v1/completions", "model": model, "tokenizer": str(tokenizer),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_length": max_length,
            "add_bos_token": bos, "batch_size": API_BATCH}


def evaluate_demo(harness: Harness, model: str, cache: Path, hf: dict[str, Any], *, bos: bool) -> dict[str, Any]:
    """Each run of one demo model: the server's two (loglikelihood, chat generation), then transformers' two."""
    artifacts = demo_artifacts(cache, model=model)
    max_total = int(json.loads((artifacts / "graph.json").read_text())["max_total"])
    with demo_server(model, cache) as url:
        runs = {"api-mc": harness.run([MC_TASK], model="local-completions",
                                      model_args=api_args(url, model, artifacts / "cfg", max_total, bos=bos)),
                "api-gen": harness.run([GEN_TASK], model="local-chat-completions", apply_chat_template=True,
                                       model_args=api_args(url, model, artifacts / "cfg", max_total, bos=bos,
                                                           chat=True))}
    runs["hf-mc"] = harness.run([MC_TASK], hf=hf)
    runs["hf-gen"] = harness.run([GEN_TASK], hf=hf, apply_chat_template=True)
    return runs


@pytest.fixture(scope="module")
def smollm2_runs(harness: Harness, smollm2_cache: Path) -> dict[str, Any]:  # noqa: F811
    gguf = demo_source(SMOLLM2, smollm2_cache)
    # transformers reads model and tokenizer (and its chat template) out of the package's GGUF, as the export does
    return evaluate_demo(harness, SMOLLM2, smollm2_cache, {"pretrained": str(gguf.parent), "gguf_file": gguf.name},
                         bos=False)


@pytest.fixture(scope="module")
def gemma3_runs(harness: Harness) -> dict[str, Any]:
    cache = models.cache_root()
    artifacts = models.demo_dir()  # the session's export, where `demo --cache-dir` finds it
    gguf = demo_source(GEMMA3, cache)
    # The model from the GGUF; the tokenizer from the export's cfg/: the GGUF carries no chat template (the export
    # writes Gemma's turn format), and its 262k vocabulary costs ~25 s to read a second time.
    return evaluate_demo(harness, GEMMA3, cache, {"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                                                  "tokenizer": str(artifacts / "cfg")}, bos=True)


@pytest.fixture(scope="module")
def gemma4_runs(harness: Harness, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lm-eval-gemma4")
    checkpoint = models.tiny_gemma4_checkpoint(root / "checkpoint", sliding_window=WINDOW, bf16_table=True)
    out = root / "artifacts"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
           "--contract", "v3", "--max-total", str(V3_MAX), "--prefill-buckets", ",".join(map(str, V3_BUCKETS)),
           "--kv-slots", "2", "--decode-batches", "1,2", "--quant", "none"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    host = load_host(out, "jit", TINY)
    config = settings(served_model_name=TINY)
    with live_server(config, build_engine(host, config), host) as live:
        api = harness.run([MC_TASK], model="local-completions",
                          model_args={**api_args(live.url, TINY, checkpoint, V3_MAX, bos=True), "batch_size": 2})
    return {"api-mc": api, "hf-mc": harness.run([MC_TASK], hf={"pretrained": str(checkpoint)})}


RUNS = {"smollm2": "smollm2_runs", "gemma3": "gemma3_runs", "gemma4-v3": "gemma4_runs"}


def _items(run: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(run["samples"][task], key=lambda sample: int(sample["doc_id"]))


@pytest.mark.parametrize("subject", list(RUNS))
def test_loglikelihoods_match_transformers_per_item(subject: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(RUNS[subject])
    served, reference = _items(runs["api-mc"], MC_TASK), _items(runs["hf-mc"], MC_TASK)
    assert len(served) == len(reference) == len(MULTIPLE_CHOICE)
    diffs, greedy = [], 0
    for ours, theirs in zip(served, reference, strict=True):
        assert len(ours["answers"]) == len(theirs["answers"]) == 3, (ours, theirs)
        for (ll, is_greedy), (ref_ll, ref_greedy) in zip(ours["answers"], theirs["answers"], strict=True):
            diffs.append(abs(float(ll) - float(ref_ll)))
            greedy += is_greedy == ref_greedy
        # the same choice wins, item by item
        assert ours["metrics"]["acc"] == theirs["metrics"]["acc"], (ours, theirs)
    accuracy = {name: runs[name]["results"][MC_TASK]["acc,none"] for name in ("api-mc", "hf-mc")}
    print(f"\n{subject}: {len(diffs)} loglikelihoods, mean |diff| {statistics.fmean(diffs):.2e}, max {max(diffs):.2e};"
          f" accuracy server {accuracy['api-mc']:.4f} hf {accuracy['hf-mc']:.4f}; is_greedy agrees {greedy}/"
          f"{len(diffs)}; wall time server {runs['api-mc']['wall_s']:.1f} s, hf {runs['hf-mc']['wall_s']:.1f} s")
    assert max(diffs) <= TOLERANCE
    assert accuracy["api-mc"] == accuracy["hf-mc"]
    assert greedy == len(diffs)


@pytest.mark.parametrize("subject", ["smollm2", "gemma3"])
def test_greedy_answers_match_transformers(subject: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(RUNS[subject])
    served, reference = _items(runs["api-gen"], GEN_TASK), _items(runs["hf-gen"], GEN_TASK)
    assert len(served) == len(reference) == len(SHORT_ANSWER)
    print(f"\n{subject}: answers {[s['answers'][0] for s in served]}; wall time server {runs['api-gen']['wall_s']:.1f} s,"
          f" hf {runs['hf-gen']['wall_s']:.1f} s")
    assert [s["answers"] for s in served] == [r["answers"] for r in reference]
    assert any(s["answers"][0].strip() for s in served)  # the model said something: equal empty answers prove nothing
