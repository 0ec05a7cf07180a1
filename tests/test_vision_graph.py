"""Issue 27, the device side: the recipe's `--vision` graph and its block-aware prefill, against transformers.

A tiny random `Gemma4ForConditionalGeneration` (tests/support/vision.py's builder; the text part is the recipe tests'
TINY config with `use_bidirectional_attention="vision"`; the tiny tower has standardize and clipped linears on so
every weight kind is loaded) is built by the recipe (`--target cpu --vision`) as a v2 and a v3 artifact. Then:

- the traced vision graph (`load_vision_graph`) equals `get_image_features(...).pooler_output` at each built budget,
  for images of two aspects;
- the block-aware prefill (`block_ids`) of both builds equals transformers' language model run with the masks of
  `create_masks_for_vision_model` at every position, and differs from the causal-only mask; decode steps after it
  (past the sliding ring's wrap: the v3 ring is read per row) equal transformers too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.graphs.jit import JitGraphV2, JitGraphV3
from server.graphs.vision import load_vision_graph
from server.model.artifacts import GraphSpec
from tests.support.recipe_helpers import SCRIPT, TINY, load_recipe
from tests.support.vision import tiny_vision_config
from tests.support.vision import tiny_vision_model as build_vision_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BUDGETS = (70, 280)
BUCKETS = (8, 32)
MAX = 128
WINDOW = TINY["sliding_window"]  # 8: an image block of 12 tokens is longer than the window
# The tower differs from tests/support/vision.py's on purpose: standardize and clipped linears on, so every weight
# kind is loaded; patches of 4 pixels, so small test images give many patches.
TINY_VISION = dict(intermediate_size=48, patch_size=4, position_embedding_size=256, standardize=True,
                   use_clipped_linears=True)


def tiny_vision_model(seed: int = 0):
    """A random tiny Gemma4ForConditionalGeneration (the recipe tests' TINY text model, tests/support/vision.py's
    builder) whose tower uses every weight kind (clip bounds, std)."""
    config = tiny_vision_config(TINY, **TINY_VISION)
    config._attn_implementation = "eager"
    model = build_vision_model(config, seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("std_bias"):
                buf.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                buf.uniform_(0.5, 1.5)
            elif name.endswith("input_min"):
                buf.fill_(-2.5)
            elif name.endswith("output_max"):
                buf.fill_(1.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("vision") / "checkpoint"
    model = tiny_vision_model()
    with torch.no_grad():
        emb = model.model.language_model.embed_tokens.weight
        emb.copy_(emb.to(torch.bfloat16).float())  # the artifact's table is bf16 (tied: the lm_head too)
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.config.text_config._attn_implementation = "eager"
    return model


def build(checkpoint: Path, out: Path, contract: str) -> Path:
    extra = ["--kv-slots", "2", "--decode-batches", "1,2"] if contract == "v3" else []
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
         "--contract", contract, "--max-total", str(MAX), "--prefill-buckets", ",".join(map(str, BUCKETS)),
         "--quant", "none", "--weights", "separate", "--vision", "--vision-budgets", ",".join(map(str, BUDGETS)),
         # every row of every prefill graph: these tests hold the block-aware prefill to transformers at each
         # position of an image block (a last-row build scores at its smallest bucket and refuses a split image)
         "--prefill-logits", "all", *extra],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def artifacts(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {c: build(checkpoint, tmp_path_factory.mktemp(f"vision-{c}") / "artifacts", c) for c in ("v2", "v3")}


def spec_of(root: Path) -> GraphSpec:
    return GraphSpec.from_json(json.loads((root / "graph.json").read_text()))


def test_graph_json_declares_the_vision_graph_and_block_ids(artifacts: dict[str, Path]) -> None:
    for contract, root in artifacts.items():
        record = json.loads((root / "graph.json").read_text())
        vision = record["vision"]
        assert vision["budgets"] == list(BUDGETS)
        assert vision["patch_rows"] == {str(b): b * 9 for b in BUDGETS}
        assert vision["hidden"] == TINY["hidden_size"] and vision["sharded"] is False  # a tiny tower: replicated
        assert all((root / f).is_file() for f in [vision["graph_file"], *vision["weight_files"]])
        assert record["inputs"]["block_ids"] == ["int64", [1, "T"]]
        assert record["block_ids"]["bidirectional_layers"] == ["sliding_attention"], contract
        spec = spec_of(root)
        assert spec.block_ids and spec.vision is not None and spec.vision.budgets == BUDGETS
        assert GraphSpec.from_json(spec.to_json()).vision == spec.vision


@pytest.mark.parametrize("aspect", [(1, 1), (3, 2)])
def test_vision_graph_equals_get_image_features(artifacts: dict[str, Path], reference, aspect: tuple[int, int]) -> None:
    recipe = load_recipe()
    root = artifacts["v3"]
    encoder = load_vision_graph(root, spec_of(root))
    assert encoder.budgets == BUDGETS
    vcfg = reference.config.vision_config
    for budget in BUDGETS:
        pixels, positions = recipe.vision_example(vcfg, budget, aspect)  # [1, P, D], [1, P, 2] as the processor pads
        with torch.no_grad():
            (expected,) = reference.model.get_image_features(pixels, positions).pooler_output  # [N, H]
        got = encoder.encode(pixels, positions, budget)
        assert got.shape == expected.shape, budget
        assert expected.shape[0] < budget  # the image leaves pad rows the graph must not return
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="built for"):
        encoder.encode(pixels, positions, 140)


def test_real_processor_inputs_encode_like_transformers(artifacts: dict[str, Path], reference) -> None:
    """The image processor's own pixel_values / position ids (not our stand-in grid) for two aspects."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    root = artifacts["v2"]
    encoder = load_vision_graph(root, spec_of(root))
    vcfg = reference.config.vision_config
    for size in ((64, 64), (96, 48)):
        image = Image.frombytes("RGB", size, bytes(range(256)) * (size[0] * size[1] * 3 // 256 + 1))
        for budget in BUDGETS:
            processor = Gemma4ImageProcessorPil(patch_size=vcfg.patch_size, max_soft_tokens=budget,
                                                pooling_kernel_size=vcfg.pooling_kernel_size)
            batch = processor(images=[image], return_tensors="pt")
            pixels, positions = batch["pixel_values"], batch["image_position_ids"]
            with torch.no_grad():
                (expected,) = reference.model.get_image_features(pixels, positions).pooler_output
            torch.testing.assert_close(encoder.encode(pixels, positions, budget), expected, rtol=1e-4, atol=1e-5)


# -- the block-aware prefill ----------------------------------------------------------------------------------------


def reference_logits(reference, embeds: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """transformers' language model over the whole sequence ([1, N, H] embeds from position 0) with Gemma-4's vision
    masks (blocks [1, N]: 0 text, > 0 an image, as our contract; None: causal only) -> raw logits [N, V]."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gemma4.modeling_gemma4 import create_masks_for_vision_model

    lm = reference.model.language_model
    config = reference.config.text_config
    positions = torch.arange(embeds.shape[1])[None]  # [1, N]
    kwargs = dict(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
    if blocks is None:
        from transformers.masking_utils import create_sliding_window_causal_mask

        masks = {"full_attention": create_causal_mask(**kwargs), "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
    else:
        block_sequence_ids = torch.where(blocks > 0, blocks - 1, -1)  # transformers: -1 text, group ids from 0
        masks = create_masks_for_vision_model(block_sequence_ids=block_sequence_ids, **kwargs)
    with torch.no_grad():
        hidden = lm(inputs_embeds=embeds, attention_mask=masks, position_ids=positions, use_cache=False).last_hidden_state
        return reference.lm_head(hidden)[0].float()  # [N, V], no soft-cap (the host applies it, as the graph's)


def image_prompt(reference, length: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, N, H] embeds (text rows from the table x scale, image rows random at their scale) and block ids [1, N]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (1, length), generator=gen)
    with torch.no_grad():
        embeds = reference.model.language_model.embed_tokens(ids).float()  # [1, N, H] x sqrt(H)
    start, end = block
    embeds[:, start:end] = torch.randn(1, end - start, embeds.shape[2], generator=gen) * TINY["hidden_size"] ** 0.5 * 0.3
    blocks = torch.zeros(1, length, dtype=torch.int64)
    blocks[:, start:end] = 1
    return embeds, blocks


def graph_of(artifacts: dict[str, Path], contract: str):
    root = artifacts[contract]
    spec = spec_of(root)
    cls = JitGraphV3 if contract == "v3" else JitGraphV2
    return cls(root / spec.graph_file, spec, vocab_size=TINY["vocab_size"], final_softcap=30.0)


@pytest.mark.parametrize("contract", ["v2", "v3"])
def test_block_aware_prefill_and_decode_match_transformers(artifacts: dict[str, Path], reference, contract: str) -> None:
    graph = graph_of(artifacts, contract)
    assert graph.image_blocks
    slot = 1 if contract == "v3" else 0
    # 50 tokens: chunk 0..31 (a bucket of 32) then 32..49 (18 on the 32 bucket); an image of 12 tokens (longer than
    # the window of 8) inside the second chunk, then text. Decode to 100: past the ring of 8 + 32 = 40, twice.
    length, block, steps = 50, (35, 47), 50
    embeds, blocks = image_prompt(reference, length, block, seed=1)
    positions = torch.arange(length)[None]
    chunks = [(0, 32), (32, length)]
    got = []
    for a, b in chunks:
        got.append(graph.prefill(embeds[:, a:b], positions[:, a:b], slot, block_ids=blocks[:, a:b])[0])  # [T, V]
    got_prefill = torch.cat(got)  # [N, V]
    expected = reference_logits(reference, embeds, blocks)
    torch.testing.assert_close(got_prefill, expected, rtol=1e-4, atol=2e-4)
    causal = reference_logits(reference, embeds, None)
    # The image block's rows (and what reads them) change with the mask: a causal-only graph would be wrong.
    assert (expected[block[0]:] - causal[block[0]:]).abs().max() > 1e-2
    assert (got_prefill - causal).abs().max() > 1e-2
    # Decode: greedy tokens, each embedded from the table, checked against one full forward at the end.
    sequence = embeds
    token = int(got_prefill[-1].argmax())
    decoded = []
    for step in range(steps):
        with torch.no_grad():
            row = reference.model.language_model.embed_tokens(torch.tensor([[token]])).float()  # [1, 1, H]
        sequence = torch.cat([sequence, row], dim=1)
        position = torch.tensor([[length + step]])
        if contract == "v3":
            logits = graph.decode(row, position, [slot])[0]  # [V]
        else:
            logits = graph.forward(row, position, last_only=True)[0, 0]  # [V]
        decoded.append(logits)
        token = int(logits.argmax())
    assert length + steps > 2 * (WINDOW + max(BUCKETS))  # the sliding ring wrapped, twice
    full_blocks = torch.cat([blocks, torch.zeros(1, steps, dtype=torch.int64)], dim=1)
    expected_all = reference_logits(reference, sequence, full_blocks)  # [N + steps, V]
    torch.testing.assert_close(torch.stack(decoded), expected_all[length - 1 + 1 : length + steps], rtol=1e-4, atol=2e-4)


def test_v3_block_prefill_in_one_slot_leaves_the_other_alone(artifacts: dict[str, Path], reference) -> None:
    """Two slots, one with an image, one text only, each prefilled and then decoded together (B = 2): every row reads
    its own ring and its own block mask."""
    graph = graph_of(artifacts, "v3")
    image, image_blocks = image_prompt(reference, 30, (4, 20), seed=2)
    text, _ = image_prompt(reference, 20, (0, 0), seed=3)
    first_image = graph.prefill(image, torch.arange(30)[None], 0, block_ids=image_blocks)[0]
    first_text = graph.prefill(text, torch.arange(20)[None], 1)[0]
    torch.testing.assert_close(first_image, reference_logits(reference, image, image_blocks), rtol=1e-4, atol=2e-4)
    torch.testing.assert_close(first_text, reference_logits(reference, text, None), rtol=1e-4, atol=2e-4)
    rows = [image, text]
    blocks = [image_blocks, torch.zeros(1, 20, dtype=torch.int64)]
    tokens = [int(first_image[-1].argmax()), int(first_text[-1].argmax())]
    for _ in range(12):
        with torch.no_grad():
            new = [reference.model.language_model.embed_tokens(torch.tensor([[t]])).float() for t in tokens]
        positions = torch.tensor([[rows[0].shape[1]], [rows[1].shape[1]]])
        logits = graph.decode(torch.cat(new), positions, [0, 1])  # [2, V]
        rows = [torch.cat([r, n], dim=1) for r, n in zip(rows, new, strict=True)]
        blocks = [torch.cat([b, torch.zeros(1, 1, dtype=torch.int64)], dim=1) for b in blocks]
        for r in range(2):
            expected = reference_logits(reference, rows[r], blocks[r])[-1]
            torch.testing.assert_close(logits[r], expected, rtol=1e-4, atol=2e-4)
        tokens = [int(x.argmax()) for x in logits]


def test_block_ids_are_checked_and_a_graph_without_them_refuses_an_image(artifacts: dict[str, Path],
                                                                        reference) -> None:
    graph = graph_of(artifacts, "v2")
    hidden = TINY["hidden_size"]
    with pytest.raises(ValueError, match="block_ids must be"):
        graph.prefill(torch.zeros(1, 4, hidden), torch.arange(4)[None], 0, block_ids=torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="decode step"):
        graph.forward(torch.zeros(1, 1, hidden), torch.tensor([[0]]), block_ids=torch.ones(1, 1, dtype=torch.int64))
    # graph.json of a build without --vision (no block_ids, no vision): it loads, prefills text as it always did, and
    # refuses ids that name an image rather than attend causally where the model attends both ways.
    root = artifacts["v2"]
    record = json.loads((root / "graph.json").read_text())
    for key in ("block_ids", "vision"):
        record.pop(key)
    record["inputs"].pop("block_ids")
    old = GraphSpec.from_json(record)
    assert not old.block_ids and old.vision is None
    with pytest.raises(ValueError, match="declares no vision graph"):
        load_vision_graph(root, old)
    text_only = JitGraphV2(root / old.graph_file, old, vocab_size=TINY["vocab_size"], final_softcap=30.0)
    assert not text_only.image_blocks
    embeds, _ = image_prompt(reference, 10, (0, 0), seed=4)
    zeros = torch.zeros(1, 10, dtype=torch.int64)
    torch.testing.assert_close(text_only.prefill(embeds, torch.arange(10)[None], 0, block_ids=zeros)[0],
                               reference_logits(reference, embeds, None), rtol=1e-4, atol=2e-4)
    with pytest.raises(ValueError, match="built without --vision"):
        text_only.prefill(embeds, torch.arange(10)[None], 0, block_ids=zeros + 1)


def test_tp2_sharded_tower_equals_transformers(reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TP split of the tower (heads and MLP over 2 ranks, threads exchanging partial sums as NxD's collectives
    would) gives transformers' soft tokens on every rank. The tiny tower is below the bytes that make the recipe shard
    it (`vision_sharded`), so the threshold is lowered here; the 26B's tower is sharded by the bytes alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.recipe_helpers import ThreadGroup

    recipe = load_recipe()
    vcfg, tcfg = reference.config.vision_config, reference.config.text_config
    assert not recipe.vision_sharded(vcfg, 2)
    monkeypatch.setattr(recipe, "VISION_SHARD_MIN_BYTES", 0)
    assert recipe.vision_sharded(vcfg, 2)
    template = recipe.build_vision(vcfg, tcfg, recipe.Plan(tp=2), device="meta")
    state = reference.model.state_dict()
    full = {name: state[name] for name, _ in template.named_parameters()}
    group = ThreadGroup(2)
    ranks = []
    for rank in range(2):
        tower = recipe.build_vision(vcfg, tcfg, recipe.Plan(tp=2), group.collectives(rank, recipe))
        missing, unexpected = tower.load_state_dict(recipe.shard_state_dict(tower, full, rank, 2), strict=False)
        assert not missing and not unexpected
        ranks.append(tower)
    assert ranks[0].vision_tower.encoder.layers[0].self_attn.q_proj.linear.weight.shape[0] == 16  # half the heads
    pixels, positions = recipe.vision_example(vcfg, 70, (3, 2))
    with torch.no_grad():
        (expected,) = reference.model.get_image_features(pixels, positions).pooler_output
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda tower: tower(pixels, positions)[0], ranks))
    for out in outs:
        torch.testing.assert_close(out[: expected.shape[0]], expected, rtol=1e-4, atol=1e-5)


def test_vision_residency_counts_every_weight_of_the_26b_tower() -> None:
    """--residency --vision counts exactly transformers' tower + embed_vision (built on meta, in bf16), replicated;
    sharded (the 26B's choice by bytes at tp=2) it holds half of every layer linear and all of the rest."""
    from accelerate import init_empty_weights
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    from tests.support.configs import GEMMA4_26B_A4B

    recipe = load_recipe()
    text = recipe.text_config_from_dict(GEMMA4_26B_A4B)
    vcfg = Gemma4VisionConfig(**recipe.VISION_26B)
    with init_empty_weights(include_buffers=True):
        modules = [Gemma4VisionModel(vcfg), Gemma4MultimodalEmbedder(vcfg, text)]
    expected = 2 * sum(t.numel() for m in modules for t in m.state_dict().values())  # bf16 weights, checkpoint keys
    replicated = recipe.vision_residency(vcfg, text, 2, vision_tp="replicated")
    assert replicated["vision"] == expected and not replicated["vision_sharded"]
    sharded = recipe.vision_residency(vcfg, text, 2)  # auto: the bytes choose
    assert sharded["vision_sharded"]
    linears = vcfg.num_hidden_layers * (4 * vcfg.hidden_size**2 + 3 * vcfg.hidden_size * vcfg.intermediate_size)
    assert vcfg.num_attention_heads * vcfg.head_dim == vcfg.hidden_size
    assert replicated["vision"] - sharded["vision"] == 2 * linears // 2  # bf16, half of every layer linear
    assert 0.54e9 < replicated["vision"] - sharded["vision"] < 0.55e9  # 0.545 GB per rank freed (recipe.md)
