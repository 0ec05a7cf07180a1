"""The grammar vocabulary: the tokenizer as llguidance needs it (`GrammarVocab`, seconds to build, once per model),
built in the background (`VocabLoader`), and the limits that bound every grammar compiled against it.

Why llguidance, not xgrammar (both measured on this host, 2 cores shared with other jobs at load 8-11, the real 262k
Gemma tokenizer, 3 JSON documents forced through a 6-property schema, 215 mask fills each):
                      compile json_schema   compile json_object   fill p50 / p99 (ms)
    llguidance 1.9.1       9-13 ms               1.4-9.5 ms        0.015-0.021 / 2-8 (first pass builds lexer states)
    xgrammar 0.2.9       420-880 ms            430-800 ms          0.003-0.010 / 0.3-1.2
Both fill a mask far under the 0.5 ms goal; xgrammar precomputes a per-grammar cache over the whole vocabulary, so
each new schema costs ~0.5 s of CPU, where llguidance compiles in milliseconds with its work bounded by fuel limits.
Its Lark grammars also reference special tokens by id (`<[48]>`) and intersect regexes (`& ~/.../`), which Gemma's
`<|"|>`-delimited strings need.

Its one-time tokenizer build is one Rust call that holds the GIL from start to end (measured on a quiet host, Gemma's
262k tokens: 1.45 s in `LLTokenizer(tokenizer.json)`, which parses the whole BPE model again, plus 0.26 s serialising
the tokenizer for it; several times that under load). llguidance cannot serialise what it built, but the token table it
derives is plain data, so the first build writes each token's bytes and the special ids under `--cache-dir`
(`grammar-vocab-v1-<hash>.bin`, ~3 MB, keyed by tokenizer.json's content, the vocabulary size and llguidance's version)
and later starts hand that table to llguidance through a `TokenizerWrapper`: 0.57 s, the same tokens, specials and
masks (its tokenizing calls back into the host's own tokenizer). `VocabLoader` does it once per start, off the device
thread. Per-token cost with the torch side: server/tools/bench/constraints.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from server.cache import AtomicFile
from server.constraints.constraint import (
    Constraint,
    ConstraintError,
    ConstraintSpec,
    allowed_ids,
    build_matcher,
    mask_words,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConstraintLimits:
    max_spec_chars: int = 64 * 1024  # JSON text of a schema, or of all tools' parameters together
    max_depth: int = 8  # nesting of objects/arrays (and $ref inlining) in a tool's arguments
    max_properties: int = 256  # over one tool's whole schema
    max_string_length: int = 8192  # maxLength above this is refused (a lexer state per character)
    max_tools: int = 128
    max_compile_s: float = 2.0  # measured after the fact; fuel limits below are what actually bound the work
    grammar_size: int = 200_000  # llguidance: symbols in productions
    lexer_fuel: int = 2_000_000  # llguidance: work to build the lexer (~50k/ms)
    cache_entries: int = 64  # compiled grammars kept for reuse (a copy per run)


class GrammarVocab:
    """The tokenizer as the grammar engine needs it, built once per model (seconds of work: never on the device thread).
    `stop_ids` end generation (eos plus the generation config's and the protocol's extra stops): a finished grammar
    allows exactly those. `token_id(text)`: a special token's id (a chat protocol's markers); ConstraintError if none."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, token_id: Callable[[str], int | None], vocab_size: int,
                 stop_ids: Sequence[int], limits: ConstraintLimits = ConstraintLimits(), *, from_cache: bool = False) -> None:
        self.vocab_size = vocab_size
        self.from_cache = from_cache  # built from the cached token table (the log says so, the tests check it)
        self.stop_ids = tuple(dict.fromkeys(stop_ids))
        self.limits = limits
        self.tokenizer = tokenizer
        self._lookup = token_id
        self._parser_limits = llguidance.LLParserLimits(max_grammar_size=limits.grammar_size,
                                                        initial_lexer_fuel=limits.lexer_fuel, verbose_errors=False)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                       limits: ConstraintLimits = ConstraintLimits(), *, cache_dir: Path | None = None,
                       source: Path | None = None) -> GrammarVocab:
        """From a `HostTokenizer` (or a transformers fast tokenizer): its Rust tokenizer serialised, as llguidance's
        own transformers adapter does; token lookups one at a time (never the 262k-entry `get_vocab()` dict).

        With `cache_dir` and `source` (the tokenizer.json it was loaded from), the token table comes from the cache
        when it holds an entry for that file, and is written there after a build from the tokenizer when it does not.
        A cache entry that cannot be read or written is passed over: the build from the tokenizer is always right."""
        backend = tokenizer.backend_tokenizer
        stops = list(dict.fromkeys(stop_ids))
        entry = None if cache_dir is None or source is None else _cache_entry(Path(cache_dir), Path(source), vocab_size)
        table = None if entry is None else _read_table(entry)
        from_cache, start = table is not None, time.perf_counter()
        if table is not None:
            tokens, table = _TokenTable(*table, eos=stops[0] if stops else None, encode=backend.encode), None
            wrapper = llguidance.TokenizerWrapper(tokens)
            built = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stops)
            # The bytes are read by the build alone (~30 MB of objects); both keep the table for tokenizing only.
            wrapper.tokens = tokens.tokens = []
        else:
            built = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=stops)
            if entry is not None:
                _write_table(entry, built)
        log.info("grammar vocabulary built in %.2f s from %s", time.perf_counter() - start,
                 "the cached token table" if from_cache else "tokenizer.json")
        return cls(built, backend.token_to_id, vocab_size, stops, limits, from_cache=from_cache)

    @property
    def mask_words(self) -> int:
        return mask_words(self.vocab_size)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (a copy of a cached compiled one); ConstraintError if it does not compile.
        A grammar the cache let go since the API compiled it is compiled again, bounded by the fuel alone: the request
        was admitted, and a wall-clock refusal after the work is done would only fail it."""
        compiled = self.compile(grammar, timed=False)
        with self._lock:  # copies are taken under the lock: the compiled original is shared by every thread
            return compiled.deep_copy()

    def compile(self, grammar: str, *, timed: bool = True) -> llguidance.LLMatcher:
        """`grammar` compiled, from the cache or now (then cached); ConstraintError if it does not compile. Shared: run
        a `matcher(grammar)`, never this one."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled
        start = time.perf_counter()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        elapsed = time.perf_counter() - start
        if compiled.is_error():
            raise ConstraintError(f"cannot enforce this schema: {_first_line(compiled.get_error())}")
        if timed and elapsed > self.limits.max_compile_s:
            raise ConstraintError(f"schema too complex to enforce (compiling took {elapsed:.1f} s)")
        self._check_satisfiable(compiled)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self.limits.cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def _check_satisfiable(self, compiled: llguidance.LLMatcher) -> None:
        """Refuse a grammar whose start state allows no token but a stop id: it can only produce the empty output, which
        is no document (e.g. a schema whose `$ref`s only refer to each other). llguidance compiles such a grammar
        without an error and finds out at the first mask, where the matcher stops: served, it answered 200 with
        `content: ""` and finish_reason "stop", a silent non-answer. The first mask is computed on a copy (the compiled
        original stays at its start); it is work the first step would do anyway, and it is cached with the grammar."""
        probe = compiled.deep_copy()
        mask = np.zeros(self.mask_words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if not probe.is_error() and not probe.is_stopped():
            allowed = allowed_ids(mask, self.vocab_size)
            if len(allowed) > len(self.stop_ids) or not set(allowed.tolist()) <= set(self.stop_ids):
                return
        raise ConstraintError(_UNSATISFIABLE)

    def token_id(self, text: str) -> int:
        """The id of the special token `text`; ConstraintError if this vocabulary has none."""
        token = self._lookup(text)
        if token is None:
            raise ConstraintError(f"this model's tokenizer has no {text} token")
        return token

    def special(self, text: str) -> str:
        """The Lark reference to a special token of this vocabulary, by id."""
        return f"<[{self.token_id(text)}]>"


_UNSATISFIABLE = ("can never be satisfied: no non-empty output matches it (for instance `$ref`s that only refer to "
                  "each other, with no schema at the end)")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


# --------------------------------------------------------------------- the token table's cache entry

_CACHE_TAG = "grammar-vocab-v1"  # bump when the file's layout changes
_MAGIC = _CACHE_TAG.encode() + b"\n"


class _TokenTable:
    """What `llguidance.TokenizerWrapper` reads: each token's bytes, the special ids, and a way to tokenize text."""

    def __init__(self, tokens: list[bytes], special: list[int], *, eos: int | None, encode: Callable[..., Any]) -> None:
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos  # overridden by the stop ids given to LLTokenizer
        self.bos_token_id = None
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text, add_special_tokens=False).ids)


