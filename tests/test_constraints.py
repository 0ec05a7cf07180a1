"""Token-level constraints on the real 262k vocabulary (Gemma-4-format test tokenizer): random walks through the
mask always end in output that parses and validates (the `jsonschema` library is the judge), forced tool calls are
always valid calls to the right function, and the mask reaches the logits exactly."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from server.constraints import vocab as vocab_module
from server.constraints.constraint import (
    BannedIds,
    BannedTokens,
    CallFormat,
    Constraint,
    ConstraintError,
    Grammar,
    GrammarConstraint,
    StopAfter,
    StopAfterCall,
    allowed_ids,
    build_matcher,
)
from server.constraints.planner import plan_constraint
from server.constraints.vocab import ConstraintLimits, GrammarVocab
from server.model.tokenizer import HostTokenizer
from server.protocol import collect
from server.protocol.gemma4 import Gemma4Protocol
from server.protocol.gemma4_grammar import GEMMA4_CALLS
from server.sampling.mask import TokenMask, apply_bitmask_
from tests.support.gemma4_tokenizer import GEMMA4_TOKENS, STOP_IDS, gemma4_cfg_dir

V = 262_144
CALL_OPEN, CALL_CLOSE = GEMMA4_TOKENS["<|tool_call>"], GEMMA4_TOKENS["<tool_call|>"]
CHANNEL_OPEN, CHANNEL_CLOSE = GEMMA4_TOKENS["<|channel>"], GEMMA4_TOKENS["<channel|>"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": ["string", "null"], "maxLength": 5}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"},
                   "hourly": {"type": "boolean"},
                   "at": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                          "required": ["lat", "lon"]},
                   "fields": {"type": "array", "items": {"type": "string", "enum": ["temp", "wind", "rain"]},
                              "minItems": 1, "maxItems": 3}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def tokenizer() -> HostTokenizer:
    return HostTokenizer.from_dir(gemma4_cfg_dir())


@pytest.fixture(scope="module")
def vocab(tokenizer: HostTokenizer) -> GrammarVocab:
    return GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS)


@pytest.fixture(scope="module")
def closers(tokenizer: HostTokenizer) -> list[int]:
    """Tokens a walk favours so that free text ends: quotes, brackets, commas, the protocol's closing markers."""
    texts = ['"', '",', '"}', "}", "]", ",", "}}", '"]']
    ids = {tokenizer.encode(text, add_special_tokens=False)[0] for text in texts}
    return sorted(ids | {GEMMA4_TOKENS['<|"|>'], CALL_CLOSE, CHANNEL_CLOSE, *STOP_IDS})


def build_constraint(vocab: GrammarVocab, calls: CallFormat | None = GEMMA4_CALLS, **request) -> Constraint | None:
    """What a run sees: the request's constraint planned (as the API does), then a matcher built from it (as the engine
    does)."""
    spec = plan_constraint(vocab, calls, **request)
    return None if spec is None else build_matcher(vocab, spec)


def walk(constraint, rng: random.Random, closers: list[int], *, prefix: tuple[int, ...] = (),
         max_steps: int = 400) -> list[int]:
    """Sample every step from the mask (forced `prefix` first): uniform when few tokens are allowed, else 30% of
    the time one of the allowed `closers`. Asserts every token is allowed and accepted; returns the ids before the
    stop."""
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    out: list[int] = []
    for step in range(max_steps):
        constraint.fill_mask(mask)
        allowed = allowed_ids(mask, V)
        assert len(allowed) > 0, "the mask allows nothing"
        if step < len(prefix):
            token = prefix[step]
            assert token in allowed
        else:
            favoured = [t for t in closers if mask[t >> 5] >> (t & 31) & 1]
            token = int(rng.choice(favoured) if favoured and len(allowed) > 64 and rng.random() < 0.3
                        else rng.choice(allowed))
        if token in STOP_IDS:
            assert constraint.is_finished or isinstance(constraint, GrammarConstraint)
            return out
        assert constraint.accept(token)
        out.append(token)
    raise AssertionError(f"no stop after {max_steps} tokens")


# --------------------------------------------------------------------- response_format


def test_json_schema_walks_always_validate(vocab, tokenizer, closers) -> None:
    request = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(12):
        constraint = build_constraint(vocab, response_format=request)
        text = tokenizer.decode(walk(constraint, random.Random(seed), closers))
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_walks_are_objects(vocab, tokenizer, closers) -> None:
    for seed in range(12):
        constraint = build_constraint(vocab, response_format={"type": "json_object"})
        assert isinstance(json.loads(tokenizer.decode(walk(constraint, random.Random(seed), closers))), dict)


