"""The host tokenizer without transformers: `tokenizer.json` through the `tokenizers` library, plus the parts of
transformers' fast tokenizer the server uses (special tokens, decode clean-up; chat templates via server.model.chat_template).

Why: importing transformers and building `PreTrainedTokenizerFast` cost ~2 s of start-up for a wrapper whose
encode and decode are the Rust tokenizer's own. What transformers (5.x) adds on top, and which changes ids, text or
rendered prompts, is mirrored here: how the config files name special tokens (and adds the missing ones to the
backend), `clean_up_tokenization_spaces` (skipped for BPE, as transformers does), and which chat template a call
renders (named templates, `tools`). tests/test_tokenizer.py checks all of it against transformers.

Optional load-time cache: the Rust loader parses BPE merges written as `["a", "b"]` pairs markedly slower than the
legacy `"a b"` strings (Gemma's 515k merges: ~1.35 s vs ~0.9 s for the whole file here), so
`from_dir(..., cache_dir=...)` keeps a copy of tokenizer.json with legacy merges, keyed by the original's content hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from server.cache import AtomicFile
from server.model.chat_template import render

log = logging.getLogger(__name__)

# transformers' named special tokens, in its order (the order matters only for ids of tokens it has to add).
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# apply_chat_template arguments transformers consumes itself: they never reach the template.
_TOKENIZING_ONLY = ("padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs")
_UNSUPPORTED = ("tokenize", "continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens")

_CACHE_TAG = "tokenizer-legacy-merges-v1"  # bump when the rewrite changes, so old entries are never read
_STALE_PARTIAL_S = 3600.0  # a temp file this old belongs to a start that died mid-write
# The "merges" key of the BPE model. Inside a JSON string a quote is escaped, so this can only match an object key.
_MERGES_KEY = re.compile(r'"merges"\s*:\s*(?=\[)')


class HostTokenizer:
    """encode / decode / apply_chat_template with the ids and text of transformers' `PreTrainedTokenizerFast`."""

    def __init__(self, backend: Tokenizer, config: Mapping[str, Any], chat_template: str | Mapping[str, str] | None = None,
                 special_tokens_map: Mapping[str, Any] | None = None) -> None:
        """`config` is tokenizer_config.json's content, `special_tokens_map` special_tokens_map.json's (legacy).

        Takes `backend` over: special tokens may be added to it and its padding and truncation are turned off.
        """
        named, extras = _special_tokens(config, special_tokens_map or {}, backend.padding)
        _add_special_tokens(backend, config.get("added_tokens_decoder"), named, extras)
        # transformers' encode() turns padding and truncation off for every call; the server never wants either.
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if backend.post_processor is None:
            # What transformers installs when the file has none (add_bos/eos_token are ignored next to a tokenizer.json).
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        self.backend_tokenizer = backend

        # The template variables transformers passes: every named special token, as a string.
        self._template_tokens = {name: _content(token) for name, token in named.items()}
        self.bos_token: str | None = self._template_tokens.get("bos_token")
        self.eos_token: str | None = self._template_tokens.get("eos_token")
        self.pad_token: str | None = self._template_tokens.get("pad_token")
        self.unk_token: str | None = self._template_tokens.get("unk_token")
        self.bos_token_id = self._token_id(self.bos_token)
        self.eos_token_id = self._token_id(self.eos_token)

        # transformers applies the clean-up to BPE output only when forced: it strips real spaces before punctuation.
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))

        # A dict holds named templates (additional_chat_templates/); "default" is the one used unless a caller picks.
        if isinstance(chat_template, Mapping):
            self._named_templates = dict(chat_template)
            self.chat_template: str | None = chat_template.get("default")
        else:
            self._named_templates = {}
            self.chat_template = chat_template

    @classmethod
    def from_dir(cls, cfg_dir: Path | str, cache_dir: Path | str | None = None) -> HostTokenizer:
        """Load a tokenizer directory the way `PreTrainedTokenizerFast.from_pretrained(cfg_dir)` reads it.

        With `cache_dir`, tokenizer.json loads from a legacy-merges copy kept there (written on first use); any
        problem with the cache silently falls back to the original file.
        """
        cfg_dir = Path(cfg_dir)
        tokenizer_json = cfg_dir / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{tokenizer_json}: missing (HostTokenizer needs a tokenizers-format tokenizer.json)")
        config = _read_json(cfg_dir / "tokenizer_config.json")
        special_tokens_map = _read_json(cfg_dir / "special_tokens_map.json")
        start = time.perf_counter()
        backend = _load_backend(tokenizer_json, None if cache_dir is None else Path(cache_dir))
        log.debug("tokenizer.json loaded in %.2f s", time.perf_counter() - start)
        return cls(backend, config, _read_chat_template(cfg_dir, config), special_tokens_map)

    # ----------------------------------------------------------------- tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(token_id)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend_tokenizer.token_to_id(token)
        if token_id is None and self.unk_token is not None:  # transformers' fallback for a token outside the vocabulary
            token_id = self.backend_tokenizer.token_to_id(self.unk_token)
        return token_id

    # ----------------------------------------------------------------- chat

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            **kwargs: Any) -> str:
        """The prompt text transformers' `apply_chat_template(messages, ..., tokenize=False)` renders.

        `tools`, `documents` and `chat_template` (a template or a template's name) mean what they mean there; other
        keyword arguments are template variables. Template errors raise `jinja2.TemplateError`.
        """
        for name in _UNSUPPORTED:
            if value := kwargs.pop(name, False):
                raise ValueError(f"HostTokenizer.apply_chat_template does not support {name}={value!r}: it renders "
                                 "text only (tokenize with encode())")
        for name in _TOKENIZING_ONLY:  # only mean something when tokenizing, like in transformers with tokenize=False
            kwargs.pop(name, None)
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        source = self._template_source(kwargs.pop("chat_template", None), tools)

        if isinstance(messages, (list, tuple)) and not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if tools is not None:
            if not all(isinstance(tool, dict) for tool in tools):
                raise ValueError("HostTokenizer takes tools as JSON schemas (dicts), not Python functions")
            tools = list(tools)
        if documents is not None and not all(isinstance(document, dict) for document in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")

        # The caller's variables win over the special tokens.
        return render(source, getattr(messages, "messages", messages), tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, variables={**self._template_tokens, **kwargs})

    def _template_source(self, chat_template: str | None, tools: object) -> str:
        if chat_template is not None:
            return self._named_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._named_templates:
            return self._named_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if self._named_templates:  # a dict without "default" (transformers refuses to guess too)
            raise ValueError("This tokenizer has several chat templates and no default; pass chat_template= one of "
                             f"{sorted(self._named_templates)}")
        raise ValueError("This tokenizer has no chat template: its directory has no chat_template.jinja and its "
                         "tokenizer_config.json no chat_template")


# --------------------------------------------------------------------- config files


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _read_chat_template(cfg_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """transformers' resolution: template files replace tokenizer_config.json's chat_template entirely.

    chat_template.json is deliberately not read: transformers' tokenizers ignore it (only processors load it).
    """
    templates: dict[str, str] = {}
    # read_text translates newlines like transformers' open().read(), so "\r\n" templates render the same.
    if (cfg_dir / "chat_template.jinja").is_file():
        templates["default"] = (cfg_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = cfg_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in extra_dir.glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    if isinstance(value, list):  # the serialised form of several named templates
        return {entry["name"]: entry["template"] for entry in value}
    return value if isinstance(value, str) else None


def _token(value: object, special: bool | None = None) -> str | AddedToken | None:
    """A special-token value from a config file: a string, or an AddedToken-like dict."""
    if isinstance(value, (str, AddedToken)):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        flags = {flag: bool(value[flag]) for flag in _TOKEN_FLAGS if flag in value}
        if special is not None:
            flags["special"] = special
        return AddedToken(value["content"], **flags)
    return None


def _content(token: str | AddedToken) -> str:
    return token if isinstance(token, str) else token.content


def _special_tokens(config: Mapping[str, Any], special_tokens_map: Mapping[str, Any],
                    padding: Mapping[str, Any] | None) -> tuple[dict[str, str | AddedToken], list[str | AddedToken]]:
    """(named special tokens, extra special tokens) as transformers 5 resolves them from the config files.

    Named tokens are the seven standard ones plus other `*_token` keys (Gemma's `image_token`, ...) and the entries
    of a dict-valued `extra_special_tokens`; all of them become template variables. The steps follow transformers'
    order because that order decides the ids of named tokens it has to add to the vocabulary.
    """
    kwargs = dict(config)
    if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    # Model-specific tokens given as strings, then a dict of extra special tokens: these come last.
    listed = {key: kwargs.pop(key) for key in list(kwargs)
              if key.endswith("_token") and key not in _NAMED and isinstance(kwargs[key], str)}
    if isinstance(kwargs.get("extra_special_tokens"), Mapping):
        listed.update(kwargs.pop("extra_special_tokens"))
    if "added_tokens_decoder" not in kwargs:
        # special_tokens_map.json is legacy: transformers reads it only for configs without added_tokens_decoder,
        # and then it overrides the config (its dict tokens are special by definition).
        for key, value in special_tokens_map.items():
            if key == "extra_special_tokens" and isinstance(value, list):
                kwargs[key] = [*(kwargs.get(key) or []), *(_token(token, special=True) for token in value)]
            elif isinstance(value, Mapping) and key != "extra_special_tokens":
                kwargs[key] = _token(value, special=True)
            else:
                kwargs[key] = value
        if isinstance(kwargs.get("extra_special_tokens"), Mapping):
            listed.update(kwargs.pop("extra_special_tokens"))
    if "additional_special_tokens" in kwargs and "extra_special_tokens" not in kwargs:
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    if "pad_token" not in kwargs and padding:
        kwargs["pad_token"] = padding.get("pad_token")  # transformers takes the pad token from tokenizer.json's padding

    # The other `*_token` keys, which come first. A dict counts there only in its serialised AddedToken form
    # (plain dicts under the standard names make transformers fail; accepting those is the useful reading).
    found = {key: value for key, value in kwargs.items() if key.endswith("_token") and key not in _NAMED
             and (isinstance(value, (str, AddedToken)) or (isinstance(value, Mapping) and value.get("__type") == "AddedToken"))}
    candidates = [*((key, kwargs.get(key)) for key in _NAMED), *{**found, **listed}.items()]
    named = {key: token for key, value in candidates if (token := _token(value)) is not None}
    extras = kwargs.get("extra_special_tokens")
    return named, [token for value in (extras if isinstance(extras, list) else []) if (token := _token(value)) is not None]


def _add_special_tokens(backend: Tokenizer, added_tokens_decoder: object, named: Mapping[str, str | AddedToken],
                        extras: Sequence[str | AddedToken]) -> None:
    """What `TokenizersBackend.__init__` adds to the backend: it can change ids, splitting and skip-on-decode.

    - the config's added_tokens_decoder entries (transformers re-adds them all, with the config's flags);
    - named and extra special tokens that are not added tokens yet (e.g. a config naming a plain vocab token);
    - a named token that is a non-special added token turns special. Without added_tokens_decoder transformers
      re-adds every added token of tokenizer.json: a no-op except for exactly this promotion.
    """
    named_contents = {_content(token) for token in named.values()}
    current = backend.get_added_tokens_decoder()
    if isinstance(added_tokens_decoder, Mapping):
        entries = sorted(((int(index), _token(value)) for index, value in added_tokens_decoder.items()),
                         key=lambda item: item[0])
        pending: list[str | AddedToken] = [token for _, token in entries if token is not None]
    else:
        pending = [token for _, token in sorted(current.items()) if not token.special and token.content in named_contents]
    known = {token.content for token in current.values()} | {_content(token) for token in pending}
    for token in [*named.values(), *extras]:
        if _content(token) not in known:
            pending.append(token)
            known.add(_content(token))
    to_add = []
    for token in pending:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in named_contents:
            token.special = True  # in place, like transformers: an unset `normalized` then follows `special`
        to_add.append(token)
    if to_add:
        backend.add_tokens(to_add)


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: undo the spaces WordPiece-style decoding puts before punctuation."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


# --------------------------------------------------------------------- tokenizer.json loading and its cache


def _load_backend(tokenizer_json: Path, cache_dir: Path | None) -> Tokenizer:
    if cache_dir is not None:
        try:
            cached = _cached_tokenizer_json(tokenizer_json, cache_dir)
        except Exception as exc:  # an unwritable or broken cache must never stop the server: the original is right
            log.debug("tokenizer cache unusable (%s); loading %s", exc, tokenizer_json)
            cached = None
        if cached is not None:
            try:
                return Tokenizer.from_file(str(cached))
            except Exception as exc:
                log.debug("tokenizer cache entry %s unreadable (%s); removing it", cached, exc)
                with contextlib.suppress(OSError):
                    cached.unlink()  # so the next start writes it again
    return Tokenizer.from_file(str(tokenizer_json))


def _cached_tokenizer_json(tokenizer_json: Path, cache_dir: Path) -> Path | None:
    """The legacy-merges copy of tokenizer_json, written on first use; None when the original is the one to load.

    Keyed by the content hash of the very bytes that get rewritten, so an edited tokenizer.json is never served
    stale. Written to a temp file and renamed, so concurrent starts see a whole file or none. When the legacy form
    can't express the merges (or brings nothing), an empty `.original` marker saves later starts the analysis.
    """
    data = tokenizer_json.read_bytes()
    stem = f"{_CACHE_TAG}-{hashlib.sha256(data).hexdigest()}"
    entry, original_marker = cache_dir / f"{stem}.json", cache_dir / f"{stem}.original"
    if entry.is_file():
        return entry
    if original_marker.is_file():
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(cache_dir)
    # The temp file comes first, so an unwritable cache fails before a second is spent on the rewrite.
    with AtomicFile(cache_dir, f".{stem}.") as out:
        rewritten = _with_legacy_merges(data)
        if rewritten is not None:
            out.write(rewritten)
        out.commit(entry if rewritten is not None else original_marker)
    return entry if rewritten is not None else None


def _with_legacy_merges(data: bytes) -> bytes | None:
    """tokenizer.json with its BPE merges as `"a b"` strings, everything else byte for byte; None if not applicable.

    Only the merges array is parsed (a full json.loads and dumps of the 33 MB file takes longer than the Rust
    load it speeds up). The legacy reader splits each line at its space and skips lines starting with "#version",
    so merges with a space in a token, or such a line, keep the original.
    """
    text = data.decode("utf-8")
    keys = [match.end() for match in _MERGES_KEY.finditer(text)]
    if len(keys) != 1:  # no BPE model (or something unexpected): nothing to gain
        return None
    merges, end = json.JSONDecoder().raw_decode(text, keys[0])
    if not merges or not all(type(pair) is list and len(pair) == 2 for pair in merges):
        return None  # empty, or already legacy strings
    try:
        lines = list(map(" ".join, merges))
    except TypeError:
        return None
    if any(line.count(" ") != 1 or line.startswith("#version") for line in lines):
        return None
    return (text[:keys[0]] + json.dumps(lines, ensure_ascii=False) + text[end:]).encode("utf-8")


def _remove_stale_partials(cache_dir: Path) -> None:
    now = time.time()
    for partial in cache_dir.glob(f".{_CACHE_TAG}-*.partial"):
        with contextlib.suppress(OSError):
            if now - partial.stat().st_mtime > _STALE_PARTIAL_S:
                partial.unlink()
