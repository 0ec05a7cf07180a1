"""`ModelStructure`: derived through the model's own (meta-device) modules, cached by the config files' bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server.model.structure import ModelStructure
from tests.support.configs import GEMMA4_26B_A4B


def cfg_dir(root: Path, **overrides: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({**GEMMA4_26B_A4B, **overrides}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106], "top_k": 64, "top_p": 0.95}))
    return root


def test_the_26b_structure_comes_from_its_modules(tmp_path: Path) -> None:
    structure = ModelStructure.derive(cfg_dir(tmp_path / "cfg"))
    assert structure.embed_scale == pytest.approx(2816**0.5)
    assert (structure.vocab_size, structure.hidden_size, structure.num_layers) == (262144, 2816, 30)
    assert structure.final_softcap == 30.0 and structure.eos_token_ids == (1, 106)
    assert structure.generation_defaults == {"top_k": 64, "top_p": 0.95}


def test_a_cached_structure_equals_the_derived_one(tmp_path: Path) -> None:
    cfg, cache = cfg_dir(tmp_path / "cfg"), tmp_path / "cache"
    first = ModelStructure.from_dir(cfg, cache)
    assert len(list((cache / "structure").glob("*.json"))) == 1
    assert ModelStructure.from_dir(cfg, cache) == first == ModelStructure.derive(cfg)


def test_the_cached_start_does_not_import_transformers(tmp_path: Path) -> None:
    cfg, cache = cfg_dir(tmp_path / "cfg"), tmp_path / "cache"
    ModelStructure.from_dir(cfg, cache)
    code = ("import sys; from server.model.structure import ModelStructure as M; "
            f"s = M.from_dir({str(cfg)!r}, __import__('pathlib').Path({str(cache)!r})); "
            "print(s.embed_scale, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parent.parent).stdout.split()
    assert float(out[0]) == pytest.approx(2816**0.5) and out[1] == "False"


def test_an_edited_config_is_derived_again(tmp_path: Path) -> None:
    cfg, cache = cfg_dir(tmp_path / "cfg"), tmp_path / "cache"
    ModelStructure.from_dir(cfg, cache)
    cfg_dir(cfg, hidden_size=1024)
    edited = ModelStructure.from_dir(cfg, cache)
    assert edited.embed_scale == pytest.approx(1024**0.5) and edited.hidden_size == 1024
    assert len(list((cache / "structure").glob("*.json"))) == 2


def test_a_broken_cache_is_never_fatal(tmp_path: Path) -> None:
    cfg = cfg_dir(tmp_path / "cfg")
    derived = ModelStructure.derive(cfg)
    # A cache directory that cannot be created (a file is in the way): derive, warn, serve.
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    assert ModelStructure.from_dir(cfg, blocked) == derived
    # A truncated entry (say, a disk that filled up before the atomic rename existed): derive again and rewrite it.
    cache = tmp_path / "cache"
    ModelStructure.from_dir(cfg, cache)
    (entry,) = (cache / "structure").glob("*.json")
    entry.write_text(entry.read_text()[:20])
    assert ModelStructure.from_dir(cfg, cache) == derived
    assert ModelStructure.from_json(entry.read_text()) == derived
