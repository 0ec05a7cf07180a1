"""One frozen `Settings`, built once at start-up from CLI flags with environment fallbacks.

Nothing else in the package reads the environment: `__main__` hands `os.environ` to `Settings.from_cli`
and passes the result down explicitly (`HF_TOKEN`, for `fetch`, is read by huggingface_hub itself). Every
setting is declared once, as a `Settings` field that carries its flag, env var, type, default and help;
`OPTIONS` and argparse derive from those, and tests/test_config.py holds docs/settings.md's table to them.
"""

from __future__ import annotations

import argparse
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

GRAPH_KINDS = ("auto", "jit", "hf", "null")


@dataclass(frozen=True, slots=True)
class Option:
    """One setting as the command line sees it (derived from its Settings field)."""

    name: str  # the Settings field
    flag: str
    env: str
    kind: Callable[[str], Any]
    help: str
    shown: str  # the default, as --help and the settings table (docs/settings.md) say it
    choices: tuple[str, ...] | None = None  # listed by --help, checked by argparse


def _bounded(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if not (value > low if strict else value >= low):
            raise ValueError(f"must be {'>' if strict else '>='} {low:g}, got {value}")
        return value

    return parse


_positive_int, _positive_float, _non_negative_float = _bounded(int, 1, False), _bounded(float, 0, True), _bounded(float, 0, False)
_non_negative_int = _bounded(int, 0, False)
_budget = _bounded(int, -1, False)  # a token budget, -1 = unlimited


def _user_path(text: str) -> Path:
    return Path(text).expanduser()


def _switch(text: str) -> bool:
    """An on/off setting: a bare flag on the command line, 1/0 (true/false, yes/no, on/off) in the environment."""
    value = text.strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"must be 1 or 0 (true/false, yes/no, on/off), got {text!r}")
    return value in ("1", "true", "yes", "on")


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise ValueError(f"must be a TCP port, 1..65535, got {value}")
    return value


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list (CORS origins, methods, headers); blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


GLOB_CHARACTERS = frozenset("*?[")


