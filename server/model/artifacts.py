"""The artifact directory: its layout, the graph spec in `graph.json`, and validation with clear errors.

```
ARTIFACTS/
  cfg/             config.json, generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja
  embed_tokens.pt  [vocab, hidden] table (bf16); embed_tokens.safetensors also accepted
  sqz_neff.pt      compiled graph (Neuron) - or model.pt, the same contract traced for CPU
  graph.json       the contract (absent in the published 26B artifacts: defaults below)
  weights/         v2 --weights separate: tp{rank}_sharded_checkpoint.safetensors, one per rank
  vision.pt        --vision: the vision tower's graph (vision_neff.pt on Neuron); weights/vision/ its per-rank files
  hf/              optional: a transformers checkpoint for the reference graph
  vision.safetensors  optional (`export --vision host`): the vision tower + embed_vision, for `serve --vision host`
```

cfg/preprocessor_config.json (the image processor's settings) is there whenever the model reads images.

torch is imported lazily: `check` must answer fast inside the container entrypoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.errors import ArtifactError

CFG_DIR = "cfg"
HF_DIR = "hf"
GRAPH_JSON = "graph.json"
EMBED_FILES = ("embed_tokens.pt", "embed_tokens.safetensors")
GRAPH_FILES = ("sqz_neff.pt", "model.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
VISION_FILE = "vision.safetensors"  # the host encoder's weights: vision_tower.* and embed_vision.* (issue 27)
PREPROCESSOR_FILE = "preprocessor_config.json"  # in cfg/: the image processor's settings
# ... or, as transformers 5's processors save them (Gemma4Processor.save_pretrained writes only this), the
# `image_processor` entry of processor_config.json
PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILES = (PREPROCESSOR_FILE, PROCESSOR_FILE)
CONTRACT = "gemma4-optb/v1"  # the published build: the host ships one-hot write slots and masks
CONTRACT_V2 = "gemma4-optb/v2"  # embeds + positions; the graph owns its KV rings, masks and write slots
CONTRACT_V3 = "gemma4-optb/v3"  # v2 with S KV slots (slot ids in) and decode graphs over several rows
CONTRACT_V4 = "gemma4-optb/v4"  # v3 with the global layers' KV in a block pool read through per-row block tables
CONTRACTS = (CONTRACT, CONTRACT_V2, CONTRACT_V3, CONTRACT_V4)
# What `fetch` takes from a Hub repo: the artifacts and nothing else (no hf/ checkpoint: 50 GB we never read).
ALLOW_PATTERNS = (f"{CFG_DIR}/*", *EMBED_FILES, *GRAPH_FILES, GRAPH_JSON, "weights/*.safetensors",
                  "vision.pt", "vision_neff.pt", "weights/vision/*.safetensors",  # the --vision tower's graph
                  VISION_FILE)  # export --vision host: the tower for the host encoder
DEFAULT_REPO = "xbill9/gemma-4-26B-A4B-it-inferentia2-xlarge"

_HOW_TO_GET = (
    "Get the published artifacts with `python -m server fetch --repo {repo} --dest {dir}`, "
    "or build a CPU artifact dir with `python -m server export --from CHECKPOINT_OR_GGUF --dest {dir}`."
)


class UnknownContract(ValueError):
    """graph.json names a contract this server does not drive."""


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """graph.json's `vision` (a `--vision` build): the tower's traced graph, the soft-token budgets it is compiled
    for, and its per-rank weight files (memory-mapped, as the language model's `--weights separate`)."""

    budgets: tuple[int, ...]
    graph_file: str
    weight_files: tuple[str, ...]
    pooling_kernel_size: int
    patch_dim: int
    hidden: int

    def patch_rows(self, budget: int) -> int:
        return budget * self.pooling_kernel_size**2

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VisionSpec:
        if not isinstance(data, dict):
            raise TypeError(f"graph.json's vision: expected a JSON object, got {type(data).__name__}")
        spec = cls(budgets=tuple(sorted({int(b) for b in data.get("budgets") or ()})), graph_file=str(data["graph_file"]),
                   weight_files=tuple(str(f) for f in data.get("weight_files") or ()),
                   pooling_kernel_size=int(data["pooling_kernel_size"]), patch_dim=int(data["patch_dim"]),
                   hidden=int(data["hidden"]))
        if not spec.budgets or not spec.weight_files or spec.pooling_kernel_size < 1:
            raise ValueError("graph.json's vision needs budgets, weight_files and pooling_kernel_size >= 1")
        return spec

    def to_json(self) -> dict[str, Any]:
        return {"budgets": list(self.budgets), "graph_file": self.graph_file, "weights": "separate",
                "weight_files": list(self.weight_files), "pooling_kernel_size": self.pooling_kernel_size,
                "patch_dim": self.patch_dim, "hidden": self.hidden}


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """What `graph.json` records. The defaults are those of the published 26B xlarge build (no graph.json).

    v2 adds: several prefill buckets (`prefill_buckets`; v1's single `prefill_bucket` is still read, and stays the
    most tokens one call takes), the sliding window and ring size the host needs to know how far back a rewind
    may go, and where the weights are (`weights: separate` -> per-rank safetensors in `weight_files`).

    v3 adds `kv_slots` (S independent KV caches; graph.json's `kv_slots` is that count, so v3 records the rings
    under `ring_slots`, where v2 wrote them under `kv_slots`) and `decode_batches` (the compiled decode batch sizes).

    A `--vision` build (v2/v3) adds `block_ids` (its prefill graphs take image-block ids) and `vision` (`VisionSpec`:
    the tower's graph). Absent, as in every graph.json written before them: False and None.
    """

    max_total: int = 512
    prefill_bucket: int = 128
    input_dtype: str = "float32"
    softcap_in_graph: bool = False
    graph_file: str | None = None
    tp: int = 2
    contract: str = CONTRACT
    prefill_buckets: tuple[int, ...] = ()
    sliding_window: int | None = None
    sliding_slots: int | None = None  # v2: KV slots of a sliding layer's ring
    weights: str = "inside"
    weight_files: tuple[str, ...] = ()
    kv_slots: int = 1  # v3: independent KV caches
    decode_batches: tuple[int, ...] = (1,)  # v3: compiled decode batch sizes, ascending
    block_ids: bool = False  # v2/v3 --vision: the prefill graphs take image-block ids [1, T] (graph.json `block_ids`)
    vision: VisionSpec | None = None  # a --vision build's tower (graph.json `vision`)
    kv_blocks: int = 0  # v4: blocks in the global layers' pool (block 0 the null block)
    block_size: int = 0  # v4: positions per block
    context_buckets: tuple[int, ...] = ()  # v4: contexts a graph is compiled for (tokens per row's table)
    # v2/v3/v4 last-row builds (issue 34, graph.json `prefill_logits: "last"`): the prefill graphs take last_index
    # [1] and return that row's logits [1, 1, V]; the score graphs (`score_buckets`; v4: at the largest context
    # bucket only) return every row. Absent, as in every graph.json written before them: every row.
    last_logits: bool = False
    score_buckets: tuple[int, ...] = ()

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.prefill_buckets or (self.prefill_bucket,)

    @property
    def v2(self) -> bool:
        return self.contract == CONTRACT_V2

    @property
    def v3(self) -> bool:
        return self.contract == CONTRACT_V3

    @property
    def v4(self) -> bool:
        return self.contract == CONTRACT_V4

    @property
    def slotted(self) -> bool:
        """v3 and v4: KV slots and decode batches (v4 adds the block pool)."""
        return self.contract in (CONTRACT_V3, CONTRACT_V4)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphSpec:
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        default = cls()
        contract = str(data.get("contract", CONTRACT))
        if contract not in CONTRACTS:
            raise UnknownContract(f"graph contract {contract!r} is not one this server drives ({', '.join(CONTRACTS)});"
                                  " rebuild the graph with the vendored recipe or update the server")
        buckets = tuple(sorted({int(b) for b in data.get("prefill_buckets") or ()}))
        window = data.get("sliding_window")
        v3 = contract in (CONTRACT_V3, CONTRACT_V4)
        slots = (data.get("ring_slots" if v3 else "kv_slots") or {}).get("sliding_attention")
        spec = cls(
            max_total=int(data.get("max_total", default.max_total)),
            prefill_bucket=max(buckets) if buckets else int(data.get("prefill_bucket", default.prefill_bucket)),
            input_dtype=str(data.get("input_dtype", default.input_dtype)),
            softcap_in_graph=bool(data.get("softcap_in_graph", default.softcap_in_graph)),
            graph_file=data.get("graph_file"),
            tp=int(data.get("tp", default.tp)),
            contract=contract,
            prefill_buckets=buckets,
            sliding_window=int(window) if window else None,
            sliding_slots=int(slots) if slots else None,
            weights=str(data.get("weights", "inside")),
            weight_files=tuple(str(f) for f in data.get("weight_files") or ()),
            kv_slots=int(data.get("kv_slots", 1)) if v3 else 1,
            decode_batches=tuple(sorted({int(b) for b in data.get("decode_batches") or (1,)})) if v3 else (1,),
            block_ids=bool(data.get("block_ids")),
            vision=VisionSpec.from_json(data["vision"]) if data.get("vision") else None,
            kv_blocks=int(data.get("kv_blocks", 0)) if contract == CONTRACT_V4 else 0,
            block_size=int(data.get("block_size", 0)) if contract == CONTRACT_V4 else 0,
            context_buckets=tuple(sorted({int(c) for c in data.get("context_buckets") or ()}))
            if contract == CONTRACT_V4 else (),
            last_logits=data.get("prefill_logits", "all") == "last",
            score_buckets=tuple(sorted({int(b) for b in data.get("score_buckets") or ()})),
        )
        if spec.max_total < 2 or not 1 <= min(spec.buckets) <= spec.prefill_bucket <= spec.max_total:
            raise ValueError(f"need 1 <= prefill buckets <= max_total, got {spec.buckets}, {spec.max_total}")
        if spec.input_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"input_dtype must be float32, bfloat16 or float16, got {spec.input_dtype!r}")
        if spec.weights not in ("inside", "separate") or (spec.weights == "separate") != bool(spec.weight_files):
            raise ValueError(f"weights must be 'inside', or 'separate' with weight_files, got {spec.weights!r}")
        if spec.v2 and (spec.sliding_window is None) != (spec.sliding_slots is None):
            raise ValueError("a v2 graph with a sliding window records kv_slots.sliding_attention too")
        if spec.slotted and (spec.sliding_window is None) != (spec.sliding_slots is None):
            raise ValueError("a v3 graph with a sliding window records ring_slots.sliding_attention too")
        if spec.v4 and (spec.kv_blocks < 2 or spec.block_size < 1 or not spec.context_buckets
                        or any(c % spec.block_size for c in spec.context_buckets)
                        or max(spec.context_buckets) != spec.max_total):
            raise ValueError("a v4 graph records kv_blocks >= 2, block_size and context_buckets (multiples of it, "
                             f"the largest max_total), got {spec.kv_blocks}, {spec.block_size}, {spec.context_buckets}")
        if data.get("prefill_logits", "all") not in ("all", "last"):
            raise ValueError(f"prefill_logits must be 'all' or 'last', got {data.get('prefill_logits')!r}")
        if spec.last_logits and (not (spec.v2 or spec.slotted) or spec.score_buckets != (min(spec.buckets),)):
            raise ValueError("a v2/v3/v4 graph with prefill_logits 'last' records its score graph at the smallest prefill "
                             f"bucket (score_buckets [{min(spec.buckets)}]), got {list(spec.score_buckets)}")
        if spec.slotted and not 1 <= min(spec.decode_batches) <= max(spec.decode_batches) <= spec.kv_slots:
            raise ValueError(f"need 1 <= decode batches <= kv_slots, got {spec.decode_batches}, {spec.kv_slots}")
        return spec

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "contract": self.contract,
            "max_total": self.max_total,
            "prefill_bucket": self.prefill_bucket,
            "input_dtype": self.input_dtype,
            "softcap_in_graph": self.softcap_in_graph,
            "graph_file": self.graph_file,
            "tp": self.tp,
        }
        if self.v2:
            record.update(prefill_buckets=list(self.buckets), sliding_window=self.sliding_window,
                          kv_slots={"sliding_attention": self.sliding_slots}, weights=self.weights,
                          weight_files=list(self.weight_files))
        if self.v4:
            record.update(kv_blocks=self.kv_blocks, block_size=self.block_size,
                          context_buckets=list(self.context_buckets))
        if self.slotted:
            record.update(prefill_buckets=list(self.buckets), sliding_window=self.sliding_window,
                          ring_slots={"sliding_attention": self.sliding_slots}, weights=self.weights,
                          weight_files=list(self.weight_files), kv_slots=self.kv_slots,
                          decode_batches=list(self.decode_batches))
        if self.last_logits:
            record.update(prefill_logits="last", score_buckets=list(self.score_buckets))
        if self.block_ids:
            record["block_ids"] = {"graphs": "prefill"}
        if self.vision is not None:
            record["vision"] = self.vision.to_json()
        return record


