"""lm-evaluation-harness, unmodified, in a process of its own: `python -m tests.support.lm_eval_worker`.

One JSON request a line on stdin (`lm_eval.simple_evaluate`'s own arguments: model, model_args, tasks, and the rest;
or `hf`: the arguments of transformers' `from_pretrained` for the model and tokenizer of lm-eval's own `HFLM`), one JSON
reply a line on the reply pipe: each task's metrics and per-item samples, and the run's wall time. The process lives
for a test module, so that lm-eval's import (~10-60 s on a loaded 2-core machine) and each reference model's load (a
GGUF: ~15-40 s) are paid once, not per run; the caller starts it with the hub offline (HF_HUB_OFFLINE and friends are
read at import time, which is why this is not the test process itself). lm-eval's prints go to stderr: stdout is the
reply pipe alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _sample(sample: dict[str, Any]) -> dict[str, Any]:
    """What a test compares of one item: lm-eval's own filtered answers (per choice (loglikelihood, is_greedy), or
    the generated text) and its per-item metrics."""
    metrics = {key: value for key, value in sample.items() if isinstance(value, int | float) and key != "doc_id"}
    return {"doc_id": sample["doc_id"], "target": str(sample["target"]), "metrics": metrics,
            "answers": [list(answer) if isinstance(answer, tuple) else answer for answer in sample["filtered_resps"]]}


_models: dict[str, Any] = {}


def _hf(spec: dict[str, Any]) -> Any:
    """lm-eval's `hf` backend (HFLM, as `--model hf` builds it) around transformers' own model and tokenizer, loaded
    once per spec: f32 on the CPU, from a checkpoint directory or a GGUF (`gguf_file`)."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _models:
        import torch
        from lm_eval.models.huggingface import HFLM
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
        model = AutoModelForCausalLM.from_pretrained(spec["pretrained"], dtype=torch.float32, **source).eval()
        tokenizer = (AutoTokenizer.from_pretrained(spec["tokenizer"]) if spec.get("tokenizer")
                     else AutoTokenizer.from_pretrained(spec["pretrained"], **source))
        _models[key] = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, **spec.get("args", {}))
    return _models[key]


def run(request: dict[str, Any]) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    request = dict(request)
    tasks = TaskManager(include_path=request.pop("include_path"))
    if "hf" in request:
        request["model"] = _hf(request.pop("hf"))
    start = time.monotonic()
    results = lm_eval.simple_evaluate(task_manager=tasks, log_samples=True, **request)
    wall = time.monotonic() - start
    assert results is not None
    return {"wall_s": wall, "results": {task: {key: value for key, value in metrics.items()
                                               if isinstance(value, int | float)}
                                        for task, metrics in results["results"].items()},
            "samples": {task: [_sample(sample) for sample in samples] for task, samples in results["samples"].items()}}


def main() -> None:
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # lm-eval's prints (result tables, warnings) join its log on stderr
    for line in sys.stdin:
        answer: dict[str, Any]
        try:
            answer = {"ok": run(json.loads(line))}
        except Exception as error:  # noqa: BLE001 - the test reports lm-eval's failure, whatever it is
            import traceback

            answer = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        reply.write(json.dumps(answer) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
