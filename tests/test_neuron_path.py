"""The Neuron load path (issue 16), as far as it can be held without Inferentia.

- `serve --graph jit` with a stand-in `neuronx_distributed` on the path (tests/support/neuron_standin: a stand-in for an
  external system that cannot run here, kept minimal; see its docstring). Its import does what NxD's does under
  transformers 5 (imports `transformers.utils.fx`, which fails unless our stand-in for that module is installed
  first); it records how the graph is loaded and makes the loaded graph behave as on the device (weights pushed
  by `initialize_with_saved_weights` before the first call, the logits alone returned). The served completion
  must equal the one the plain CPU path serves for the same recipe-built `model.pt`.
- The prelude on its own: the `transformers.utils.fx` stand-in is installed only when the real one is missing.
- The recipe's check of the sharded checkpoint: rank slices pass, full (unsharded) tensors fail loudly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.support.api_fixtures import free_port
from tests.support.wait import wait_serving
from tests.test_recipe import BUCKET, MAX, H, recipe

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).resolve().parent / "support" / "neuron_standin"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's `--target cpu` artifact directory for a tiny random Gemma-4 (as tests/test_recipe_served.py)."""
    return H.export_cpu_artifacts(tmp_path_factory.mktemp("neuron-path"), H.make_tiny_hf(seed=5), MAX, BUCKET)


@contextmanager
def serve(artifacts: Path, env: dict[str, str]) -> Iterator[str]:
    """`python -m server serve --graph jit` as a real process; yields its URL once /health answers ok."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--artifacts", str(artifacts), "--graph", "jit",
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_serving(proc, f"{url}/health", 180)
        yield url
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def complete(url: str) -> dict:
    prompt = torch.randint(3, H.TINY["vocab_size"], (BUCKET + 5,), generator=torch.Generator().manual_seed(2))
    body = {"prompt": prompt.tolist(), "max_tokens": 12, "temperature": 0, "logprobs": 1}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_serve_jit_loads_through_nxd_as_the_published_deploy_does(artifacts: Path, tmp_path: Path) -> None:
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    with serve(artifacts, base) as url:
        plain = complete(url)

    record = tmp_path / "nxd-calls.jsonl"
    standin = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(STANDIN)]), "NXD_STANDIN_RECORD": str(record)}
    with serve(artifacts, standin) as url:
        on_device = complete(url)

    assert record.exists(), "the stand-in NxD was never imported: its import failed (transformers.utils.fx?)"
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls == [
        {"call": "torch.jit.load", "positional": 1, "keywords": []},  # no map_location: device weights stay put
        {"call": "initialize_with_saved_weights", "start_rank": [0], "dtype": "torch.int32"},
    ]
    # The logits-alone call answers exactly as the CPU trace's (logits, *kv) did: same tokens, same logprobs.
    assert on_device == plain
    assert plain["finish_reason"] == "length" and len(plain["logprobs"]["token_logprobs"]) == 12


def _fresh_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_fx_standin_only_when_transformers_lacks_the_module() -> None:
    out = _fresh_python(
        "import abc, importlib.util, sys\n"
        "from server.vendor import neuron_prelude as p\n"
        "real = importlib.util.find_spec('transformers.utils.fx') is not None\n"
        "first, again = p.install_fx_standin(), p.install_fx_standin()\n"
        "from transformers.utils.fx import HFTracer, symbolic_trace\n"
        "class Wrapper(abc.ABC): pass\n"
        "class Tracer(Wrapper, HFTracer): pass\n"  # what NxD's pipeline/trace.py does at import time
        "print(real, first, again, callable(symbolic_trace))\n"
    )
    real, first, again, has_trace = out.split()
    assert (first, again, has_trace) == (str(real == "False"), "False", "True")


def test_prelude_without_nxd_is_a_no_op() -> None:
    out = _fresh_python(
        "import sys\nfrom server.vendor.neuron_prelude import prepare_neuron_imports\n"
        "print(prepare_neuron_imports(), 'transformers.utils.fx' in sys.modules)\n"
    )
    assert out == "None False"  # CPU hosts: nothing imported, nothing stood in


@pytest.fixture(scope="module")
def tp2_template_and_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """build_neuron's meta template (rank-local shapes) and what its checkpoint_loader hands NxD (full tensors)."""
    checkpoint = H.save_tiny_checkpoint(tmp_path_factory.mktemp("tp2") / "checkpoint", H.make_tiny_hf(seed=1))
    plan = recipe.Plan(tp=2, quant="int8", dtype=torch.bfloat16, max_total=MAX, kv_as_params=True, inplace_kv=False)
    template = recipe.build_model(H.tiny_config(), plan, recipe.LOCAL, device="meta")
    return template, recipe.convert_checkpoint(recipe.CheckpointReader(checkpoint), template)


def _write_ranks(workdir: Path, per_rank: list[dict[str, torch.Tensor]]) -> None:
    workdir.mkdir(parents=True)
    for rank, tensors in enumerate(per_rank):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(workdir / f"tp{rank}_sharded_checkpoint.safetensors"))


def test_sharded_checkpoint_check_accepts_rank_slices(tp2_template_and_full, tmp_path: Path) -> None:
    template, full = tp2_template_and_full
    _write_ranks(tmp_path / "wd", [recipe.shard_state_dict(template, full, rank, 2) for rank in range(2)])
    recipe.check_sharded_checkpoint(template, tmp_path / "wd", 2)


def test_sharded_checkpoint_check_fails_loudly_on_unsharded_linears(tp2_template_and_full, tmp_path: Path) -> None:
    template, full = tp2_template_and_full
    _write_ranks(tmp_path / "wd", [full, full])  # what NxD writes when it does not know our modules
    unsharded = r"rank 0: layers\.0\.mlp\.down_proj\.qweight is \(64, 96\), the rank-local shape is \(64, 48\)"
    with pytest.raises(SystemExit, match=r"(?s)does not match tp=2.*" + unsharded):
        recipe.check_sharded_checkpoint(template, tmp_path / "wd", 2)
    shutil.rmtree(tmp_path / "wd")
    _write_ranks(tmp_path / "wd", [recipe.shard_state_dict(template, full, 0, 2)])  # rank 1's file never written
    with pytest.raises(SystemExit, match="rank 1: 0 tp1_sharded_checkpoint"):
        recipe.check_sharded_checkpoint(template, tmp_path / "wd", 2)


def test_recipe_imports_nxd_through_the_prelude(tmp_path: Path) -> None:
    """With NxD present, the recipe's Neuron import gets past transformers.utils.fx (the stand-in NxD has nothing
    beyond the model builder, so it stops at the next NxD module: the point is which error it is)."""
    env = {**os.environ, "PYTHONPATH": str(STANDIN), "NXD_STANDIN_RECORD": str(tmp_path / "calls.jsonl")}
    done = subprocess.run([sys.executable, str(H.SCRIPT), "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"),
                           "--target", "neuron"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "transformers.utils.fx" not in done.stderr
    assert "No module named 'neuronx_distributed.parallel_layers'" in done.stderr
    assert not (tmp_path / "o").exists()