@dataclass(frozen=True, slots=True)
class ArtifactDir:
    """Paths inside one artifact directory; `validate` proves they are usable."""

    root: Path

    @property
    def cfg(self) -> Path:
        return self.root / CFG_DIR

    @property
    def hf(self) -> Path:
        return self.root / HF_DIR

    @property
    def vision_file(self) -> Path | None:
        """The host vision encoder's weights (`export --vision host`), when the export kept them."""
        path = self.root / VISION_FILE
        return path if path.is_file() else None

    @property
    def embed_file(self) -> Path | None:
        return next((self.root / n for n in EMBED_FILES if (self.root / n).is_file()), None)

    @property
    def graph_file(self) -> Path | None:
        try:
            named = self.graph_spec().graph_file
        except (ValueError, TypeError):  # validate() reports the malformed graph.json itself
            named = None
        names = (named, *GRAPH_FILES) if named else GRAPH_FILES
        return next((self.root / n for n in names if (self.root / n).is_file()), None)

    def graph_spec(self) -> GraphSpec:
        path = self.root / GRAPH_JSON
        if not path.is_file():
            return GraphSpec()
        return GraphSpec.from_json(json.loads(path.read_text(encoding="utf-8")))

    def resolve_graph(self, kind: str) -> str:
        """`auto` picks the compiled graph when present, else the transformers reference graph."""
        if kind != "auto":
            return kind
        # Without either, jit: validate() then names the missing compiled graph, the production case.
        return "hf" if self.graph_file is None and (self.hf / "config.json").is_file() else "jit"

    def model_name(self) -> str:
        """A default served model name: the checkpoint's `_name_or_path`, else the directory's name."""
        try:
            config = json.loads((self.cfg / "config.json").read_text(encoding="utf-8"))
            name = config.get("_name_or_path") or config.get("_model_name_or_path") or ""
        except (OSError, ValueError):
            name = ""
        name = Path(name).name.strip().replace(" ", "-").lower() if name else ""
        return name or self.root.resolve().name