def _cache_entry(cache_dir: Path, source: Path, vocab_size: int) -> Path | None:
    """Where the token table of the tokenizer in `source` lives; None when `source` cannot be read."""
    digest = hashlib.sha256(f"{llguidance.__version__}/{vocab_size}/".encode())
    try:
        digest.update(source.read_bytes())  # hashlib lets go of the GIL over large buffers
    except OSError:
        return None
    return cache_dir / f"{_CACHE_TAG}-{digest.hexdigest()}.bin"


def _read_table(entry: Path) -> tuple[list[bytes], list[int]] | None:
    """(each token's bytes, the special ids) from `entry`; None when it is missing or not a whole entry. Python work in
    small steps, so it never holds the GIL for long."""
    lengths = array("I")  # 4-byte unsigned on every platform CPython runs on; checked below
    try:
        data = entry.read_bytes()
        header_end = data.index(b"\n", len(_MAGIC)) + 1
        header = json.loads(data[len(_MAGIC):header_end])
        count, special = int(header["tokens"]), [int(token) for token in header["special"]]
        lengths.frombytes(data[header_end : header_end + 4 * count])
    except (OSError, ValueError, KeyError, TypeError):  # missing, or torn mid-header (ValueError: not whole lengths)
        return None
    ends = list(itertools.accumulate(lengths, initial=header_end + 4 * count))
    if not data.startswith(_MAGIC) or lengths.itemsize != 4 or len(lengths) != count or ends[-1] != len(data):
        return None
    if not all(0 <= token < count for token in special):  # llguidance would panic (a BaseException) on these
        return None
    return [data[begin:end] for begin, end in itertools.pairwise(ends)], special