def test_a_valid_document_is_accepted_and_then_only_stops(vocab, tokenizer) -> None:
    document = {"name": "Ada", "age": 36, "role": "admin", "address": {"city": "London", "zip": None}}
    constraint = build_constraint(vocab, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": PERSON}})
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    for token in tokenizer.encode(json.dumps(document), add_special_tokens=False):
        constraint.fill_mask(mask)
        assert token in allowed_ids(mask, V)
        assert constraint.accept(token)
    constraint.fill_mask(mask)
    assert constraint.is_finished and sorted(allowed_ids(mask, V)) == sorted(STOP_IDS)


def test_a_refused_token_is_reported(vocab, tokenizer) -> None:
    constraint = build_constraint(vocab, response_format={"type": "json_object"})
    assert not constraint.accept(tokenizer.encode("Hello", add_special_tokens=False)[0])


def test_thought_channel_may_precede_json_when_thinking(vocab, tokenizer, closers) -> None:
    thought = (CHANNEL_OPEN, *tokenizer.encode("thought\nLet me think.", add_special_tokens=False), CHANNEL_CLOSE)
    request = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    for seed in range(4):
        constraint = build_constraint(vocab, response_format=request, thinking=True)
        text = tokenizer.decode(walk(constraint, random.Random(seed), closers, prefix=thought))
        message = collect(Gemma4Protocol().parser(parse_tool_calls=False), text)
        assert message.reasoning == "Let me think."
        jsonschema.validate(json.loads(message.content), PERSON)
    without = build_constraint(vocab, response_format=request)  # thinking off: no channel may open
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    without.fill_mask(mask)
    assert CHANNEL_OPEN not in allowed_ids(mask, V)


# --------------------------------------------------------------------- tool calls


def calls_of(tokenizer: HostTokenizer, ids: list[int]) -> list[tuple[str, dict]]:
    message = collect(Gemma4Protocol().parser(tool_names=list(SCHEMAS)), tokenizer.decode(ids))
    assert message.content == "" and message.called_tools
    return [(call.name, json.loads(call.arguments)) for call in message.tool_calls]


def test_named_tool_choice_always_yields_one_valid_call_to_that_function(vocab, tokenizer, closers) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(20):
        constraint = build_constraint(vocab, tools=[CLOCK, WEATHER], tool_choice=choice, parallel_tool_calls=False)
        [(name, arguments)] = calls_of(tokenizer, walk(constraint, random.Random(seed), closers))
        assert name == "get_weather"
        jsonschema.validate(arguments, SCHEMAS[name])


def test_required_tool_choice_yields_valid_calls_to_declared_functions(vocab, tokenizer, closers) -> None:
    names = set()
    for seed in range(20):
        constraint = build_constraint(vocab, tools=[WEATHER, CLOCK], tool_choice="required", thinking=seed % 2 == 0)
        for name, arguments in calls_of(tokenizer, walk(constraint, random.Random(seed), closers)):
            jsonschema.validate(arguments, SCHEMAS[name])
            names.add(name)
    assert names == {"get_weather", "clock"}


def test_a_thought_may_precede_a_forced_call(vocab, tokenizer, closers) -> None:
    thought = (CHANNEL_OPEN, *tokenizer.encode("thought\nThe clock tool.", add_special_tokens=False), CHANNEL_CLOSE)
    constraint = build_constraint(vocab, tools=[CLOCK], tool_choice="required", thinking=True)
    ids = walk(constraint, random.Random(0), closers, prefix=thought)
    message = collect(Gemma4Protocol().parser(tool_names=["clock"]), tokenizer.decode(ids))
    assert message.reasoning == "The clock tool." and message.tool_calls[0].name == "clock"


def test_tool_choice_none_bans_the_call_start(vocab) -> None:
    constraint = build_constraint(vocab, tools=[WEATHER], tool_choice="none")
    assert isinstance(constraint, BannedTokens)
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    constraint.fill_mask(mask)
    assert set(range(V)) - set(allowed_ids(mask, V).tolist()) == {CALL_OPEN}
    assert not constraint.accept(CALL_OPEN) and constraint.accept(CALL_CLOSE)


def test_at_most_one_call_under_auto(vocab) -> None:
    constraint = build_constraint(vocab, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert isinstance(constraint, StopAfterCall)
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    for token in (100, CALL_OPEN, 200):
        constraint.fill_mask(mask)
        assert len(allowed_ids(mask, V)) == V and constraint.accept(token) and not constraint.is_finished
    assert constraint.accept(CALL_CLOSE) and constraint.is_finished
    constraint.fill_mask(mask)
    assert sorted(allowed_ids(mask, V)) == sorted(STOP_IDS)


def test_no_constraint_costs_nothing(vocab) -> None:
    assert build_constraint(vocab) is None
    assert build_constraint(vocab, response_format={"type": "text"}) is None
    assert build_constraint(vocab, tools=[WEATHER]) is None
    assert build_constraint(vocab, tools=[WEATHER], tool_choice="auto", parallel_tool_calls=True) is None


def test_a_planned_constraint_is_a_value_each_run_gets_its_own_matcher(vocab, tokenizer, closers) -> None:
    """The request carries the spec; a run builds a matcher from it, so the same request can run again from scratch
    (after a cache reset, as another choice) and ends the same way."""
    spec = plan_constraint(vocab, GEMMA4_CALLS, tools=[CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert isinstance(spec, Grammar) and hash(spec) == hash(Grammar(spec.lark))
    first, second = build_matcher(vocab, spec), build_matcher(vocab, spec)
    ids = walk(first, random.Random(3), closers)
    assert first.is_finished and not second.is_finished  # the first run's state is its own
    assert walk(second, random.Random(3), closers) == ids
    assert plan_constraint(vocab, GEMMA4_CALLS, tools=[WEATHER], tool_choice="none") == BannedIds((CALL_OPEN,))
    assert plan_constraint(vocab, GEMMA4_CALLS, tools=[WEATHER], parallel_tool_calls=False) == StopAfter(CALL_CLOSE)


# --------------------------------------------------------------------- what cannot be enforced is a clear error


def tool_with(parameter: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": parameter}, "required": ["x"]}}}


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"tools": [tool_with({"type": "string", "pattern": "^a+$"})], "tool_choice": "required"}, "pattern"),
    ({"tools": [tool_with({"type": "integer", "minimum": 1})], "tool_choice": "required"}, "minimum"),
    ({"tools": [tool_with({"type": "string", "format": "email"})], "tool_choice": "required"}, "format"),
    ({"tools": [tool_with({"oneOf": [{"type": "string"}]})], "tool_choice": "required"}, "oneOf"),
    ({"tools": [tool_with({"type": "string", "maxLength": 10**6})], "tool_choice": "required"}, "string lengths"),
    ({"tools": [tool_with({"$ref": "#/$defs/missing"})], "tool_choice": "required"}, "does not resolve"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "no-such-format"}}}}, "cannot enforce"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                         for i in range(1000)}}}}}, "limit"),
    ({"response_format": {"type": "yaml"}}, "not supported"),
])
def test_what_cannot_be_enforced_is_a_constraint_error(vocab, kwargs, needle) -> None:
    with pytest.raises(ConstraintError) as caught:
        build_constraint(vocab, **kwargs)
    assert needle in caught.value.message


