"""Artifact validation names every missing or malformed file, and how to get it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from server.errors import ArtifactError
from server.model.artifacts import ArtifactDir, GraphSpec, validate


def _make(root: Path, *, vocab: int = 32, hidden: int = 8, graph: bool = True) -> Path:
    (root / "cfg").mkdir(parents=True)
    (root / "cfg" / "config.json").write_text(json.dumps({"model_type": "gemma4_text", "vocab_size": vocab,
                                                          "hidden_size": hidden}))
    (root / "cfg" / "tokenizer.json").write_text("{}")
    torch.save(torch.zeros(vocab, hidden, dtype=torch.bfloat16), root / "embed_tokens.pt")
    if graph:
        (root / "sqz_neff.pt").write_bytes(b"graph")
    return root


def test_complete_published_layout_validates_with_defaults(tmp_path: Path) -> None:
    art = validate(_make(tmp_path / "a"))
    assert art.resolve_graph("auto") == "jit"
    assert art.graph_spec() == GraphSpec()  # no graph.json: MAX 512, BUCKET 128, f32, soft-cap on host
    assert art.graph_file is not None and art.graph_file.name == "sqz_neff.pt"


def test_every_missing_file_is_named_in_one_error(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(ArtifactError) as info:
        validate(root, "jit")
    message = str(info.value)
    for name in ("cfg/config.json", "tokenizer.json", "embed_tokens.pt", "sqz_neff.pt"):
        assert name in message
    assert "python -m server fetch" in message


def test_missing_directory_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="does not exist.*fetch"):
        validate(tmp_path / "nope")


def test_hf_graph_needs_the_checkpoint(tmp_path: Path) -> None:
    root = _make(tmp_path / "a", graph=False)
    with pytest.raises(ArtifactError, match="hf/config.json.*\n.*model.safetensors"):
        validate(root, "hf")


def test_null_graph_needs_only_cfg_and_table(tmp_path: Path) -> None:
    root = _make(tmp_path / "a", graph=False)
    assert validate(root, "null").resolve_graph("null") == "null"


def test_table_shape_must_match_config(tmp_path: Path) -> None:
    root = _make(tmp_path / "a")
    torch.save(torch.zeros(31, 8), root / "embed_tokens.pt")
    with pytest.raises(ArtifactError, match=r"embed_tokens.pt: shape \(31, 8\) does not match"):
        validate(root)


def test_malformed_files_are_named(tmp_path: Path) -> None:
    root = _make(tmp_path / "a")
    (root / "embed_tokens.pt").write_bytes(b"not a tensor")
    (root / "cfg" / "config.json").write_text("{broken")
    (root / "graph.json").write_text(json.dumps({"max_total": 64, "prefill_bucket": 128}))
    with pytest.raises(ArtifactError) as info:
        validate(root)
    message = str(info.value)
    assert "config.json: not valid JSON" in message
    assert "embed_tokens.pt: cannot be read" in message
    assert "graph.json: malformed" in message


def test_graph_json_names_the_graph_file(tmp_path: Path) -> None:
    root = _make(tmp_path / "a", graph=False)
    (root / "model.pt").write_bytes(b"x")
    spec = GraphSpec(max_total=64, prefill_bucket=16, graph_file="model.pt", tp=1)
    (root / "graph.json").write_text(json.dumps(spec.to_json()))
    art = validate(root)
    assert art.graph_spec() == spec
    assert ArtifactDir(root).graph_file == root / "model.pt"


def test_graph_spec_reads_v1_and_v2() -> None:
    v1 = GraphSpec.from_json({"max_total": 512, "prefill_bucket": 128})  # the published record: no contract, v1
    assert not v1.v2 and v1.buckets == (128,) and v1.weights == "inside"
    v2 = GraphSpec.from_json({"contract": "gemma4-optb/v2", "max_total": 8192, "prefill_buckets": [512, 128],
                              "sliding_window": 1024, "kv_slots": {"sliding_attention": 1536},
                              "weights": "separate", "weight_files": ["weights/tp0_sharded_checkpoint.safetensors"]})
    assert v2.v2 and v2.buckets == (128, 512) and v2.prefill_bucket == 512 and v2.sliding_slots == 1536
    assert GraphSpec.from_json(v2.to_json()) == v2
    with pytest.raises(ValueError, match="weight_files"):
        GraphSpec.from_json({"contract": "gemma4-optb/v2", "weights": "separate"})
    with pytest.raises(ValueError, match="prefill buckets <= max_total"):
        GraphSpec.from_json({"contract": "gemma4-optb/v2", "max_total": 256, "prefill_buckets": [128, 512]})
