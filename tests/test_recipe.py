"""The compile recipe (server/vendor/tp_mb_moe_sqz.py) proven on CPU.

Everything the recipe does in plain PyTorch is checked against transformers' Gemma-4 on a tiny random MoE model:
the module on the graph contract (prefill, padded chunks, decode), the dense expert split by rank, the TP=2
sharding plan (ranks simulated with threads), the int8 squeeze, the `--target cpu` TorchScript artifact driven
exactly like the server drives a graph, and the per-rank residency of the real 26B-A4B config.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.configs import GEMMA4_26B_A4B


def _load_helpers():
    # By path: works whether or not tests/ is a package and whatever is on sys.path.
    name = "recipe_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "support" / "recipe_helpers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


H = _load_helpers()
recipe = H.load_recipe()

MAX, BUCKET, WINDOW, HIDDEN, VOCAB = 64, 16, H.TINY["sliding_window"], H.TINY["hidden_size"], H.TINY["vocab_size"]
DRIVE = dict(bucket=BUCKET, max_total=MAX, window=WINDOW, hidden_size=HIDDEN)


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def capped(logits: torch.Tensor) -> torch.Tensor:
    return H.SOFTCAP * torch.tanh(logits / H.SOFTCAP)


# --------------------------------------------------------------------------------------------------------------------
# Fixtures: one random checkpoint (and an int8-grid twin) for the whole session
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_model():
    return H.make_tiny_hf()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory, hf_model) -> Path:
    return H.save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma4"), hf_model)


@pytest.fixture(scope="session")
def grid_ckpt(tmp_path_factory, hf_model) -> Path:
    model = copy.deepcopy(hf_model)
    H.snap_quantized_weights(model)
    return H.save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma4_grid"), model)


@pytest.fixture(scope="session")
def table(hf_model) -> torch.Tensor:
    return hf_model.model.embed_tokens.weight.detach().clone()  # [V, H], bf16-exact values


def build(checkpoint: Path, quant: str = "none", max_total: int = MAX):
    return recipe.model_from_checkpoint(checkpoint, recipe.Plan(quant=quant, max_total=max_total))


# --------------------------------------------------------------------------------------------------------------------
# The module on the contract == transformers
# --------------------------------------------------------------------------------------------------------------------


def test_prefill_and_decode_match_transformers_logits(ckpt, hf_model, table):
    model = build(ckpt)
    prompt = prompt_of(12, seed=1)  # longer than the sliding window (8): both masks matter
    # One chunk padded to 16: pad positions 12..15 write slots the decode steps then overwrite.
    chunk = prompt + [0] * (BUCKET - len(prompt))
    with torch.no_grad():
        ours = model(H.host_embeds(table, chunk, HIDDEN), *H.contract_tensors(range(BUCKET), MAX, WINDOW))[0]
        ref = hf_model(torch.tensor([prompt]), use_cache=True)
    assert ours.shape == (1, BUCKET, VOCAB) and ours.dtype == torch.float32
    torch.testing.assert_close(capped(ours[0, : len(prompt)]), ref.logits[0], atol=1e-4, rtol=0)

    cache, token, pos = ref.cache, int(ref.logits[0, -1].argmax()), len(prompt)
    for _ in range(6):
        with torch.no_grad():
            ours = model(H.host_embeds(table, [token], HIDDEN), *H.contract_tensors([pos], MAX, WINDOW))[0]
            ref = hf_model(torch.tensor([[token]]), cache=cache, use_cache=True)
        torch.testing.assert_close(capped(ours[0, 0]), ref.logits[0, 0], atol=1e-4, rtol=0)
        cache, token, pos = ref.cache, int(ref.logits[0, -1].argmax()), pos + 1


def test_layer_scalars_come_from_the_checkpoint(ckpt):
    model = build(ckpt)
    got = [float(layer.layer_scalar) for layer in model.layers]
    assert got == pytest.approx(H.LAYER_SCALARS)
    # A parameter, not a buffer: NxD would bake a buffer's init value (1.0) into the graph.
    assert all("layer_scalar" in dict(layer.named_parameters()) for layer in model.layers)


# --------------------------------------------------------------------------------------------------------------------
# Experts: dense == HF sparse, and the per-rank split sums back to it
# --------------------------------------------------------------------------------------------------------------------


def test_dense_experts_split_by_rank_sum_to_transformers_sparse(hf_model):
    layer = hf_model.model.layers[0]
    cfg = hf_model.config
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(3))  # [N, H]
    with torch.no_grad():
        _, weights, index = layer.router(x)  # [N, K] each
        ref = layer.experts(x, index, weights)  # HF's sparse loop, [N, H]

    full = {
        "gate_up_proj": layer.experts.gate_up_proj.detach(),  # [E, 2I, H]
        "down_proj": layer.experts.down_proj.detach(),  # [E, H, I]
    }
    partials = []
    for rank in range(2):
        experts = recipe.DenseExperts(
            cfg.num_experts,
            HIDDEN,
            cfg.moe_intermediate_size,
            layer.experts.act_fn,
            tp=2,
            quant=False,
            dtype=torch.float32,
            coll=recipe.LOCAL,
        )
        local = recipe.shard_state_dict(experts, {**full, "rank": torch.arange(2, dtype=torch.int32)}, rank, 2)
        experts.load_state_dict(local)
        assert experts.gate_up_proj.shape[0] == cfg.num_experts // 2 and int(experts.rank) == rank
        # Rank r sees exactly the routing weights of experts [4r, 4r+4).
        dense = torch.zeros(10, cfg.num_experts).scatter(1, index, weights)  # [N, E]
        torch.testing.assert_close(experts.local_routing_weights(index, weights), dense[:, 4 * rank : 4 * rank + 4])
        with torch.no_grad():
            partials.append(experts(x, index, weights))
    torch.testing.assert_close(partials[0] + partials[1], ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# TP=2 plan: the Neuron-side module per rank (meta build, aliased KV params) with threads for the collectives
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_tp2_ranks_match_single_rank(ckpt, table, quant):
    cfg = recipe.load_text_config(ckpt)
    plan = recipe.Plan(tp=2, quant=quant, max_total=MAX, kv_as_params=True, inplace_kv=False)
    template = recipe.build_model(cfg, plan, device="meta")
    full = recipe.convert_checkpoint(recipe.CheckpointReader(ckpt), template)
    group = H.ThreadGroup(2)
    ranks = []
    for rank in range(2):
        module = recipe.build_device_module(cfg, plan, group.collectives(rank, recipe))
        ranks.append(recipe.load_rank(module, full, rank))

    r0 = ranks[0]
    # The plan: sliding attention split by heads, global attention whole, experts / MLP / lm_head split.
    assert r0.layers[0].self_attn.q_proj.mode == "col" and r0.layers[0].self_attn.k_cache.shape[1] == 1
    assert r0.layers[1].self_attn.q_proj.mode == "replicated" and r0.layers[1].self_attn.k_cache.shape[1] == 1
    assert r0.layers[0].experts.num_local == 4 and [int(m.layers[0].experts.rank) for m in ranks] == [0, 1]
    lm = r0.lm_head.qweight if quant == "int8" else r0.lm_head.weight
    assert lm.shape[0] == VOCAB // 2
    aliases = r0.state_aliases()
    assert sorted(aliases.values()) == list(range(1, 1 + 2 * len(r0.layers)))
    assert all(isinstance(t, torch.nn.Parameter) for t in aliases)

    single = build(ckpt, quant)
    prompt = prompt_of(20, seed=2)  # two chunks, the second padded
    tokens_tp, rows_tp = H.greedy(H.tp_step(ranks), table, prompt, 6, **DRIVE)
    tokens_1, rows_1 = H.greedy(H.first_output(single), table, prompt, 6, **DRIVE)
    assert tokens_tp == tokens_1
    torch.testing.assert_close(torch.stack(rows_tp), torch.stack(rows_1), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# The int8 squeeze
# --------------------------------------------------------------------------------------------------------------------


def _quantized_pairs(model):
    """(float param name, int8 tensor, scale, checkpoint name) for every quantized weight of the module."""
    for name, module in model.named_modules():
        if isinstance(module, recipe.ShardLinear) and module.quant:
            src = "model.embed_tokens.weight" if name == "lm_head" else f"model.{name}.weight"
            yield f"{name}.weight", module.qweight, module.scale, src
        elif isinstance(module, recipe.DenseExperts) and module.quant:
            for part in ("gate_up", "down"):
                q, scale = getattr(module, f"{part}_qweight"), getattr(module, f"{part}_scale")
                yield f"{name}.{part}_proj", q, scale, f"model.{name}.{part}_proj"


def test_int8_covers_experts_mlp_lm_head_within_half_a_step(ckpt, hf_model):
    model = build(ckpt, "int8")
    reference = hf_model.state_dict()
    pairs = list(_quantized_pairs(model))
    kinds = {"lm_head" if n == "lm_head.weight" else n.split(".", 2)[2].removesuffix(".weight") for n, *_ in pairs}
    assert kinds == {"lm_head", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "experts.gate_up_proj", "experts.down_proj"}
    assert len(pairs) == 5 * len(model.layers) + 1
    for name, q, scale, src in pairs:
        w = reference[src].float()  # [..., out, in]
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        # Symmetric per row: scale = max|row| / 127 and the rounding error is at most half a step.
        torch.testing.assert_close(scale, w.abs().amax(dim=-1) / 127, atol=0, rtol=1e-6)
        err = (w - recipe.dequantize(q, scale)).abs()
        bound = scale.unsqueeze(-1) / 2 * (1 + 1e-5)  # slack for the f32 rounding of w / scale and q * scale
        assert bool((err <= bound).all()), f"{name}: {float((err - bound).max())} past scale/2"
    # Attention (and router) stay in the compute dtype.
    assert all(not m.quant for n, m in model.named_modules() if isinstance(m, recipe.ShardLinear) and "self_attn" in n)


def test_int8_graph_is_the_float_graph_on_dequantized_weights(ckpt, table):
    """Together with the bound above: int8 changes the weights by <= scale/2 and nothing else."""
    q8, ref = build(ckpt, "int8"), build(ckpt)
    state = ref.state_dict()
    for name, q, scale, _ in _quantized_pairs(q8):
        state[name] = recipe.dequantize(q, scale)
    ref.load_state_dict(state)
    inputs = (H.host_embeds(table, prompt_of(BUCKET, seed=4), HIDDEN), *H.contract_tensors(range(BUCKET), MAX, WINDOW))
    with torch.no_grad():
        torch.testing.assert_close(q8(*inputs)[0], ref(*inputs)[0], atol=2e-5, rtol=0)


def test_int8_greedy_matches_unquantized_over_32_steps(grid_ckpt, table):
    # On a random 4-layer model, 0.6% weight noise grows chaotically to logit errors as large as the top-1/top-2
    # gaps, so greedy agreement off the grid says nothing either way (the two tests above bound int8 exactly).
    # Here the tiny model's quantized weights sit on an int8 grid: the unquantized reference is the same function,
    # and 32 greedy steps check that the int8 graph realises it (storage, scales, dequant placement, lm_head).
    from safetensors.torch import load_file

    emb = load_file(grid_ckpt / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(emb, table)  # really a different (snapped) model
    prompt = prompt_of(20, seed=5)
    tokens_f, rows_f = H.greedy(H.first_output(build(grid_ckpt)), emb, prompt, 32, **DRIVE)
    tokens_q, rows_q = H.greedy(H.first_output(build(grid_ckpt, "int8")), emb, prompt, 32, **DRIVE)
    assert tokens_q == tokens_f
    assert len(set(tokens_f)) > 4  # a real trajectory, not one token repeated
    torch.testing.assert_close(torch.stack(rows_q), torch.stack(rows_f), atol=1e-4, rtol=0)


def test_traced_int8_graph_matches_the_eager_module(ckpt, table):
    """The int8 ops (int8 -> compute dtype casts, f32 scales) survive torch.jit tracing, prefill and decode."""
    cfg = recipe.load_text_config(ckpt)
    eager, to_trace = build(ckpt, "int8"), build(ckpt, "int8")
    graph = recipe.trace_cpu(to_trace, cfg, BUCKET)
    prompt = prompt_of(BUCKET + 3, seed=7)
    tokens_g, rows_g = H.greedy(H.first_output(graph), table, prompt, 4, **DRIVE)
    tokens_e, rows_e = H.greedy(H.first_output(eager), table, prompt, 4, **DRIVE)
    assert tokens_g == tokens_e
    torch.testing.assert_close(torch.stack(rows_g), torch.stack(rows_e), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# --target cpu: the artifact directory, driven like graphs/jit.py drives a graph
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cpu_artifacts(tmp_path_factory, ckpt) -> Path:
    out = tmp_path_factory.mktemp("artifacts")
    cmd = [
        sys.executable,
        str(H.SCRIPT),
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
        "--target",
        "cpu",
        "--max-total",
        str(MAX),
        "--prefill-bucket",
        str(BUCKET),
        "--quant",
        "none",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def test_cpu_target_writes_the_artifact_set(cpu_artifacts, ckpt, table):
    assert json.loads((cpu_artifacts / "graph.json").read_text()) == {
        "contract": "gemma4-optb/v1",
        "max_total": MAX,
        "prefill_bucket": BUCKET,
        "input_dtype": "float32",
        "tp": 1,
        "softcap_in_graph": False,
        "sliding_window": WINDOW,
        "graph_file": "model.pt",
        "quant": "none",
    }
    cfg_files = sorted(p.name for p in (cpu_artifacts / "cfg").iterdir())
    assert cfg_files == ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer_config.json"]
    assert (cpu_artifacts / "cfg" / "config.json").read_text() == (ckpt / "config.json").read_text()
    emb = torch.load(cpu_artifacts / "embed_tokens.pt", mmap=True, weights_only=True)
    assert emb.dtype == torch.bfloat16 and emb.shape == (VOCAB, HIDDEN)
    assert torch.equal(emb.float(), table)


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_cpu_model_pt_greedy_matches_transformers_generate(cpu_artifacts, hf_model):
    graph = torch.jit.load(str(cpu_artifacts / "model.pt"))
    emb = torch.load(cpu_artifacts / "embed_tokens.pt", mmap=True, weights_only=True)
    prompt = prompt_of(37, seed=6)  # 3 chunks of 16, the last one padded (5 real + 11 pads)
    new = 20

    outputs: list[tuple] = []

    def step(*inputs):
        with torch.no_grad():
            out = graph(*inputs)
        outputs.append(out)
        return out[0]

    tokens, rows = H.greedy(step, emb, prompt, new, **DRIVE)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    assert tokens == ref[0, len(prompt) :].tolist()
    # The comparison means something only if no step was a near-tie at float noise level.
    margins = [float(r.topk(2).values[0] - r.topk(2).values[1]) for r in rows]
    assert min(margins) > 1e-4

    first = outputs[0]
    assert isinstance(first, tuple) and len(first) == 1 + 2 * H.TINY["num_hidden_layers"]
    assert first[0].shape == (1, BUCKET, VOCAB) and first[0].dtype == torch.float32
    assert outputs[-1][0].shape == (1, 1, VOCAB)
    # Like ModelBuilder's shape router: an unknown T is refused (TorchScript raises torch.jit.Error).
    with pytest.raises((RuntimeError, torch.jit.Error), match="no graph for this input shape"):
        graph(H.host_embeds(emb, [1, 2, 3], HIDDEN), *H.contract_tensors([0, 1, 2], MAX, WINDOW))


# --------------------------------------------------------------------------------------------------------------------
# Residency of the real 26B-A4B from its config
# --------------------------------------------------------------------------------------------------------------------

# The 26B-A4B config of the published build: the tests' own record of it (tests/support/configs.py).


@pytest.mark.parametrize(
    ("tp", "quant", "experts_gb", "lm_head_gb"),
    [(1, "none", 45.6, 1.48), (2, "int8", 11.4, 0.37)],
)
def test_residency_of_26b_a4b(tmp_path, capsys, tp, quant, experts_gb, lm_head_gb):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA4_26B_A4B))
    assert recipe.main(["--residency", "--config", str(config), "--tp", str(tp), "--quant", quant, "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    sizes = json.loads(last)
    scratch = {"prefill_scratch_estimate", "prefill_scratch_logits", "prefill_scratch_attention",
               "prefill_scratch_activations", *({"prefill_experts_partials"} if quant == "int8" else ())}
    assert set(sizes) == {"experts", "attention", "shared_mlp", "lm_head", "other", "kv_cache", "total", *scratch}
    assert sizes["experts"] == pytest.approx(experts_gb * 1e9, rel=0.05)
    assert sizes["lm_head"] == pytest.approx(lm_head_gb * 1e9, rel=0.05)
    assert sizes["total"] == sum(v for k, v in sizes.items() if k not in ("total", *scratch))
    if quant == "int8":
        assert 12 * 2**30 <= sizes["total"] <= 13 * 2**30  # "~12-13 GB" per rank: fits a 16 GB core


@pytest.mark.parametrize(("max_total", "kv_gb", "total_gb"), [(8192, 0.336, 13.80), (32768, 0.839, 14.31)])
def test_residency_of_26b_a4b_contract_v2(tmp_path, capsys, max_total, kv_gb, total_gb):
    """v2's rings: 25 sliding layers keep window + largest bucket slots, the 5 global layers MAX + largest bucket."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA4_26B_A4B))
    assert recipe.main(["--residency", "--json", "--config", str(config), "--tp", "2", "--quant", "int8",
                        "--contract", "v2", "--prefill-buckets", "128,512", "--max-total", str(max_total)]) == 0
    sizes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    head_dim, global_dim, window, b = 256, 512, 1024, 512
    sliding = 25 * 2 * (8 // 2) * (window + b) * head_dim * 2  # K and V, 4 kv heads per rank, bf16
    global_ = 5 * 2 * 2 * (max_total + b) * global_dim * 2  # 2 kv heads, replicated
    assert sizes["kv_cache"] == sliding + global_
    assert sizes["kv_cache"] == pytest.approx(kv_gb * 1e9, rel=0.01)
    assert sizes["total"] == pytest.approx(total_gb * 1e9, rel=0.01)


# --------------------------------------------------------------------------------------------------------------------
# The Neuron layer stays thin and lazy; the script stays standalone
# --------------------------------------------------------------------------------------------------------------------


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    return []


def test_script_is_standalone_and_imports_neuron_lazily():
    tree = ast.parse(H.SCRIPT.read_text())
    top_level = {m.split(".")[0] for node in tree.body for m in _imports(node)}
    assert top_level <= {"__future__", "argparse", "collections", "copy", "dataclasses", "functools", "json",
                         "pathlib", "shutil", "sys", "torch", "warnings"}  # fmt: skip
    everywhere = [m for node in ast.walk(tree) for m in _imports(node)]
    assert not [m for m in everywhere if m == "server" or m.startswith("server.")]
    neuron_importers = {
        func.name
        for func in ast.walk(tree)
        if isinstance(func, ast.FunctionDef)
        for node in ast.walk(func)
        for m in _imports(node)
        if m.startswith(("torch_neuronx", "neuronx_distributed"))
    }
    assert neuron_importers == {"import_neuron"}  # the one door to the Neuron stack, called by --target neuron only


def test_neuron_target_fails_cleanly_without_the_neuron_stack(ckpt, tmp_path):
    if importlib.util.find_spec("torch_neuronx") is not None:
        pytest.skip("the Neuron stack is installed here")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="torch-neuronx"):
        recipe.main(["--checkpoint", str(ckpt), "--out", str(out), "--target", "neuron"])
    assert not out.exists()  # nothing half-written