def validate(root: Path | str, graph: str = "auto", *, deep: bool = True) -> ArtifactDir:
    """Check the directory for the selected graph kind; raise one `ArtifactError` naming every problem.

    `deep` also opens the embedding table (memory-mapped: milliseconds) to check its shape against the config.
    """
    art = ArtifactDir(Path(root))
    problems: list[str] = []
    if not art.root.is_dir():
        raise ArtifactError(
            f"artifact directory {art.root} does not exist. " + _HOW_TO_GET.format(repo=DEFAULT_REPO, dir=art.root)
        )
    kind = art.resolve_graph(graph)

    config: dict[str, Any] | None = None
    config_path = art.cfg / "config.json"
    if not config_path.is_file():
        problems.append(f"{config_path}: missing (the model config, expected in cfg/)")
    else:
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(config, dict) or "model_type" not in config:
                problems.append(f"{config_path}: not a transformers config (no model_type)")
                config = None
        except ValueError as exc:
            problems.append(f"{config_path}: not valid JSON ({exc})")
    if not any((art.cfg / n).is_file() for n in TOKENIZER_FILES):
        problems.append(f"{art.cfg}/tokenizer.json: missing (the tokenizer, expected in cfg/)")
    for optional_json in ("generation_config.json", "tokenizer_config.json"):
        path = art.cfg / optional_json
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except ValueError as exc:
                problems.append(f"{path}: not valid JSON ({exc})")

    try:
        spec = art.graph_spec()
    except UnknownContract as exc:
        problems.append(f"{art.root / GRAPH_JSON}: {exc}")
        spec = GraphSpec()
    except (ValueError, TypeError) as exc:
        problems.append(f"{art.root / GRAPH_JSON}: malformed ({exc})")
        spec = GraphSpec()

    embed = art.embed_file
    if embed is None:
        problems.append(f"{art.root}/embed_tokens.pt: missing (the [vocab, hidden] word-embedding table)")
    elif deep:
        problem = _check_embedding(embed, config)
        if problem:
            problems.append(problem)

    if kind == "jit" and art.graph_file is None:
        wanted = spec.graph_file or "sqz_neff.pt (or model.pt)"
        problems.append(f"{art.root}/{wanted}: missing (the compiled graph, needed by --graph jit)")
    if kind == "jit":
        for name in spec.weight_files:
            if not (art.root / name).is_file():
                problems.append(f"{art.root}/{name}: missing (a rank's weights; graph.json says weights: separate)")
    if kind == "hf":
        if not (art.hf / "config.json").is_file():
            problems.append(f"{art.hf}/config.json: missing (the transformers checkpoint, needed by --graph hf)")
        if not any(art.hf.glob("*.safetensors")) and not (art.hf / "pytorch_model.bin").is_file():
            problems.append(f"{art.hf}/model.safetensors: missing (the checkpoint weights, needed by --graph hf)")

    if problems:
        listing = "\n  - ".join(problems)
        raise ArtifactError(
            f"artifact directory {art.root} is not usable for --graph {kind}:\n  - {listing}\n" + _hint(art, kind)
        )
    return art


