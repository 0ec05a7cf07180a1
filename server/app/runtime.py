"""Assembles the host side from an artifact directory: structure, tokenizer, embedding table, graph loader, and what
follows from the tokenizer (the chat protocol, detected once; the stop ids; the grammar vocabulary's loader).

Everything here is fast (meta-device structure, mmapped table) except the graph itself, which the engine
loads on its own thread so HTTP can answer `/health` with `loading` meanwhile, like llama.cpp's server.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from server.api.given import ModelInfo
from server.app.process import freeze_heap, release_freed_memory, single_threaded_torch
from server.config import Settings, served_names
from server.constraints.factory import ConstraintFactory
from server.constraints.vocab import GrammarVocab, VocabLoader
from server.engine.engine import Engine
from server.errors import ArtifactError
from server.graphs.base import DTYPES, Graph
from server.model.artifacts import ArtifactDir, GraphSpec, image_processor_file, validate
from server.model.embedding import HostEmbedding
from server.model.structure import ModelStructure
from server.model.tokenizer import HostTokenizer
from server.protocol import ChatProtocol, protocol_of
from server.vision.load import VisionPlan, media_tokens, model_config, plan_vision
from server.vision.reader import ImageReader


@dataclass(frozen=True, slots=True)
class Host:
    artifacts: ArtifactDir
    graph_kind: str  # resolved: jit | hf | null
    spec: GraphSpec
    structure: ModelStructure
    tokenizer: HostTokenizer
    embedding: HostEmbedding
    model_name: str
    protocol: ChatProtocol  # the model family's chat format, detected once from the tokenizer
    stop_token_ids: tuple[int, ...]  # eos, the generation config's stops and the protocol's (`stop_ids`)
    grammar: VocabLoader  # built at start-up, or on first use with --lazy-grammar
    chat: bool = True  # False: a base model (it completes text); told to the API, which tells the user
    description: str | None = None
    aliases: tuple[str, ...] = ()  # the other names --served-model-name lists (model_name is the first)
    vision: VisionPlan = VisionPlan("off", reason="this is a text-only model")  # which encoder reads images
    images: ImageReader | None = None  # what the API reads image parts with (None: images are a 400)
    context: int | None = None  # --max-model-len, checked against the build's (None: the build's context)

    @property
    def max_total(self) -> int:
        """The context a request may use (prompt + completion): the build's, or less with --max-model-len."""
        return self.spec.max_total if self.context is None else self.context

    @property
    def info(self) -> ModelInfo:
        """What the HTTP layer is told about the model."""
        return ModelInfo(name=self.model_name, max_total=self.max_total, vocab_size=self.structure.vocab_size,
                         generation_defaults=self.structure.generation_defaults, tokenizer=self.tokenizer,
                         stop_token_ids=self.stop_token_ids, protocol=self.protocol, grammar=self.grammar,
                         chat=self.chat, description=self.description, aliases=self.aliases, images=self.images,
                         images_off=self.vision.reason or "this server takes no images")


def stop_ids(structure: ModelStructure, tokenizer: HostTokenizer, protocol: ChatProtocol) -> tuple[int, ...]:
    """eos and the generation config's stops, plus the chat protocol's, whatever generation_config.json lists."""
    ids = list(structure.eos_token_ids)
    for text in protocol.stop_tokens:
        token = tokenizer.backend_tokenizer.token_to_id(text)
        assert token is not None, f"the protocol was detected by its markers, {text} among them"
        ids.append(token)
    return tuple(dict.fromkeys(ids))