def test_tools_on_a_model_without_a_native_format_are_refused(vocab) -> None:
    with pytest.raises(ConstraintError):
        build_constraint(vocab, None, tools=[WEATHER], tool_choice="required")


def test_local_refs_and_any_of_are_inlined(vocab, tokenizer, closers) -> None:
    tool = {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "$defs": {"Zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "properties": {"zone": {"$ref": "#/$defs/Zone"}, "offset": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
        "required": ["zone", "offset"]}}}
    for seed in range(5):
        constraint = build_constraint(vocab, tools=[tool], tool_choice="required", parallel_tool_calls=False)
        message = collect(Gemma4Protocol().parser(), tokenizer.decode(walk(constraint, random.Random(seed), closers)))
        jsonschema.validate(json.loads(message.tool_calls[0].arguments), tool["function"]["parameters"])


def test_limits_bound_depth(tokenizer) -> None:
    small = GrammarVocab.__new__(GrammarVocab)  # only the limits and the token lookup matter to the converter
    small.limits = ConstraintLimits(max_depth=2)
    small._lookup = GEMMA4_TOKENS.get
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "string"}}}}}}}
    from server.protocol.gemma4_grammar import tool_call_grammar

    with pytest.raises(ConstraintError, match="deeper"):
        tool_call_grammar(small, [{"type": "function", "function": {"name": "f", "parameters": deep}}], None)


# --------------------------------------------------------------------- the torch side


@pytest.mark.parametrize("density", [0.0, 1e-5, 1e-3, 0.5, 0.9999, 1.0])
def test_mask_reaches_the_logits_exactly(density: float) -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random(V) < density
    if density > 0 and not allowed.any():
        allowed[123] = True
    bits = np.packbits(allowed.astype(np.uint8), bitorder="little").view(np.int32).copy()
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0))
    expected = torch.where(torch.from_numpy(allowed), logits, torch.tensor(float("-inf")))
    assert torch.equal(apply_bitmask_(logits.clone(), bits), expected)