def _write_table(entry: Path, tokenizer: llguidance.LLTokenizer) -> None:
    """The token table `tokenizer` was built with, into `entry` (atomically); a failure only costs the next start time."""
    tokens = [tokenizer.decode_bytes([token]) for token in range(tokenizer.vocab_size)]
    special = [token for token in range(tokenizer.vocab_size) if tokenizer.is_special_token(token)]
    lengths = array("I", map(len, tokens))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with AtomicFile(entry.parent, f".{entry.name}.") as out:
            out.write(_MAGIC + json.dumps({"tokens": len(tokens), "special": special}).encode() + b"\n")
            out.write(lengths.tobytes())
            out.write(b"".join(tokens))
            out.commit(entry)
    except OSError as exc:
        log.warning("grammar vocabulary cache not written (%s): the next start builds it from tokenizer.json again", exc)


class VocabLoader:
    """Builds the `GrammarVocab` once, on its own thread, after start-up (never on the device thread, never delaying
    readiness): `start()` is idempotent, `wait(timeout)` gives the vocabulary or None if it is not ready in time.

    One per host (the composition root makes it with the host): the API waits for it (on a worker thread, never the
    event loop) before it admits a constrained request, and the engine builds each run's matcher with it
    (`matcher(spec)`, never waiting: the request was admitted after the build); apps built again around the same host
    (tests, the bench) share the build. Its Rust constructor holds the GIL throughout (0.6 s from the cached token
    table, 1.7 s without it, on a quiet host), which is why the server starts it together with the graph load.
    """

    def __init__(self, build: Callable[[], GrammarVocab]) -> None:
        self._build = build
        self._vocab: GrammarVocab | None = None
        self._error: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._waiting = 0  # callers blocked in wait() now

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-vocab", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._vocab = self._build()
        except Exception as exc:  # noqa: BLE001 - reported to every constrained request, the server keeps serving
            self._error = f"{type(exc).__name__}: {exc}"
        self._done.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def waiting(self) -> int:
        """Callers blocked in `wait` now: constrained requests parked until the build is done."""
        return self._waiting

    def wait(self, timeout: float) -> GrammarVocab | None:
        """The vocabulary, or None when it is still building after `timeout`; raises RuntimeError if it failed."""
        self.start()
        if not self._done.is_set():
            with self._lock:
                self._waiting += 1
            try:
                if not self._done.wait(timeout):
                    return None
            finally:
                with self._lock:
                    self._waiting -= 1
        if self._vocab is None:
            raise RuntimeError(f"the grammar vocabulary failed to build: {self._error}")
        return self._vocab

    def matcher(self, spec: ConstraintSpec) -> Constraint:
        """A fresh matcher for one run of a request constrained by `spec` (the engine's, on its device thread). The
        vocabulary is built by then: the API waited for it before it admitted the request."""
        vocab = self.wait(0)
        if vocab is None:
            raise RuntimeError("the grammar vocabulary is not built yet")
        return build_matcher(vocab, spec)