def load_host(root: Path | str, graph: str = "auto", served_model_name: str | None = None, cache_dir: Path | None = None,
              *, chat: bool = True, description: str | None = None, settings: Settings | None = None) -> Host:
    """served_model_name: one name or a comma-separated list (the first is the id, the others aliases). cache_dir: where
    start-up caches live (None: derive everything, write nothing). `chat` and `description`: what the caller knows
    about the model that its files do not say (a base model's GGUF looks like any other). `settings`: the image
    settings (--vision and its limits) and --max-model-len; None: images off, the build's context."""
    art = validate(root, graph)
    kind = art.resolve_graph(graph)
    spec = art.graph_spec()
    context = settings.max_model_len if settings is not None else None
    if context is not None and not 2 <= context <= spec.max_total:
        # A longer context than the graph's positions cannot be served; refused at start-up, as vLLM does.
        raise ArtifactError(f"--max-model-len {context}: this build's context is {spec.max_total} tokens; give 2 to "
                         f"{spec.max_total}, or leave it unset")
    structure = ModelStructure.from_dir(art.cfg, cache_dir)
    tokenizer = HostTokenizer.from_dir(art.cfg, cache_dir)
    embed_file = art.embed_file
    assert embed_file is not None  # validate() checked
    embedding = HostEmbedding.open(embed_file, structure.embed_scale, DTYPES[spec.input_dtype])
    protocol = protocol_of(tokenizer)
    stops = stop_ids(structure, tokenizer, protocol)
    grammar = VocabLoader(functools.partial(_grammar_vocab, tokenizer, structure.vocab_size, stops, cache_dir,
                                            art.cfg / "tokenizer.json"))
    vision, images = _vision(art, kind, spec, tokenizer, settings)
    names = served_names(served_model_name) if served_model_name else (art.model_name(),)
    reach = pool_reach(kind, spec, settings)
    if reach is not None and reach < (context or spec.max_total):  # one conversation can never hold more
        context = reach
    return Host(art, kind, spec, structure, tokenizer, embedding, names[0], protocol, stops, grammar, chat, description,
                names[1:], vision, images, context)


def pool_shape(kind: str, spec: GraphSpec, settings: Settings | None) -> tuple[int, int, tuple[int, ...]] | None:
    """(blocks, block size, context buckets) of the KV pool the graph lends by need (a v4 build; the null graph with
    --null-kv-blocks), or None: KV per slot."""
    if kind == "jit" and spec.v4:
        return spec.kv_blocks, spec.block_size, spec.context_buckets
    if kind == "null" and settings is not None and settings.null_kv_blocks:
        return settings.null_kv_blocks, settings.null_block_size, spec.context_buckets or (spec.max_total,)
    return None


def pool_reach(kind: str, spec: GraphSpec, settings: Settings | None) -> int | None:
    """The most positions one conversation can hold in that pool (every lendable block), None without a pool."""
    shape = pool_shape(kind, spec, settings)
    return None if shape is None else min((shape[0] - 1) * shape[1], max(shape[2]))


def _vision(art: ArtifactDir, kind: str, spec: GraphSpec, tokenizer: HostTokenizer,
            settings: Settings | None) -> tuple[VisionPlan, ImageReader | None]:
    """--vision resolved (server.vision.load), and the image reader the API is given when images are on."""
    if settings is None or settings.vision == "off":
        return VisionPlan("off", reason="images are off on this server (--vision off)"), None
    plan = plan_vision(settings.vision, art, kind, spec, DTYPES[spec.input_dtype])
    if plan.mode == "off":
        return plan, None
    settings_file = image_processor_file(art.cfg)
    assert settings_file is not None  # plan_vision turned images off (or refused) without it
    reader = ImageReader(settings_file, tokens=media_tokens(model_config(art), tokenizer),
                         budgets=plan.budgets, default_budget=settings.image_tokens,
                         max_images=settings.max_images_per_request, max_bytes=settings.max_image_bytes,
                         max_pixels=settings.max_image_pixels, allow_urls=settings.allow_image_urls)
    return plan, reader


def _grammar_vocab(tokenizer: HostTokenizer, vocab_size: int, stops: tuple[int, ...], cache_dir: Path | None,
                   source: Path) -> GrammarVocab:
    """The grammar vocabulary, its token table cached beside the other start-up caches (keyed by `source`, see
    server.constraints.vocab); then the heap its parsing freed goes back to the OS (20-40 MB measured)."""
    vocab = GrammarVocab.from_tokenizer(tokenizer, vocab_size, stops, cache_dir=cache_dir, source=source)
    release_freed_memory()
    return vocab


