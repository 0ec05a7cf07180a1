"""`python -m server {serve,demo,check,fetch,export,bench}`: the command line, the only reader of the environment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from server.config import GRAPH_KINDS, Settings, add_options
from server.model.artifacts import DEFAULT_REPO
from server.tools.demo import DEFAULT_DEMO_MODEL, DEMO_MODELS

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

    serve = sub.add_parser("serve", help="serve an artifact directory over the OpenAI-compatible HTTP API")
    add_options(serve)

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

    check = sub.add_parser("check", help="exit 0 if the artifact directory is complete for the graph, else say why")
    check.add_argument("--artifacts", required=True, type=Path, metavar="DIR", help="the artifact directory to check")
    check.add_argument("--graph", default="auto", choices=GRAPH_KINDS,
                       help="the graph kind it must serve; auto: the compiled graph if present, else hf (default: auto)")

    fetch = sub.add_parser("fetch", help="download the artifacts of a Hugging Face repo, then validate them")
    fetch.add_argument("--repo", required=True, metavar="ID", help=f"Hugging Face repo id (the published build: {DEFAULT_REPO})")
    fetch.add_argument("--dest", required=True, type=Path, metavar="DIR",
                       help="directory to download into (created; a directory of its own, not another model's)")
    fetch.add_argument("--revision", default=None, metavar="REV", help="branch, tag or commit (default: main)")
    fetch.add_argument("--graph", default="auto", choices=GRAPH_KINDS,
                       help="the graph kind the download must serve, checked afterwards (default: auto)")

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

    bench = sub.add_parser("bench", help="measure the host's per-token overhead with the null graph at real shapes")
    bench.add_argument("--json", dest="json_path", type=Path, default=None, metavar="PATH",
                       help="also write the results here, as one JSON object")
    add_options(bench, names=("cache_dir",), helps={
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
    parts = bench.add_subparsers(dest="bench_part", metavar="{load,constraints,vision}",
                                 help="one part alone (default: the host-overhead bench, which includes constraints)")
    load = parts.add_parser("load", help="anonymous memory while a graph loads (v2 separate weights vs inside)")
    load.add_argument("--artifacts", type=Path, required=True, metavar="DIR", help="the artifact directory to load")
    load.add_argument("--graph", default="jit", choices=GRAPH_KINDS, help="graph kind to load (default: jit)")
    load.add_argument("--json", dest="json_path", type=Path, default=None, metavar="PATH",
                      help="also write the results here, as one JSON object")
    masks = parts.add_parser("constraints", help="the constraint mask's cost per token on a tokenizer directory")
    masks.add_argument("cfg", type=Path, metavar="CFG_DIR", help="a tokenizer directory, e.g. the demo's cfg/")
    masks.add_argument("--json", dest="json_path", type=Path, default=None, metavar="PATH",
                       help="also write the results here, as one JSON object")
    vision = parts.add_parser("vision", help="the host vision encoder's time per image at each soft-token budget")
    vision.add_argument("--artifacts", type=Path, default=None, metavar="DIR",
                        help="an export with vision.safetensors (default: a random tower of the 26B's vision shape)")
    vision.add_argument("--budgets", type=_counts, default=(70, 140, 280), metavar="N,N,...",
                        help="soft-token budgets to time (default: 70,140,280)")
    vision.add_argument("--json", dest="json_path", type=Path, default=None, metavar="PATH",
                        help="also write the results here, as one JSON object")
    return parser


def _counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(",") if part.strip())
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be positive integers, got {text!r}")
    return counts


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)

    if args.command == "check":
        from server.errors import ArtifactError
        from server.model.artifacts import validate

        try:
            validate(args.artifacts, args.graph)
        except ArtifactError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{args.artifacts}: complete for --graph {args.graph}")
        return 0

    if args.command == "export":
        from server.tools.export import export

        _setup_logging("info")
        export(args.source, args.dest, prefill_bucket=args.prefill_bucket, max_total=args.max_total, dtype=args.dtype,
               vision=args.vision)
        print(args.dest)
        return 0

    if args.command == "fetch":
        from server.tools.fetch import fetch

        _setup_logging("info")
        # No token passed: huggingface_hub reads HF_TOKEN (or its stored login) itself.
        return fetch(args.repo, args.dest, revision=args.revision, graph=args.graph)

    if args.command == "bench" and args.bench_part is not None:
        from server.tools.bench import constraints, load
        from server.tools.bench.report import report

        _setup_logging("warning")
        if args.bench_part == "load":
            report(load.measure_load_memory(args.artifacts, args.graph), args.json_path)
            return 0
        if args.bench_part == "vision":
            from server.tools.bench import vision as vision_bench

            report(vision_bench.measure(args.artifacts, args.budgets), args.json_path)
            return 0
        return constraints.run(args.cfg, args.json_path)

    try:
        settings = Settings.from_cli(args, environ)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert settings.cache_dir is not None  # from_cli fills in the default
    if args.command == "demo":
        from server.tools.demo import DemoModelMissing, require_demo_model

        name = args.demo_model or environ.get(DEMO_MODEL_ENV) or DEFAULT_DEMO_MODEL
        if name not in DEMO_MODELS:
            print(f"error: {DEMO_MODEL_ENV}: must be one of {', '.join(DEMO_MODELS)}, got {name!r}", file=sys.stderr)
            return 2
        model = DEMO_MODELS[name]
        try:  # at once, not after a minute of loading: a missing package is a one-line fix
            require_demo_model(model.name)
        except DemoModelMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.command == "bench" and args.concurrency is not None:
        import json

        from server.tools.bench.concurrency import measure_concurrency, print_concurrency

        _setup_logging("warning")
        results = measure_concurrency(args.concurrency, cache_root=settings.cache_dir, artifacts=args.artifacts,
                                      graph=args.bench_graph, tokens=args.tokens or 64)
        print_concurrency(results)
        print(json.dumps(results))
        if args.json_path is not None:
            args.json_path.write_text(json.dumps(results) + "\n", encoding="utf-8")
        return 0
    if args.command == "bench":
        from server.tools.bench.host import run_bench

        _setup_logging("warning")
        return run_bench(settings.cache_dir, json_path=args.json_path, tokens=args.tokens or 200)
    _setup_logging(settings.log_level)
    from server.app.serve import listen, serve

    try:  # before anything loads (the demo's first export takes minutes): a taken port fails in a second
        listener = listen(settings.host, settings.port)
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.command != "demo":
        return serve(settings, listener)
    from dataclasses import replace

    from server.tools.demo import demo_artifacts

    root = demo_artifacts(settings.cache_dir, model=model.name)
    settings = replace(settings, artifacts=root, graph=args.demo_graph,
                       served_model_name=settings.served_model_name or model.name)
    return serve(settings, listener, chat=model.chat, description=model.description)


if __name__ == "__main__":
    sys.exit(main())
