"""`python -m server {serve,demo,check,fetch,export,bench}`: the command line, the only reader of the environment."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn, TypeAlias

from server.config import DEFAULT_CACHE, GRAPH_KINDS, Settings, add_options
from server.model.artifacts import DEFAULT_REPO
from server.tools.demo import DEFAULT_DEMO_MODEL, DEMO_MODELS, DemoModel

DEMO_GRAPHS = ("hf", "null")
DEMO_MODEL_ENV = "DEMO_MODEL"


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (the full usage of `serve` is 18 lines that hide the error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m server", description="An OpenAI-compatible server for Gemma-4 26B-A4B on inf2.xlarge. "
                     "Try it on any machine with `python -m server demo`; `python -m server COMMAND --help` lists a "
                     "command's flags.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_demo, _add_check, _add_fetch, _add_export, _add_bench):  # the order --help lists
        add(sub)
    return parser


# what add_subparsers returns: argparse names it only privately
_Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _add_serve(sub: _Subcommands) -> None:
    serve = sub.add_parser("serve", help="serve an artifact directory over the OpenAI-compatible HTTP API")
    add_options(serve)


def _add_demo(sub: _Subcommands) -> None:
    demo = sub.add_parser("demo", help=f"serve an embedded small model on CPU (default {DEFAULT_DEMO_MODEL}, a chat "
                          "model; exported once into a cache)")
    demo.add_argument("--model", dest="demo_model", choices=tuple(DEMO_MODELS), default=None,
                      help="which model: " + ", ".join(f"{m.name} ({'chat' if m.chat else 'base: completes text'})"
                                                        for m in DEMO_MODELS.values())
                           + f" (default: {DEFAULT_DEMO_MODEL}) [env {DEMO_MODEL_ENV}]")
    demo.add_argument("--graph", dest="demo_graph", choices=DEMO_GRAPHS, default="hf",
                      help="hf: the real model on CPU; null: instant stand-in logits (the API without a model, "
                           "with --null-step-ms for a simulated device) (default: hf)")
    add_options(demo, names=tuple(n for n in Settings.__slots__ if n not in ("artifacts", "graph")))


def _add_check(sub: _Subcommands) -> None:
    check = sub.add_parser("check", help="exit 0 if the artifact directory is complete for the graph, else say why")
    check.add_argument("--artifacts", required=True, type=Path, metavar="DIR", help="the artifact directory to check")
    check.add_argument("--graph", default="auto", choices=GRAPH_KINDS,
                       help="the graph kind it must serve; auto: the compiled graph if present, else hf (default: auto)")


def _add_fetch(sub: _Subcommands) -> None:
    fetch = sub.add_parser("fetch", help="download the artifacts of a Hugging Face repo, then validate them")
    fetch.add_argument("--repo", required=True, metavar="ID", help=f"Hugging Face repo id (the published build: {DEFAULT_REPO})")
    fetch.add_argument("--dest", required=True, type=Path, metavar="DIR",
                       help="directory to download into (created; a directory of its own, not another model's)")
    fetch.add_argument("--revision", default=None, metavar="REV", help="branch, tag or commit (default: main)")
    fetch.add_argument("--graph", default="auto", choices=GRAPH_KINDS,
                       help="the graph kind the download must serve, checked afterwards (default: auto)")


def _add_export(sub: _Subcommands) -> None:
    export = sub.add_parser("export", help="a transformers checkpoint dir or .gguf file -> an artifact dir (hf graph)")
    export.add_argument("--from", dest="source", required=True, type=Path, metavar="CHECKPOINT_DIR_OR_GGUF",
                        help="a transformers checkpoint directory or a .gguf file")
    export.add_argument("--dest", required=True, type=Path, metavar="DIR", help="the artifact directory to write")
    export.add_argument("--prefill-bucket", type=int, default=128, metavar="TOKENS",
                        help="prompt chunk length, tokens (default: 128)")
    export.add_argument("--max-total", type=int, default=512, metavar="TOKENS",
                        help="context: prompt + completion, tokens (default: 512)")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and embedding table dtype (default: float32)")
    export.add_argument("--vision", choices=("off", "host"), default="off",
                        help="host: also keep the vision tower and its projection (vision.safetensors), for serve "
                             "--vision host; off: the text model only (default: off)")


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", dest="json_path", type=Path, default=None, metavar="PATH",
                        help="also write the results here, as one JSON object")


def _add_bench(sub: _Subcommands) -> None:
    bench = sub.add_parser("bench", help="measure the host's per-token overhead with the null graph at real shapes")
    _add_json(bench)
    add_options(bench, names=("cache_dir", "null_kv_blocks", "null_block_size"), helps={
        "cache_dir": "where the bench keeps its 1.5 GB table of the 26B's shapes and the tokenizer's start-up caches "
                     "(built on the first run, reused after)"})
    bench.add_argument("--tokens", type=int, default=None, metavar="N",
                       help="generated tokens per measured stream (default: 200; --concurrency: 64)")
    bench.add_argument("--concurrency", type=_counts, default=None, metavar="N,N,...",
                       help="several streams at once instead (e.g. 1,2,4,8): aggregate tok/s, inter-token latency, a "
                       "late arrival's TTFT, host time per step per row; the null graph with roofline step times, or "
                       "--artifacts DIR --graph jit")
    bench.add_argument("--artifacts", type=Path, default=None, metavar="DIR",
                       help="with --concurrency: a v3 build to measure")
    bench.add_argument("--graph", dest="bench_graph", default="jit", choices=GRAPH_KINDS,
                       help="with --artifacts: its graph kind (default: jit)")
    parts = bench.add_subparsers(dest="bench_part", metavar="{load,constraints,vision,prefill,kv-quant,fairness,soak}",
                                 help="one part alone (default: the host-overhead bench, which includes constraints)")
    _add_bench_parts(parts)


def _add_bench_parts(parts: _Subcommands) -> None:
    load = parts.add_parser("load", help="anonymous memory while a graph loads (v2 separate weights vs inside)")
    load.add_argument("--artifacts", type=Path, required=True, metavar="DIR", help="the artifact directory to load")
    load.add_argument("--graph", default="jit", choices=GRAPH_KINDS, help="graph kind to load (default: jit)")
    _add_json(load)
    masks = parts.add_parser("constraints", help="the constraint mask's cost per token on a tokenizer directory")
    masks.add_argument("cfg", type=Path, metavar="CFG_DIR", help="a tokenizer directory, e.g. the demo's cfg/")
    _add_json(masks)
    vision = parts.add_parser("vision", help="the host vision encoder's time per image at each soft-token budget")
    vision.add_argument("--artifacts", type=Path, default=None, metavar="DIR",
                        help="an export with vision.safetensors (default: a random tower of the 26B's vision shape)")
    vision.add_argument("--budgets", type=_counts, default=(70, 140, 280), metavar="N,N,...",
                        help="soft-token budgets to time (default: 70,140,280)")
    _add_json(vision)
    prefill = parts.add_parser("prefill", help="the time to prefill one long prompt through an export's graph (an "
                               "agent's first request)")
    prefill.add_argument("--artifacts", type=Path, required=True, metavar="DIR", help="the export to measure")
    prefill.add_argument("--graph", default="hf", choices=GRAPH_KINDS, help="its graph kind (default: hf)")
    prefill.add_argument("--tokens", type=int, default=18_900, metavar="N",
                         help="prompt tokens (default: 18,900, a Claude Code request's size after one retry)")
    prefill.add_argument("--repeat", type=int, default=3, metavar="K", help="timed runs (default: 3; the median)")
    _add_json(prefill)
    kv = parts.add_parser("kv-quant", help="int8 KV on real weights: KL and top-1 of the demo models' next-token "
                          "distributions, int8 K/V cache against the unquantized one, over Python's help text")
    kv.add_argument("--tokens", type=int, default=8192, metavar="N",
                    help="positions compared per model (default: 8192, SmolLM2's whole context)")
    kv.add_argument("--model", dest="kv_models", action="append", choices=sorted(DEMO_MODELS), default=None,
                    help="a demo model to measure (repeatable; default: both)")
    kv.add_argument("--cache-dir", dest="kv_cache_dir", type=Path, default=Path(DEFAULT_CACHE).expanduser(),
                    metavar="DIR", help=f"where the demo exports live, built on first use (default: {DEFAULT_CACHE})")
    kv.add_argument("--no-bf16-baseline", dest="kv_bf16", action="store_false",
                    help="skip the bf16-KV comparison printed beside int8's (the builds' unquantized KV dtype)")
    _add_json(kv)
    fair = parts.add_parser("fairness", help="four running streams' inter-token gaps while an image is encoded, a long "
                            "prompt is scored or three newcomers arrive, and the newcomers' first tokens (null graph, "
                            "the 26B's roofline step times)")
    fair.add_argument("--scenarios", type=_names, default=None, metavar="NAME,...",
                      help="which scenarios (default: baseline,image,plain,scored,newcomers)")
    fair.add_argument("--image-budget", type=int, default=70, metavar="N",
                      help="the image's soft-token budget (default: 70)")
    fair.add_argument("--scored", type=int, default=4096, metavar="N",
                      help="tokens of the scored (and the plain) prompt (default: 4096)")
    fair.add_argument("--newcomers", type=_counts, default=(8192, 512, 16), metavar="N,N,...",
                      help="the newcomers' prompt lengths (default: 8192,512,16)")
    fair.add_argument("--no-compare", dest="fair_compare", action="store_false",
                      help="skip the run as before (first-come prefill, host work on the device thread)")
    fair.add_argument("--cache-dir", dest="fair_cache_dir", type=Path, default=Path(DEFAULT_CACHE).expanduser(),
                      metavar="DIR", help=f"where the 26B-shaped bench table lives, built on first use (default: "
                      f"{DEFAULT_CACHE})")
    _add_json(fair)
    soak = parts.add_parser("soak", help="a bounded mixed HTTP load (chat, Responses, Messages, tools, JSON, images, "
                            "cancellations, probes) on the null graph with roofline step times: RSS over time and its "
                            "slope, inter-token gap and TTFT p50/p99, responses by status, KV slots freed")
    soak.add_argument("--minutes", type=float, default=None, metavar="N", help="how long the load runs (default: 30)")
    soak.add_argument("--seconds", type=float, default=None, metavar="S", help="or in seconds (a quick check)")
    soak.add_argument("--clients", type=int, default=6, metavar="N", help="requests in flight at once (default: 6)")
    soak.add_argument("--sample-s", type=float, default=10.0, metavar="S",
                      help="seconds between two RSS samples (default: 10)")
    soak.add_argument("--artifacts", dest="soak_artifacts", type=Path, default=None, metavar="DIR",
                      help="the export whose tokenizer, template, table and vision tower (if it kept one) serve "
                      "(default: the bench's 26B shapes: text-only, no tool-call format)")
    _add_json(soak)


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(",") if part.strip())
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be positive integers, got {text!r}")
    return counts


def _names(text: str) -> tuple[str, ...]:
    from server.tools.bench.fairness import SCENARIOS

    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(names) - set(SCENARIOS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"scenarios are some of {','.join(SCENARIOS)}, got {text!r}")
    return names


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _Refused(Exception):
    """A command refused before it started work: printed as `error: ...`, exit code 2."""


def _settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    try:
        settings = Settings.from_cli(args, environ)
    except (ValueError, OSError) as exc:
        raise _Refused(exc) from exc
    assert settings.cache_dir is not None  # from_cli fills in the default
    return settings


def _check(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from server.errors import ArtifactError
    from server.model.artifacts import validate

    try:
        validate(args.artifacts, args.graph)
    except ArtifactError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.artifacts}: complete for --graph {args.graph}")
    return 0


def _export(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from server.tools.export import export

    _setup_logging("info")
    export(args.source, args.dest, prefill_bucket=args.prefill_bucket, max_total=args.max_total, dtype=args.dtype,
           vision=args.vision)
    print(args.dest)
    return 0


def _fetch(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    from server.tools.fetch import fetch

    _setup_logging("info")
    # No token passed: huggingface_hub reads HF_TOKEN (or its stored login) itself.
    return fetch(args.repo, args.dest, revision=args.revision, graph=args.graph)


def _bench_load(args: argparse.Namespace) -> int:
    from server.tools.bench import load
    from server.tools.bench.report import report

    report(load.measure_load_memory(args.artifacts, args.graph), args.json_path)
    return 0


def _bench_vision(args: argparse.Namespace) -> int:
    from server.tools.bench import vision
    from server.tools.bench.report import report

    report(vision.measure(args.artifacts, args.budgets), args.json_path)
    return 0


def _bench_constraints(args: argparse.Namespace) -> int:
    from server.tools.bench import constraints

    return constraints.run(args.cfg, args.json_path)


def _bench_prefill(args: argparse.Namespace) -> int:
    from server.tools.bench import prefill
    from server.tools.bench.report import report

    report(prefill.measure(args.artifacts, args.graph, args.tokens, args.repeat), args.json_path)
    return 0


def _bench_kv_quant(args: argparse.Namespace) -> int:
    from server.tools.bench import kv_quant
    from server.tools.demo import demo_artifacts

    names = args.kv_models or sorted(DEMO_MODELS)
    return kv_quant.run([(name, demo_artifacts(args.kv_cache_dir, model=name)) for name in names], args.tokens,
                        args.json_path, bf16_baseline=args.kv_bf16)


def _bench_fairness(args: argparse.Namespace) -> int:
    import json

    from server.tools.bench import fairness

    results = fairness.measure(args.fair_cache_dir, scenarios=args.scenarios or fairness.SCENARIOS,
                               image_budget=args.image_budget, scored=args.scored, newcomers=args.newcomers,
                               compare=args.fair_compare)
    fairness.print_fairness(results)
    print(json.dumps(results))
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(results) + "\n", encoding="utf-8")
    return 0


def _bench_soak(args: argparse.Namespace, settings: Settings) -> int:
    from server.tools.bench.host import bench_artifacts
    from server.tools.bench.report import report
    from server.tools.bench.soak import run_soak

    seconds = args.seconds if args.seconds is not None else 60 * (30 if args.minutes is None else args.minutes)
    artifacts = args.soak_artifacts or bench_artifacts(settings.cache_dir)
    results = run_soak(artifacts, seconds=seconds, clients=args.clients, sample_s=args.sample_s,
                       cache_root=settings.cache_dir)
    report(results, args.json_path)
    return 0 if results["soak_5xx"] == 0 and results["soak_kv_slots_in_use_after"] == 0 else 1


BENCH_PARTS = {"load": _bench_load, "vision": _bench_vision, "constraints": _bench_constraints,
               "prefill": _bench_prefill, "kv-quant": _bench_kv_quant, "fairness": _bench_fairness}


def _bench_concurrency(args: argparse.Namespace, settings: Settings) -> int:
    import json

    from server.tools.bench.concurrency import measure_concurrency, print_concurrency

    results = measure_concurrency(args.concurrency, cache_root=settings.cache_dir, artifacts=args.artifacts,
                                  graph=args.bench_graph, tokens=args.tokens or 64, settings=settings)
    print_concurrency(results)
    print(json.dumps(results))
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(results) + "\n", encoding="utf-8")
    return 0


def _bench(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    if args.bench_part == "soak":  # the one part that serves: the cache directory is the settings'
        settings = _settings(args, environ)
        _setup_logging("warning")
        return _bench_soak(args, settings)
    if args.bench_part is not None:  # a part alone needs no Settings: its flags are its own
        _setup_logging("warning")
        return BENCH_PARTS[args.bench_part](args)
    settings = _settings(args, environ)
    _setup_logging("warning")
    if args.concurrency is not None:
        return _bench_concurrency(args, settings)
    from server.tools.bench.host import run_bench

    return run_bench(settings.cache_dir, json_path=args.json_path, tokens=args.tokens or 200)


def _listen(settings: Settings) -> socket.socket:
    _setup_logging(settings.log_level)
    from server.app.serve import listen

    try:  # before anything loads (the demo's first export takes minutes): a taken port fails in a second
        return listen(settings.host, settings.port)
    except OSError as exc:
        raise _Refused(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from exc


def _serve(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ)
    listener = _listen(settings)
    from server.app.serve import serve

    return serve(settings, listener)


def _demo_model(args: argparse.Namespace, environ: Mapping[str, str]) -> DemoModel:
    from server.tools.demo import DemoModelMissing, require_demo_model

    name = args.demo_model or environ.get(DEMO_MODEL_ENV) or DEFAULT_DEMO_MODEL
    if name not in DEMO_MODELS:
        raise _Refused(f"{DEMO_MODEL_ENV}: must be one of {', '.join(DEMO_MODELS)}, got {name!r}")
    model = DEMO_MODELS[name]
    try:  # at once, not after a minute of loading: a missing package is a one-line fix
        require_demo_model(model.name)
    except DemoModelMissing as exc:
        raise _Refused(exc) from exc
    return model


def _demo(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    settings = _settings(args, environ)
    model = _demo_model(args, environ)
    listener = _listen(settings)
    from dataclasses import replace

    from server.app.serve import serve
    from server.tools.demo import demo_artifacts

    root = demo_artifacts(settings.cache_dir, model=model.name)
    settings = replace(settings, artifacts=root, graph=args.demo_graph,
                       served_model_name=settings.served_model_name or model.name)
    return serve(settings, listener, chat=model.chat, description=model.description)


COMMANDS = {"serve": _serve, "demo": _demo, "check": _check, "fetch": _fetch, "export": _export, "bench": _bench}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args, environ)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