def _hint(art: ArtifactDir, kind: str) -> str:
    """How to get what is missing. A directory that already serves another graph kind (the demo's export serves
    `hf`) is someone's artifact dir: point at that kind, and fetch or export into a directory of its own."""
    serves = [k for k, present in (("jit", art.graph_file is not None), ("hf", (art.hf / "config.json").is_file()))
              if present and k != kind]
    if not serves:
        return _HOW_TO_GET.format(repo=DEFAULT_REPO, dir=art.root)
    return (f"{art.root} holds an artifact dir for --graph {' or '.join(serves)}: serve it that way (or with --graph "
            f"auto). For --graph {kind}, use a directory of its own: " + _HOW_TO_GET.format(repo=DEFAULT_REPO, dir="NEW_DIR"))


def _check_embedding(path: Path, config: dict[str, Any] | None) -> str | None:
    from server.model.embedding import open_table  # torch lives there

    try:
        table = open_table(path)
    except Exception as exc:  # noqa: BLE001 - any failure to open is a malformed file, named for the user
        return f"{path}: cannot be read as a [vocab, hidden] tensor ({type(exc).__name__}: {exc})"
    if table.dim() != 2:
        return f"{path}: expected a 2-D [vocab, hidden] tensor, got shape {tuple(table.shape)}"
    if config is not None:
        text = config.get("text_config") or config
        vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
        if vocab and hidden and tuple(table.shape) != (vocab, hidden):
            return f"{path}: shape {tuple(table.shape)} does not match the config's [vocab, hidden] = [{vocab}, {hidden}]"
    return None


def image_processor_file(directory: Path) -> Path | None:
    """The file in `directory` holding the image processor's settings: preprocessor_config.json, else a
    processor_config.json with an `image_processor` entry (what transformers 5 saves); None when neither is there."""
    old, new = directory / PREPROCESSOR_FILE, directory / PROCESSOR_FILE
    if old.is_file():
        return old
    try:
        saved = json.loads(new.read_text(encoding="utf-8")) if new.is_file() else None
    except (OSError, ValueError):
        return None
    return new if isinstance(saved, dict) and isinstance(saved.get("image_processor"), dict) else None
