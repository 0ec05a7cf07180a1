"""HostEmbedding is bit-identical to the model's own scaled embedding module, from every accepted file format; the
engine has its table's file read through into the page cache once the graph is loaded (`warm`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

from server.model.embedding import HostEmbedding, open_table
from tests.support.api_fixtures import live_server, null_host, settings
from tests.support.wait import wait_until


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_is_bit_identical_to_gemma4_scaled_embedding(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    vocab, hidden = 1000, 2816  # the 26B's hidden size: sqrt(2816) = 53.07 rounds to 53.0 in bf16
    module = Gemma4TextScaledWordEmbedding(vocab, hidden, padding_idx=0, embed_scale=hidden**0.5)
    with torch.no_grad():
        module.weight.normal_()
    module = module.to(dtype)
    ids = torch.tensor([[5, 17, 999, 0, 5]])

    host = HostEmbedding(module.weight.detach(), module.scalar_embed_scale)
    expected = module(ids)  # [1, T, H]
    got = host.lookup(ids)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


def test_bf16_table_computed_in_f32_matches_an_f32_model() -> None:
    """The published graph takes f32 embeds from a bf16 table: same as the module run in f32 on those rows."""
    torch.manual_seed(1)
    table = torch.randn(300, 64).to(torch.bfloat16)
    module = Gemma4TextScaledWordEmbedding(300, 64, padding_idx=0, embed_scale=64**0.5)
    with torch.no_grad():
        module.weight.copy_(table.float())
    ids = torch.tensor([1, 2, 299])
    got = HostEmbedding(table, module.scalar_embed_scale, torch.float32).lookup(ids)
    assert got.dtype == torch.float32
    assert torch.equal(got, module(ids[None]))


@pytest.mark.parametrize(("table_dtype", "dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_the_one_token_decode_lookup_equals_the_general_one(table_dtype: torch.dtype, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    host = HostEmbedding(torch.randn(300, 2816).to(table_dtype), 2816**0.5, dtype)
    for token in (0, 7, 299):
        got = host.lookup([token])
        assert got.shape == (1, 1, 2816) and got.dtype == dtype
        assert torch.equal(got, host.lookup(torch.tensor([token])))


def test_missing_scale_is_what_breaks_the_model() -> None:
    table = torch.randn(10, 16)
    scaled = HostEmbedding(table, 16**0.5).lookup([3])
    unscaled = HostEmbedding(table, 1.0).lookup([3])
    assert torch.allclose(scaled, unscaled * 4.0)


@pytest.mark.parametrize("layout", ["bare", "dict", "safetensors"])
def test_table_formats_open_memory_mapped(tmp_path: Path, layout: str) -> None:
    table = torch.randn(50, 8).to(torch.bfloat16)
    if layout == "bare":
        path = tmp_path / "embed_tokens.pt"
        torch.save(table, path)
    elif layout == "dict":
        path = tmp_path / "embed_tokens.pt"
        torch.save({"weight": table}, path)
    else:
        path = tmp_path / "embed_tokens.safetensors"
        save_file({"weight": table}, str(path))
    opened = open_table(path)
    assert opened.shape == (50, 8) and opened.dtype == torch.bfloat16
    assert torch.equal(opened, table)
    assert _mapped_file(opened.data_ptr()) == str(path.resolve()), "the table must be a view of the file, not a copy"


def _mapped_file(address: int) -> str | None:
    """The file backing the memory mapping that holds `address` (Linux /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) == 6 else None
    return None


def test_a_dict_without_weight_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "embed_tokens.pt"
    torch.save({"embedding": torch.zeros(2, 2), "other": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="weight"):
        open_table(path)


@pytest.mark.parametrize("layout", ["pt", "safetensors"])
def test_warm_reads_the_tables_file_through(tmp_path: Path, layout: str) -> None:
    table = torch.randn(3000, 64).to(torch.bfloat16)  # 384 KB
    path = tmp_path / f"embed_tokens.{layout}"
    torch.save(table, path) if layout == "pt" else save_file({"weight": table}, str(path))
    embedding = HostEmbedding.open(path, 2.0)
    thread = embedding.warm()
    assert thread is not None and thread.daemon
    thread.join(30)
    assert embedding.warmed == path.stat().st_size
    assert torch.equal(embedding.lookup([5]), table[5:6].unsqueeze(0) * 2.0)  # the table is as it was
    assert HostEmbedding(table, 2.0).warm() is None  # no file behind it: nothing to read


def test_the_engine_warms_the_table_once_loaded() -> None:
    shared = null_host()  # the suite's shared host: its table may have been warmed by another test's engine
    assert shared.embedding.source is not None
    embedding = HostEmbedding.open(shared.embedding.source, float(shared.embedding.scale), shared.embedding.dtype)
    host = dataclasses.replace(shared, embedding=embedding)
    assert embedding.warming is None
    with live_server(settings(), host=host):
        size = shared.embedding.source.stat().st_size
        wait_until(lambda: embedding.warmed == size, "the table's file read through", timeout=300)
        assert embedding.warm() is embedding.warming  # once: a second call starts no second read