def test_token_mask_applies_a_constraint(vocab) -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    constraint = build_constraint(vocab, tools=[WEATHER], tool_choice="required")
    row = TokenMask(V).apply_(constraint, logits.clone())
    assert torch.isfinite(row).nonzero().flatten().tolist() == [CALL_OPEN]
    assert row[CALL_OPEN] == logits[CALL_OPEN]


def test_token_mask_reuses_its_plan_only_for_the_same_mask() -> None:
    mask = TokenMask(V)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(2))
    for allowed_ids_now in ([5], [5], list(range(0, V, 2)), list(range(0, V, 2)), [7, 9]):
        allowed = np.zeros(V, dtype=bool)
        allowed[allowed_ids_now] = True
        mask.bits[:] = np.packbits(allowed.astype(np.uint8), bitorder="little").view(np.int32)
        expected = torch.where(torch.from_numpy(allowed), logits, torch.tensor(float("-inf")))
        assert torch.equal(mask.apply_filled_(logits.clone()), expected)


def test_building_constraints_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, server.constraints.constraint; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constraints_know_no_model_family() -> None:
    """server/constraints sits below the chat protocols: the markers and call grammar come through `CallFormat`."""
    import subprocess
    import sys

    code = ("import sys, server.constraints.constraint, server.constraints.planner, server.constraints.json_schema, "
            "server.constraints.vocab; loaded = [m for m in sys.modules if m.startswith('server.protocol')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------- the vocabulary's cached token table


def test_the_vocabulary_from_its_cached_token_table_is_the_one_built_from_the_tokenizer(vocab, tokenizer, closers,
                                                                                        tmp_path) -> None:
    """A later start builds from the table the first start wrote (issue 22): the same tokens, specials, stops and
    masks, token for token, as the build from tokenizer.json."""
    source = gemma4_cfg_dir() / "tokenizer.json"
    first = GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS, cache_dir=tmp_path, source=source)
    assert not first.from_cache
    [entry] = tmp_path.glob("grammar-vocab-v1-*.bin")  # only the entry: no partial file left behind
    cached = GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS, cache_dir=tmp_path, source=source)
    assert cached.from_cache
    ours, theirs = vocab.tokenizer, cached.tokenizer
    assert theirs.vocab_size == ours.vocab_size and theirs.eos_tokens == ours.eos_tokens
    assert all(theirs.decode_bytes([t]) == ours.decode_bytes([t]) and theirs.is_special_token(t) == ours.is_special_token(t)
               for t in range(V))
    text = 'Hi <|tool_call>call:x{a:<|"|>b<|"|>}<tool_call|> ünï 😀'
    assert theirs.tokenize_str(text, parse_special=True) == ours.tokenize_str(text, parse_special=True)

    requests = [{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
                {"response_format": {"type": "json_object"}}, {"tools": [WEATHER, CLOCK], "tool_choice": "required"}]
    for seed, request in enumerate(requests):
        a, b = build_constraint(vocab, **request), build_constraint(cached, **request)
        mask_a, mask_b = np.zeros((V + 31) // 32, dtype=np.int32), np.zeros((V + 31) // 32, dtype=np.int32)
        rng = random.Random(seed)
        for _ in range(400):
            a.fill_mask(mask_a)
            b.fill_mask(mask_b)
            assert np.array_equal(mask_a, mask_b)
            allowed = allowed_ids(mask_a, V)
            favoured = [t for t in closers if mask_a[t >> 5] >> (t & 31) & 1]
            token = int(rng.choice(favoured) if favoured and rng.random() < 0.3 else rng.choice(allowed))
            if token in STOP_IDS:
                break
            assert a.accept(token) and b.accept(token)
        else:
            raise AssertionError("no stop after 400 tokens")

    whole = entry.read_bytes()
    header = whole.index(b"\n", whole.index(b"\n") + 1) + 1
    for torn in (whole[:header - 7], whole[:header + 4 * 1000 + 1], whole[:-1], whole + b"x"):  # mid-header, lengths, bytes
        entry.write_bytes(torn)
        assert vocab_module._read_table(entry) is None
    # A torn entry (a full disk) is passed over, then written whole again.
    rebuilt = GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS, cache_dir=tmp_path, source=source)
    assert not rebuilt.from_cache
    assert GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS, cache_dir=tmp_path, source=source).from_cache


def test_a_vocabulary_cache_that_cannot_be_written_costs_only_time(tokenizer, tmp_path) -> None:
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    vocab = GrammarVocab.from_tokenizer(tokenizer, V, STOP_IDS, cache_dir=blocked, source=gemma4_cfg_dir() / "tokenizer.json")
    assert not vocab.from_cache and vocab.tokenizer.vocab_size == V
