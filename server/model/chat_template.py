"""Chat templates rendered the way transformers (5.x) renders them, without transformers: its Jinja sandbox with its
globals (`raise_exception`, `strftime_now`, a safe `dict` and `namespace`), its `tojson`, the `{% generation %}`
tag, and its message normalisation (plain data only, None-valued keys dropped, reasoning keys aliased).
tests/test_tokenizer.py checks the rendered prompts against transformers'.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils

# Message keys transformers fills from each other, so templates reading either name see the reasoning.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def render(source: str, messages: Sequence[object], *, tools: Sequence[Mapping[str, Any]] | None = None,
           documents: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False,
           variables: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `source` for these messages; template errors raise `jinja2.TemplateError`."""
    chat = [_chat_message(message) for message in messages]
    return _compile(source).render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **_plain(dict(variables or {})))


def _chat_message(message: object) -> dict[str, Any]:
    """A message as transformers hands it to the template: plain data, None-valued keys dropped, reasoning aliased."""
    plain = _plain(message)
    if not isinstance(plain, dict):
        raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    # Templates handle a missing key but often print "None" for content=None (as OpenAI clients send it).
    plain = {key: value for key, value in plain.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_KEYS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """Everything the template sees rebuilt from plain JSON-like types, as transformers does: objects' methods are
    a way out of the sandbox, so anything else becomes an inert "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    numpy = sys.modules.get("numpy")  # numpy scalars exist only if numpy is loaded; never import it for this
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks where assistant text is for its token masks;
    for rendering, the block is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """`dict` in templates: calls and fromkeys only, not the type itself, whose attributes lead out of the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore names, as transformers' does (they reach CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self: `namespace(self=...)` must still work
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a "
                                              f"namespace, but got {name!r}. Please rename the attribute.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, ') and takes only indent; templates expect transformers' version,
    # positional arguments included (so `tojson(true)` means ensure_ascii).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


@functools.lru_cache(maxsize=32)  # bounded: callers may pass their own template sources
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)
