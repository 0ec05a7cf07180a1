"""One frozen `Settings`, built once at start-up from CLI flags with environment fallbacks.

Nothing else in the package reads the environment: `__main__` hands `os.environ` to `Settings.from_cli`
and passes the result down explicitly. Every setting is declared once in `OPTIONS`, which drives both
argparse and the README's settings table, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

GRAPH_KINDS = ("auto", "jit", "hf", "null")


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its flag, its environment fallback, its type and default."""

    name: str  # the Settings field
    flag: str
    env: str | None
    kind: Callable[[str], Any]
    default: Any
    help: str


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def _user_path(text: str) -> Path:
    return Path(text).expanduser()


def _switch(text: str) -> bool:
    """An on/off setting: a bare flag on the command line, 1/0 (true/false, yes/no, on/off) in the environment."""
    value = text.strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"must be 1 or 0 (true/false, yes/no, on/off), got {text!r}")
    return value in ("1", "true", "yes", "on")


def _graph_kind(text: str) -> str:
    if text not in GRAPH_KINDS:
        raise ValueError(f"must be one of {', '.join(GRAPH_KINDS)}, got {text!r}")
    return text


# Shared by `serve` and `demo`; the order here is the order of the README table.
OPTIONS: tuple[Option, ...] = (
    Option("artifacts", "--artifacts", "ARTIFACTS_DIR", Path, Path("/data"), "artifact directory (cfg/, embed_tokens.pt, graph)"),
    Option("graph", "--graph", "GRAPH", _graph_kind, "auto", "graph kind: auto | jit | hf | null"),
    Option("host", "--host", "HOST", str, "127.0.0.1", "bind address (the container sets 0.0.0.0)"),
    Option("port", "--port", "PORT", int, 8080, "TCP port"),
    Option("api_key", "--api-key", "API_KEY", str, None, "require this key (Authorization: Bearer / X-Api-Key)"),
    Option("api_key_file", "--api-key-file", "API_KEY_FILE", Path, None, "read the API key from this file"),
    Option("max_queue", "--max-queue", "MAX_QUEUE", _positive_int, 16, "requests admitted at once, running one included"),
    Option("served_model_name", "--served-model-name", "SERVED_MODEL_NAME", str, None,
           "model id in the API (default: the artifact directory's model name)"),
    Option("device", "--device", "DEVICE", str, "cpu", "torch device for the hf graph (cpu, cuda)"),
    Option("request_timeout_s", "--request-timeout", "REQUEST_TIMEOUT", _positive_float, 600.0,
           "wall-clock limit per request, seconds (then finish_reason=length)"),
    Option("step_timeout_s", "--step-timeout", "STEP_TIMEOUT", _positive_float, 120.0,
           "a single graph call longer than this fails the request and marks the server unhealthy"),
    Option("shutdown_grace_s", "--shutdown-grace", "SHUTDOWN_GRACE", _positive_float, 30.0,
           "on SIGTERM, seconds to let in-flight requests finish"),
    Option("sse_ping_s", "--sse-ping", "SSE_PING", _positive_float, 15.0, "keep-alive comment interval on streams, seconds"),
    Option("max_body_bytes", "--max-body-bytes", "MAX_BODY_BYTES", _positive_int, 2 * 1024 * 1024,
           "largest accepted request body (413 beyond)"),
    Option("body_timeout_s", "--body-timeout", "BODY_TIMEOUT", _positive_float, 30.0,
           "seconds a client may take to send its request body (408 beyond: a slow sender cannot hold a connection)"),
    Option("log_level", "--log-level", "LOG_LEVEL", str, "info", "logging level"),
    Option("cache_dir", "--cache-dir", "GEMMA4_OPTB_CACHE", _user_path, None,
           "start-up caches (derived model structure, fast-loading tokenizer) and the demo export "
           "(default: ~/.cache/gemma4-optb)"),
    Option("null_step_ms", "--null-step-ms", "NULL_STEP_MS", _non_negative_float, 0.0,
           "with --graph null: simulated device time per graph call, ms (benchmarks)"),
    Option("no_ui", "--no-ui", "NO_UI", _switch, False, "do not serve the chat page at / (404 there)"),
)


@dataclass(frozen=True, slots=True)
class Settings:
    artifacts: Path = Path("/data")
    graph: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = field(default=None, repr=False)
    api_key_file: Path | None = None
    max_queue: int = 16
    served_model_name: str | None = None
    device: str = "cpu"
    request_timeout_s: float = 600.0
    step_timeout_s: float = 120.0
    shutdown_grace_s: float = 30.0
    sse_ping_s: float = 15.0
    max_body_bytes: int = 2 * 1024 * 1024
    body_timeout_s: float = 30.0
    log_level: str = "info"
    cache_dir: Path | None = None  # main() fills in ~/.cache/gemma4-optb
    null_step_ms: float = 0.0
    no_ui: bool = False

    def __post_init__(self) -> None:
        _graph_kind(self.graph)
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
            elif option.env and environ.get(option.env, "") != "":
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
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def add_options(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Register the settings as flags with no argparse default, so `from_cli` can tell 'unset' from 'set'."""

    def typed(option: Option) -> Callable[[str], Any]:
        def parse(text: str) -> Any:
            try:
                return option.kind(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{option.flag}: {exc}") from exc

        parse.__name__ = option.name
        return parse

    for option in OPTIONS:
        if names is not None and option.name not in names:
            continue
        env = f" [env {option.env}]" if option.env else ""
        if option.kind is _switch:  # a bare flag: present means on
            parser.add_argument(option.flag, dest=option.name, action="store_const", const=True, default=None,
                                help=f"{option.help}{env}")
            continue
        parser.add_argument(option.flag, dest=option.name, type=typed(option), default=None,
                            help=f"{option.help} (default: {option.default}){env}")