def graph_loader(host: Host, settings: Settings | None = None) -> Callable[[], Graph]:
    """A zero-argument factory the engine calls on its own thread. `settings`: the device, the null graph's simulated
    step time, and --max-batch, which is also how many caches the reference graph keeps (graphs.hf.DEMO_SLOTS when
    unset)."""
    settings = settings or Settings()
    device, null_step_s, hf_slots = settings.device, settings.null_step_ms / 1000, settings.max_batch
    kind, spec, structure = host.graph_kind, host.spec, host.structure

    def load() -> Graph:
        if kind == "jit":
            from server.graphs.jit import JitGraph, JitGraphV2, JitGraphV3, JitGraphV4

            path = host.artifacts.graph_file
            assert path is not None
            if spec.v4:  # v3's protocol; the adapter lends the global layers' KV blocks by need
                return JitGraphV4(path, spec, vocab_size=structure.vocab_size, final_softcap=structure.final_softcap)
            if spec.v3:  # protocol v3 natively: the engine's scheduler drives every slot
                return JitGraphV3(path, spec, vocab_size=structure.vocab_size, final_softcap=structure.final_softcap)
            if spec.v2:
                return JitGraphV2(path, spec, vocab_size=structure.vocab_size, final_softcap=structure.final_softcap)
            return JitGraph(path, spec, vocab_size=structure.vocab_size, sliding_window=structure.sliding_window,
                            final_softcap=structure.final_softcap)
        if kind == "hf":
            from server.graphs.hf import DEMO_SLOTS, HFGraph

            return HFGraph(host.artifacts.hf, spec, device=device, slots=hf_slots or DEMO_SLOTS)
        if kind == "null":
            from server.graphs.blocks import KVBlocks
            from server.graphs.null import (
                NULL_DECODE_BATCHES,
                NULL_GRAPH_WORDS,
                NULL_SLOTS,
                ROOFLINE_S_PER_POSITION,
                NullGraph,
            )

            # Greedy repeats " a"; sampling draws among ordinary words, so every sampled token is a visible chunk.
            words = list(dict.fromkeys(host.tokenizer.encode(NULL_GRAPH_WORDS, add_special_tokens=False)))
            favoured, words = words[0], words[1:]
            # As many KV slots as the artifact's v3 graph would have (else NULL_SLOTS): it serves several at once.
            slots, batches = (spec.kv_slots, spec.decode_batches) if spec.slotted else (NULL_SLOTS, NULL_DECODE_BATCHES)
            shape = pool_shape(kind, spec, settings)  # --null-kv-blocks: a v4 build's pool, lent by need
            pool = None if shape is None else KVBlocks(*shape)
            # a simulated device's decode step also waits for the context bucket's KV reads, as a v4 build's would
            per_position = ROOFLINE_S_PER_POSITION if pool is not None and null_step_s > 0 else 0.0
            return NullGraph(structure.vocab_size, max_total=spec.max_total, prefill_bucket=spec.prefill_bucket,
                             input_dtype=DTYPES[spec.input_dtype], host_softcap=structure.final_softcap,
                             favoured_token=favoured, text_tokens=words, step_s=null_step_s, slots=slots,
                             decode_batches=batches, kv_pool=pool, s_per_position=per_position)
        raise ValueError(f"unknown graph kind {kind!r}")

    return load


def build_engine(host: Host, settings: Settings | None = None, *, load: Callable[[], Graph] | None = None,
                 prefix_reuse: bool = True) -> Engine:
    """The one way an engine is assembled (serve, the bench, the tests). `load`: a graph loader of the caller's own
    (default: the host's graph); `prefix_reuse` off only to measure what it saves."""
    settings = settings or Settings()
    single_threaded_torch(host.graph_kind)
    return Engine(host.embedding, host.tokenizer, host.stop_token_ids,
                  load or graph_loader(host, settings),
                  max_queue=settings.max_queue, request_timeout_s=settings.request_timeout_s,
                  step_timeout_s=settings.step_timeout_s, prefix_reuse=prefix_reuse, on_loaded=freeze_heap,
                  constraints=ConstraintFactory(host.structure.vocab_size, host.grammar.matcher),
                  max_batch=settings.max_batch, load_vision=host.vision.load)
