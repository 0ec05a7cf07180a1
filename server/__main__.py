"""`python -m server {serve,demo,check,fetch,export,bench}`: the command line, the only reader of the environment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from server.config import GRAPH_KINDS, Settings, add_options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve an artifact directory over the OpenAI-compatible HTTP API")
    add_options(serve)

    demo = sub.add_parser("demo", help="serve the embedded Gemma-3 270M on CPU (exported once into a cache)")
    add_options(demo, names=tuple(n for n in Settings.__slots__ if n not in ("artifacts", "graph")))

    check = sub.add_parser("check", help="exit 0 if the artifact directory is complete for the graph, else say why")
    check.add_argument("--artifacts", required=True, type=Path)
    check.add_argument("--graph", default="auto", choices=GRAPH_KINDS)

    fetch = sub.add_parser("fetch", help="download the artifacts of a Hugging Face repo, then validate them")
    fetch.add_argument("--repo", required=True)
    fetch.add_argument("--dest", required=True, type=Path)
    fetch.add_argument("--revision", default=None)
    fetch.add_argument("--graph", default="auto", choices=GRAPH_KINDS)

    export = sub.add_parser("export", help="a transformers checkpoint dir or .gguf file -> an artifact dir (hf graph)")
    export.add_argument("--from", dest="source", required=True, type=Path)
    export.add_argument("--dest", required=True, type=Path)
    export.add_argument("--prefill-bucket", type=int, default=128)
    export.add_argument("--max-total", type=int, default=512)
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")

    bench = sub.add_parser("bench", help="measure the host's per-token overhead with the null graph at real shapes")
    bench.add_argument("--json", dest="json_path", type=Path, default=None, help="also write the results here")
    add_options(bench, names=("cache_dir",))  # where the real-size table is cached
    bench.add_argument("--tokens", type=int, default=200, help="generated tokens per measured stream")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)

    if args.command == "check":
        from server.artifacts import validate
        from server.errors import ArtifactError

        try:
            validate(args.artifacts, args.graph)
        except ArtifactError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{args.artifacts}: complete for --graph {args.graph}")
        return 0

    if args.command == "export":
        from server.export import export

        _setup_logging("info")
        export(args.source, args.dest, prefill_bucket=args.prefill_bucket, max_total=args.max_total, dtype=args.dtype)
        print(args.dest)
        return 0

    if args.command == "fetch":
        from server.fetch import fetch

        _setup_logging("info")
        # No token passed: huggingface_hub reads HF_TOKEN (or its stored login) itself.
        return fetch(args.repo, args.dest, revision=args.revision, graph=args.graph)

    try:
        settings = Settings.from_cli(args, environ)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert settings.cache_dir is not None  # from_cli fills in the default
    if args.command == "bench":
        from server.bench import run_bench

        _setup_logging("warning")
        return run_bench(settings.cache_dir, json_path=args.json_path, tokens=args.tokens)
    _setup_logging(settings.log_level)
    if args.command == "demo":
        from dataclasses import replace

        from server.demo import demo_artifacts

        root = demo_artifacts(settings.cache_dir)
        settings = replace(settings, artifacts=root, graph="hf",
                           served_model_name=settings.served_model_name or "gemma-3-270m")

    from server.serve import serve

    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