def served_names(text: str) -> tuple[str, ...]:
    """--served-model-name's comma-separated names: the first is the model's id, every one is accepted where a request
    names its model; an alias with `*`, `?` or `[...]` is a glob (`claude-*`: any name it matches). An empty item, a
    name given twice or a glob first (the id is a name) is refused (a typo, not a wish)."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise ValueError(f"an empty name in {text[:200]!r}: give comma-separated names, e.g. gemma-4,claude-sonnet-4-5")
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"{twice[:200]!r} is given twice")
    if GLOB_CHARACTERS & set(names[0]):
        raise ValueError(f"the first name, {names[0][:200]!r}, is the model's id and cannot be a glob: put a name "
                         "first, e.g. gemma-4,claude-*")
    return names


def served_as(requested: str, names: Sequence[str]) -> bool:
    """Whether a request's model name reaches the served model: one of `names`, or matched by one that is a glob
    (fnmatch's syntax, case-sensitive as names are)."""
    return requested in names or any(GLOB_CHARACTERS & set(name) and fnmatch.fnmatchcase(requested, name)
                                     for name in names)


def _served_model_name(text: str) -> str:
    served_names(text)  # checked when it is read, so a bad value stops the start with the flag's name
    return text


def _graph_kind(text: str) -> str:
    if text not in GRAPH_KINDS:
        raise ValueError(f"must be one of {', '.join(GRAPH_KINDS)}, got {text!r}")
    return text


VISION_MODES = ("auto", "host", "off")
IMAGE_BUDGETS = (70, 140, 280, 560, 1120)  # the soft-token budgets Gemma-4's image processor takes


def _vision_mode(text: str) -> str:
    if text not in VISION_MODES:
        raise ValueError(f"must be one of {', '.join(VISION_MODES)}, got {text!r}")
    return text


def _image_budget(text: str) -> int:
    value = int(text)
    if value not in IMAGE_BUDGETS:
        raise ValueError(f"must be one of {', '.join(map(str, IMAGE_BUDGETS))}, got {value}")
    return value


DEFAULT_CACHE = "~/.cache/gemma4-optb"


def _setting(flag: str, env: str, kind: Callable[[str], Any], default: Any, help: str, *,  # noqa: A002
             shown: str | None = None, repr: bool = True, choices: tuple[str, ...] | None = None) -> Any:  # noqa: A002
    """A Settings field that is also a command-line option (the one declaration of that setting).

    `shown`: the default as `--help` and docs/settings.md say it, when the value is not self-explanatory (None)."""
    if shown is None:
        shown = "none" if default is None else f"{default:g}" if isinstance(default, float) else str(default)
    return field(default=default, repr=repr, metadata={"option": (flag, env, kind, help, shown, choices)})


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting, declared once; the order here is the order of `--help` and of docs/settings.md's table."""

    artifacts: Path = _setting("--artifacts", "ARTIFACTS_DIR", Path, Path("/data"),
                               "artifact directory (cfg/, embed_tokens.pt, graph)")
    graph: str = _setting("--graph", "GRAPH", _graph_kind, "auto",
                          "graph kind: auto (compiled graph if present, else hf), jit, hf, null", choices=GRAPH_KINDS)
    host: str = _setting("--host", "HOST", str, "127.0.0.1", "bind address (the container sets 0.0.0.0)")
    port: int = _setting("--port", "PORT", _port, 8080, "TCP port (1..65535; bound before anything loads)")
    api_key: str | None = _setting("--api-key", "API_KEY", str, None, "require this key (Authorization: Bearer or "
                                   "X-Api-Key); /health, /metrics stay open", repr=False)
    api_key_file: Path | None = _setting("--api-key-file", "API_KEY_FILE", Path, None,
                                         "read the API key from this file (an empty file is refused at start-up)")
    max_queue: int = _setting("--max-queue", "MAX_QUEUE", _positive_int, 16,
                              "generations admitted at once, the running one included (a request with n choices "
                              "takes n; 429 beyond)")
    max_batch: int = _setting("--max-batch", "MAX_BATCH", _non_negative_int, 0,
                              "most generations running at once, each in its own KV slot, decoded together (0: as many "
                              "as the graph has slots; a one-slot graph runs one; --graph hf keeps this many caches, "
                              "default 4)", shown="0 (the graph's)")
    max_n: int = _setting("--max-n", "MAX_N", _positive_int, 8,
                          "most choices one request may ask for: n, times the prompts of a /v1/completions list "
                          "(400 beyond; they are admitted together, so --max-queue bounds them too)")
    max_model_len: int | None = _setting("--max-model-len", "MAX_MODEL_LEN", _positive_int, None,
                                         "the context a request may use, prompt + completion, at most the build's "
                                         "(vLLM's flag): longer prompts are refused, completions end there, and "
                                         "/v1/models reports it; none: the build's context", shown="none (the build's)")
    reasoning_budget: int = _setting("--reasoning-budget", "REASONING_BUDGET", _budget, -1,
                                     "most tokens a thought may take before its channel is closed and the answer "
                                     "follows (counted within max_tokens); a request's reasoning_budget or "
                                     "reasoning_effort overrides it; -1: unlimited, 0: the thought closes at once",
                                     shown="-1 (unlimited)")
    max_prompt_logprobs: int | None = _setting("--max-prompt-logprobs", "MAX_PROMPT_LOGPROBS", _positive_int, None,
                                               "/v1/completions with echo and logprobs: the longest prompt whose token "
                                               "logprobs are computed (400 beyond; its whole prompt is prefilled and "
                                               "scored, no cached prefix reused)", shown="the context")
    responses_store_max: int = _setting("--responses-store-max", "RESPONSES_STORE_MAX", _non_negative_int, 1000,
                                        "/v1/responses: most stored responses (for previous_response_id and GET); the "
                                        "oldest is evicted first; 0: none kept")
    responses_store_bytes: int = _setting("--responses-store-bytes", "RESPONSES_STORE_BYTES", _non_negative_int,
                                          64 * 1024 * 1024, "/v1/responses: most bytes of JSON the stored responses "
                                          "may hold together (each keeps its whole conversation); the oldest is "
                                          "evicted first")
    served_model_name: str | None = _setting("--served-model-name", "SERVED_MODEL_NAME", _served_model_name, None,
                                             "model id in the API; a comma-separated list adds aliases: the first is "
                                             "the id /v1/models shows and answers carry, every name is accepted in a "
                                             "request's model; an alias with * ? [ is a glob (claude-*: any name it "
                                             "matches)", shown="from cfg/config.json")
    device: str = _setting("--device", "DEVICE", str, "cpu", "torch device for the hf graph (cpu, cuda)")
    request_timeout_s: float = _setting("--request-timeout", "REQUEST_TIMEOUT", _positive_float, 600.0,
                                        'wall-clock limit per request, seconds (then finish_reason: "length")')
    step_timeout_s: float = _setting("--step-timeout", "STEP_TIMEOUT", _positive_float, 120.0,
                                     "one graph call longer than this fails its request; /health says error until "
                                     "it returns")
    shutdown_grace_s: float = _setting("--shutdown-grace", "SHUTDOWN_GRACE", _positive_float, 30.0,
                                       "on SIGTERM, seconds in-flight requests may finish")
    sse_ping_s: float = _setting("--sse-ping", "SSE_PING", _positive_float, 15.0,
                                 "keep-alive interval on streams, seconds: a comment line; on /v1/messages also "
                                 "a ping event while no other event comes (a long prefill, a wait for a slot)")
    max_body_bytes: int = _setting("--max-body-bytes", "MAX_BODY_BYTES", _positive_int, 2 * 1024 * 1024,
                                   "largest accepted request body (413 beyond)")
    body_timeout_s: float = _setting("--body-timeout", "BODY_TIMEOUT", _positive_float, 30.0,
                                     "seconds a client may take to send its request body (408 beyond: a slow sender "
                                     "cannot hold a connection)")
    log_level: str = _setting("--log-level", "LOG_LEVEL", str, "info", "logging level")
    # None (a Settings built in code): derive everything, write nothing. From the command line: DEFAULT_CACHE.
    cache_dir: Path | None = _setting("--cache-dir", "GEMMA4_OPTB_CACHE", _user_path, None,
                                      "start-up caches (the derived model structure, a fast-loading copy of the "
                                      "tokenizer) and the demo export; the image uses /data/.cache",
                                      shown=DEFAULT_CACHE)
    null_step_ms: float = _setting("--null-step-ms", "NULL_STEP_MS", _non_negative_float, 0.0,
                                   "with --graph null: simulated device time per graph call, ms (benchmarks)")
    null_kv_blocks: int = _setting("--null-kv-blocks", "NULL_KV_BLOCKS", _non_negative_int, 0,
                                   "with --graph null: a v4 build's KV pool of this many blocks (block 0 the null "
                                   "block), lent by need and admitted by (0: KV per slot, no pool)")
    null_block_size: int = _setting("--null-block-size", "NULL_BLOCK_SIZE", _positive_int, 128,
                                    "with --null-kv-blocks: positions per block")
    no_ui: bool = _setting("--no-ui", "NO_UI", _switch, False, "do not serve the chat page at / (404 there); the env takes 1/0 "
                           "(true/false, yes/no, on/off)", shown="off")
    lazy_grammar: bool = _setting("--lazy-grammar", "LAZY_GRAMMAR", _switch, False, "build the grammar vocabulary "
                                  "(structured output, forced tool calls) on the first request that needs it, not at "
                                  "start-up: the build holds the GIL ~0.6 s (~1.7 s on a first start); the env takes "
                                  "1/0", shown="off")
    vision: str = _setting("--vision", "VISION", _vision_mode, "auto",
                           "images in: auto (the graph's vision encoder if graph.json declares one, else host if the "
                           "export kept vision.safetensors, else off), host (the vision tower on the CPU, torch: tens "
                           "of seconds per image for the 26B), off (image parts are a 400)", choices=VISION_MODES)
    image_tokens: int = _setting("--image-tokens", "IMAGE_TOKENS", _image_budget, 280,
                                 "soft tokens per image for detail auto (and unset): 70, 140, 280, 560 or 1120; detail "
                                 "low takes 70, high the largest the encoder has")
    max_images_per_request: int = _setting("--max-images-per-request", "MAX_IMAGES_PER_REQUEST", _non_negative_int, 8,
                                           "most images one request may carry (400 beyond)")
    max_image_bytes: int = _setting("--max-image-bytes", "MAX_IMAGE_BYTES", _positive_int, 20 * 1024 * 1024,
                                    "largest encoded image (a data: URL's decoded bytes, or a download), bytes (400 "
                                    "beyond)")
    max_image_pixels: int = _setting("--max-image-pixels", "MAX_IMAGE_PIXELS", _positive_int, 50_000_000,
                                     "most pixels (width x height) an image may declare: a decompression bomb is a 400 "
                                     "before it is decoded")
    allow_image_urls: bool = _setting("--allow-image-urls", "ALLOW_IMAGE_URLS", _switch, False,
                                      "let image parts name http(s) URLs the server downloads (--max-image-bytes, "
                                      "10 s, 3 redirects); off: data: URLs only; the env takes 1/0", shown="off")

    allowed_origins: tuple[str, ...] = _setting(
        "--allowed-origins", "ALLOWED_ORIGINS", _names, (), "CORS: comma-separated origins whose browser pages may call "
        "the API (e.g. https://chat.example.com), or *; none: CORS off", shown="none")
    allowed_methods: tuple[str, ...] = _setting("--allowed-methods", "ALLOWED_METHODS", _names, ("GET", "POST"),
                                                "CORS: methods allowed to those origins, comma-separated, or *",
                                                shown="GET,POST")
    allowed_headers: tuple[str, ...] = _setting("--allowed-headers", "ALLOWED_HEADERS", _names, ("*",),
                                                "CORS: request headers allowed to those origins, comma-separated, or *",
                                                shown="*")
    allow_credentials: bool = _setting(
        "--allow-credentials", "ALLOW_CREDENTIALS", _switch, False, "CORS: let those origins' pages send credentials "
        "(cookies, HTTP auth; fetch's credentials: 'include'): answers carry Access-Control-Allow-Credentials: true; "
        "with --allowed-origins '*' every origin is echoed back, so any page may call with them; the env takes 1/0",
        shown="off")

    def __post_init__(self) -> None:
        _graph_kind(self.graph)
        if self.served_model_name is not None:
            served_names(self.served_model_name)
        _vision_mode(self.vision)
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
        """Flags win over environment variables, which win over defaults."""
        values: dict[str, Any] = {}
        for option in OPTIONS:
            flag_value = getattr(namespace, option.name, None)
            if flag_value is not None:
                values[option.name] = flag_value
            elif environ.get(option.env, "") != "":
                try:
                    values[option.name] = option.kind(environ[option.env])
                except ValueError as exc:
                    raise ValueError(f"{option.env}: {exc}") from exc
        api_key_file = values.get("api_key_file")
        if api_key_file is not None and values.get("api_key") is None:
            key = Path(api_key_file).read_text(encoding="utf-8").strip()
            if not key:  # a secret that did not mount must not silently turn authentication off
                raise ValueError(f"the API key file {api_key_file} is empty")
            values["api_key"] = key
        values.setdefault("cache_dir", _user_path(DEFAULT_CACHE))
        return cls(**values)


OPTIONS: tuple[Option, ...] = tuple(Option(f.name, *f.metadata["option"]) for f in fields(Settings))


def add_options(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None, *,
                helps: Mapping[str, str] | None = None) -> None:
    """Register the settings as flags with no argparse default, so `from_cli` can tell 'unset' from 'set'.

    The metavar is the environment variable's name (or the choices), so `--help` names a value the way the table does;
    `helps` rewords a setting where a command uses it for something narrower (bench's --cache-dir)."""

    def typed(option: Option) -> Callable[[str], Any]:
        def parse(text: str) -> Any:
            try:
                return option.kind(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from exc  # argparse names the flag itself

        parse.__name__ = option.name
        return parse

    for option in OPTIONS:
        if names is not None and option.name not in names:
            continue
        # A switch is a bare flag: present means on.
        how: dict[str, Any] = ({"action": "store_const", "const": True} if option.kind is _switch else
                               {"type": typed(option), "choices": option.choices,
                                "metavar": "{" + ",".join(option.choices) + "}" if option.choices else option.env})
        text = (helps or {}).get(option.name, option.help)
        parser.add_argument(option.flag, dest=option.name, default=None,
                            help=f"{text} (default: {option.shown}) [env {option.env}]", **how)
