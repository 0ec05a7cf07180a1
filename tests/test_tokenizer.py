"""server.model.tokenizer.HostTokenizer against transformers, the reference it replaces: on the real 262k Gemma tokenizer
(ids, decodes, lookups, its chat template, the legacy-merges cache) and on tiny tokenizers built here (config-file
semantics, chat-template features, cache edge cases, decode clean-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from server import cache as cache_module
from server.model import tokenizer as host_tokenizer
from server.model.tokenizer import HostTokenizer
from tests.support.models import tokenizer_dir

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n\r\n",
    "Korean 안녕하세요, emoji 🎉🧑‍🚀👍🏽, Chinese 中文, accents déjà vu, RTL שלום",
    "byte fallback: \ue000\U000f0001\x00\x07 \u2fd5",  # private-use / control characters have no vocab entry
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "specials in text: <bos><eos><pad><unk><mask> and <bos >, </bos>, <BOS>",
    "def f(x):\n    return x ** 2  # code\n",
    "Question: What is the capital of France?\nAnswer: Paris.",
    "a" * 300 + " " + "ab" * 50,
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there <b>&</b> 'quoted'"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Bonjour, ça va ? 你好 🎉"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "  Capital of France?\n", "name": None}],
]
TOOL = {"type": "function", "function": {"name": "weather", "description": "Météo à Zürich",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
DOCUMENT = {"title": "Doc ü", "text": "Text with <tags> & ünïcödé"}
TEMPLATE_KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False, "custom": {"k": ["v", 1, None, 2.5, "é"]}},
    {"tools": [TOOL], "documents": [DOCUMENT], "bos_token": "<override>"},  # a kwarg overrides a special token
]


def outcome(render: Callable[..., str], *args: Any, **kwargs: Any) -> tuple[str, str]:
    """("ok", text) or (error type, message): both tokenizers must agree on either. Messages count for template
    errors only (the template writes them); our own ValueErrors and TypeErrors are worded differently."""
    try:
        return "ok", render(*args, **kwargs)
    except Exception as exc:  # the comparison itself is the assertion
        return type(exc).__name__, str(exc) if isinstance(exc, jinja2.TemplateError) else ""


def render_both(ours: HostTokenizer, ref: Any, chat: list[Any], **kwargs: Any) -> tuple[str, str]:
    """Our outcome, after asserting transformers' (tokenize=False) is the same."""
    got = outcome(ours.apply_chat_template, chat, **kwargs)
    assert got == outcome(ref.apply_chat_template, chat, tokenize=False, **kwargs), (chat, kwargs)
    return got


# --------------------------------------------------------------------- the real Gemma tokenizer


@pytest.fixture(scope="module")
def real_dir() -> Path:
    return tokenizer_dir()


@pytest.fixture(scope="module")
def ours(real_dir: Path) -> HostTokenizer:
    return HostTokenizer.from_dir(real_dir)


@pytest.fixture(scope="module")
def fast(real_dir: Path) -> Any:
    return PreTrainedTokenizerFast.from_pretrained(real_dir)


@pytest.fixture(scope="module")
def auto(real_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(real_dir)


@pytest.fixture(scope="module")
def real_cache(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HostTokenizer, HostTokenizer]:
    """(cache dir, the tokenizer of the start that wrote the cache, the tokenizer of a start that read it)."""
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    first = HostTokenizer.from_dir(real_dir, cache_dir=cache)
    return cache, first, HostTokenizer.from_dir(real_dir, cache_dir=cache)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours: HostTokenizer, fast: Any, auto: Any, text: str) -> None:
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == fast.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)


def test_decode_of_ids_no_text_produces(ours: HostTokenizer, fast: Any, auto: Any) -> None:
    vocab = ours.get_vocab()
    euro = [vocab["<0xE2>"], vocab["<0x82>"], vocab["<0xAC>"]]  # "€" as byte-fallback tokens
    sequences = [
        [2, 106, 107, 0, 1, 3, 4, 2, 2],  # specials only, repeated
        euro, euro[:2], euro[1:], euro[:1] + [vocab["▁a"]] + euro[1:],  # whole, cut and interrupted characters
        [vocab["▁Hello"], 0, vocab["▁world"], 1, vocab["<start_of_turn>"], vocab["\n"]],
        [],
    ]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)


def test_lookups_and_special_tokens_match_transformers(ours: HostTokenizer, fast: Any, auto: Any) -> None:
    for ref in (fast, auto):
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id"):
            assert getattr(ours, name) == getattr(ref, name), name
        assert ours.get_vocab() == ref.get_vocab()
        for token_id in [*range(300), 106, 107, 255_999, 262_143, 262_144, 10**6]:
            assert ours.convert_ids_to_tokens(token_id) == ref.convert_ids_to_tokens(token_id), token_id
    assert (ours.bos_token, ours.bos_token_id, ours.eos_token, ours.eos_token_id) == ("<bos>", 2, "<eos>", 1)


def test_the_directorys_chat_template_renders_like_transformers(ours: HostTokenizer, fast: Any, auto: Any,
                                                                 real_dir: Path) -> None:
    assert ours.chat_template == (real_dir / "chat_template.jinja").read_text(encoding="utf-8") == fast.chat_template
    for chat in CHATS:
        for generation_prompt in (True, False):
            for kwargs in TEMPLATE_KWARGS:
                text = ours.apply_chat_template(chat, add_generation_prompt=generation_prompt, **kwargs)
                for ref in (fast, auto):
                    assert text == ref.apply_chat_template(chat, add_generation_prompt=generation_prompt, tokenize=False,
                                                           **kwargs)
    # The server's call, as transformers takes it: tokenize=False is accepted (and anything else refused).
    assert ours.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False).startswith("<bos><start_of_turn>")
    with pytest.raises(ValueError, match="tokenize"):
        ours.apply_chat_template(CHATS[0], tokenize=True)


def test_legacy_merges_cache_gives_the_same_tokenizer(real_cache: tuple[Path, HostTokenizer, HostTokenizer],
                                                      ours: HostTokenizer) -> None:
    cache, first, cached = real_cache
    entries = list(cache.iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".json", entries  # one entry, no temp files left behind
    head = entries[0].read_text(encoding="utf-8")
    assert '"merges": ["\\n \\n", ' in head  # the legacy form, the rest of the file as it was
    for text in TEXTS:
        for special in (True, False):
            assert first.encode(text, special) == cached.encode(text, special) == ours.encode(text, special)
    assert cached.get_vocab() == ours.get_vocab()
    added = ours.backend_tokenizer.get_added_tokens_decoder()
    assert {i: repr(t) for i, t in cached.backend_tokenizer.get_added_tokens_decoder().items()} == {
        i: repr(t) for i, t in added.items()}


def test_the_streaming_detokenizer_takes_it(ours: HostTokenizer) -> None:
    from server.model.detok import IncrementalDetokenizer

    for text in TEXTS:
        ids = ours.encode(text)
        for skip in (True, False):
            detok = IncrementalDetokenizer(ours, skip_special_tokens=skip)
            assert "".join(detok.push(token_id) for token_id in ids) + detok.flush() == ours.decode(ids, skip), text


def test_importing_and_using_it_never_loads_transformers(real_dir: Path, tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from server.model.tokenizer import HostTokenizer\n"
        "t = HostTokenizer.from_dir(sys.argv[1], cache_dir=Path(sys.argv[2]))\n"
        "t.decode(t.encode('hi')); t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(real_dir), str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


# --------------------------------------------------------------------- tiny tokenizers


CORPUS = ["Hello world, hello there!", "The quick brown fox jumps over the lazy dog.", "ça va? très bien, merci.",
          "don't stop; it's fine. Isn't it?"] * 3
TINY_TEXTS = ["Hello world", "hello there, ça va?", " the  lazy dog. ", "<s>Hello</s><pad>", "a <mask> b <extra> c",
              "don't stop ; it 's fine .", "zzz ??? 123", ""]


def tiny_bpe(dest: Path, corpus: list[str] = CORPUS, added: list[AddedToken] | None = None,
             configure: Callable[[Tokenizer], None] | None = None) -> Path:
    """A small Metaspace BPE (like Gemma's, without byte fallback) saved as dest/tokenizer.json."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    if added:
        tok.add_tokens(added)
    if configure is not None:
        configure(tok)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save(str(dest / "tokenizer.json"))
    return dest


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")


def pair(cfg: Path) -> tuple[HostTokenizer, Any]:
    return HostTokenizer.from_dir(cfg), PreTrainedTokenizerFast.from_pretrained(cfg)


def assert_same_tokenizer(cfg: Path, texts: list[str] = TINY_TEXTS) -> tuple[HostTokenizer, Any]:
    ours, ref = pair(cfg)
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (text, skip)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.get_vocab() == ref.get_vocab()
    size = ours.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    assert [ours.convert_ids_to_tokens(i) for i in range(size + 2)] == [ref.convert_ids_to_tokens(i) for i in range(size + 2)]
    return ours, ref


SPECIALS_TEMPLATE = ("{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ mask_token }}|{{ sep_token }}|"
                     "{{ cls_token }}|{{ image_token }}|{{ boi_token }}|{{ eoi_token }}|{{ extra_token }}")


def assert_same_template_variables(ours: HostTokenizer, ref: Any) -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, chat_template=SPECIALS_TEMPLATE) == ref.apply_chat_template(
        chat, chat_template=SPECIALS_TEMPLATE, tokenize=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_bpe(tmp_path_factory.mktemp("tiny"))
    write_json(cfg / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                               "pad_token": "<pad>", "image_token": "<img>"})
    return cfg


# Chat templates exercising each part of transformers' environment, rendered on CHATS x TEMPLATE_KWARGS x both
# add_generation_prompt values; ours must give the same text or the same error.
TEMPLATES = {
    "blocks": (
        "{{ bos_token }}\n"
        "{% for message in messages %}\n"
        "    {% if message['role'] == 'system' %}\n"
        "<<SYS>>{{ message['content'] | trim }}<</SYS>>\n"
        "    {% else %}\n"
        "[{{ message['role'] | upper }}] {{ message['content'] }}{{ eos_token if message['role'] == 'assistant' }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[ASSISTANT] {% endif %}\n"
    ),
    "tojson": (
        "{{ messages | tojson }}\n{{ messages | tojson(indent=2) }}\n{{ tools | tojson(indent=4, sort_keys=true) }}\n"
        "{{ documents | tojson }}\n{{ {'b': 'é', 'a': '<&>'} | tojson(separators=(',', ':')) }}\n{{ 'ü' | tojson(true) }}"
        "{{ custom | default(none) | tojson }}"
    ),
    "loopcontrols": ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "{{ loop.index }}:{{ m.content }};{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"),
    "variables": ("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ mask_token is defined }}|"
                  "{{ image_token | default('-') }}|{{ tools is none }}|{{ documents is none }}|"
                  "{{ enable_thinking | default('unset') }}|{{ add_generation_prompt }}|{{ messages | length }}"),
    "messages": ("{% for m in messages %}{{ m | tojson }}|{{ m.name is defined }}|{{ m.reasoning_content | default('') }}|"
                 "{{ m.thinking | default('') }}\n{% endfor %}"),
    "namespace_dict_generation": (
        "{% set ns = namespace(n=0, text='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}{{ ns.n }}"
        "{{ dict(a=1, b=[1, 2]) | tojson }}{{ dict.fromkeys(['x', 'y'], 0) | tojson }}"
        "{% set named_self = namespace(self='s') %}{{ named_self.self }}"
    ),
    "strftime_now": "{{ strftime_now is defined }} {{ strftime_now('%Y') }} {{ messages[-1].content }}",
    "raise_exception": ("{% if messages[0]['role'] != 'user' %}"
                        "{{ raise_exception('Conversations must start with a user message, not ' + messages[0]['role']) }}"
                        "{% endif %}{{ messages[0]['content'] }}"),
    "namespace_underscore": "{% set ns = namespace() %}{% set ns._secret = 1 %}{{ ns._secret }}",
    "syntax_error": "{% for m in messages %}{{ m.content }}",
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_templates_render_like_transformers(name: str, tiny: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    for item in tiny.iterdir():
        (cfg / item.name).write_bytes(item.read_bytes())
    (cfg / "chat_template.jinja").write_text(TEMPLATES[name], encoding="utf-8")
    ours, ref = pair(cfg)
    results = set()
    for chat in CHATS:
        for generation_prompt in (True, False):
            for kwargs in TEMPLATE_KWARGS:
                results.add(render_both(ours, ref, chat, add_generation_prompt=generation_prompt, **kwargs)[0])
    expected = {"raise_exception": {"ok", "TemplateError"}, "namespace_underscore": {"SecurityError"},
                "syntax_error": {"TemplateSyntaxError"}}.get(name, {"ok"})
    assert results == expected


def test_template_errors_are_jinja_template_errors(tiny: Path) -> None:
    ours = HostTokenizer.from_dir(tiny)
    system_first = CHATS[1]
    for name in ("raise_exception", "namespace_underscore", "syntax_error"):
        with pytest.raises(jinja2.TemplateError):
            ours.apply_chat_template(system_first, chat_template=TEMPLATES[name])
    with pytest.raises(jinja2.TemplateError, match="must start with a user message, not system"):
        ours.apply_chat_template(system_first, chat_template=TEMPLATES["raise_exception"])


def test_strftime_now_is_the_current_time(tiny: Path) -> None:
    from datetime import datetime

    before = datetime.now().strftime("%Y")
    text = HostTokenizer.from_dir(tiny).apply_chat_template(CHATS[0], chat_template="{{ strftime_now('%Y') }}")
    assert text in {before, datetime.now().strftime("%Y")}


def test_message_objects_and_arguments_transformers_consumes(tiny: Path) -> None:
    from dataclasses import dataclass

    @dataclass
    class Message:
        role: str
        content: str | None
        tool_calls: list[Any] | None = None

    ours, ref = pair(tiny)
    template = "{% for m in messages %}{{ m | tojson }}{% endfor %}{{ weird | default('') }}"
    chat = [Message("user", "hi"), {"role": "assistant", "content": None, "thinking": "hmm"}]
    kwargs = {"chat_template": template, "weird": object(), "padding": True, "max_length": 3, "return_dict": True}
    assert ours.apply_chat_template(chat, **kwargs) == ref.apply_chat_template(chat, tokenize=False, **kwargs)
    for bad in ({"continue_final_message": True}, {"return_assistant_tokens_mask": True}):
        with pytest.raises(ValueError):
            ours.apply_chat_template(chat, chat_template=template, **bad)
    assert render_both(ours, ref, [], chat_template=template)[0] == "ValueError"
    assert render_both(ours, ref, ["not a message"], chat_template=template)[0] == "TypeError"


def template_dir(base: Path, name: str, jinja: str | None = None, config_template: object = None,
                 extra: dict[str, str] | None = None, legacy_json: str | None = None, crlf: bool = False) -> Path:
    cfg = tiny_bpe(base / name)
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>"}
    if config_template is not None:
        config["chat_template"] = config_template
    write_json(cfg / "tokenizer_config.json", config)
    if jinja is not None:
        (cfg / "chat_template.jinja").write_bytes(jinja.replace("\n", "\r\n" if crlf else "\n").encode())
    for template_name, source in (extra or {}).items():
        (cfg / "additional_chat_templates").mkdir(exist_ok=True)
        (cfg / "additional_chat_templates" / f"{template_name}.jinja").write_text(source, encoding="utf-8")
    if legacy_json is not None:
        write_json(cfg / "chat_template.json", {"chat_template": legacy_json})
    return cfg


def test_chat_template_sources_resolve_like_transformers(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}]
    dirs = {
        "jinja_wins": template_dir(tmp_path, "a", jinja="jinja {{ messages[0].content }}", config_template="config"),
        "config_only": template_dir(tmp_path, "b", config_template="config {{ bos_token }}"),
        "config_list": template_dir(tmp_path, "c", config_template=[{"name": "default", "template": "default"},
                                                                  {"name": "tool_use", "template": "tools {{ tools }}"}]),
        "files": template_dir(tmp_path, "d", jinja="file default", extra={"tool_use": "file tools", "rag": "file rag"}),
        "no_default": template_dir(tmp_path, "e", extra={"rag": "rag only"}),
        "crlf": template_dir(tmp_path, "f", jinja="{% if true %}\nline\n{% endif %}\n{{ bos_token }}\n", crlf=True),
        "legacy_json_ignored": template_dir(tmp_path, "g", legacy_json="from chat_template.json"),
        "none": template_dir(tmp_path, "h"),
    }
    calls: list[dict[str, Any]] = [{}, {"tools": [TOOL]}, {"tools": []}, {"chat_template": "tool_use"},
                                   {"chat_template": "rag"}, {"chat_template": "default"},
                                   {"chat_template": "inline {{ eos_token }}"}]
    for name, cfg in dirs.items():
        ours, ref = pair(cfg)
        assert ours.chat_template == (ref.chat_template.get("default") if isinstance(ref.chat_template, dict)
                                      else ref.chat_template), name
        for kwargs in calls:
            assert render_both(ours, ref, chat, **kwargs)[0] in ("ok", "ValueError"), name
    with pytest.raises(ValueError, match="no chat template"):
        HostTokenizer.from_dir(dirs["none"]).apply_chat_template(chat)


def test_special_tokens_from_the_config_files_like_transformers(tmp_path: Path) -> None:
    def config_dir(name: str, config: dict[str, Any], special_tokens_map: dict[str, Any] | None = None,
                   added: list[AddedToken] | None = None, configure: Callable[[Tokenizer], None] | None = None) -> Path:
        cfg = tiny_bpe(tmp_path / name, added=added, configure=configure)
        write_json(cfg / "tokenizer_config.json", config)
        if special_tokens_map is not None:
            write_json(cfg / "special_tokens_map.json", special_tokens_map)
        return cfg

    def flags(content: str, **kw: bool) -> dict[str, Any]:
        return {"content": content, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                "special": True, **kw}

    def padded_and_truncated(tok: Tokenizer) -> None:
        tok.enable_padding(pad_id=1, pad_token="<s>", length=16)
        tok.enable_truncation(max_length=4)

    cases = {
        # special_tokens_map.json (legacy) overrides the config when the config has no added_tokens_decoder
        "map_overrides": config_dir("a", {"bos_token": "<s>", "eos_token": "<s>"},
                                    {"eos_token": flags("</s>"), "pad_token": "<unk>"}),
        # ...and is ignored when it has one; the config's flags for added tokens win (lstrip/rstrip change splits)
        "added_tokens_decoder": config_dir(
            "b", {"bos_token": "<s>", "eos_token": "</s>", "added_tokens_decoder": {
                "1": flags("<s>", rstrip=True), "2": flags("</s>", lstrip=True), "120": flags("<extra>", special=False)}},
            {"eos_token": "<unk>"}),
        # named tokens missing from the vocabulary (or only plain vocab entries) are added as special tokens
        "missing_named": config_dir("c", {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>",
                                          "sep_token": {"__type": "AddedToken", **flags("Hello", special=False)}}),
        # a named token that is a non-special added token turns special (skipped on decode)
        "promoted": config_dir("d", {"bos_token": "<s>", "pad_token": "<pad>"},
                               added=[AddedToken("<pad>", special=False), AddedToken("<extra>", special=False)]),
        # Gemma-style model-specific tokens and extra special tokens, as strings, dicts and lists
        # (a plain dict under a non-standard name is not a token for transformers; with "__type" it is)
        "model_specific": config_dir("e", {"bos_token": "<s>", "image_token": "<img>", "boi_token": flags("<boi>"),
                                           "eoi_token": {"__type": "AddedToken", **flags("<eoi>")},
                                           "extra_special_tokens": {"extra_token": "<extra>"}}),
        "extra_list": config_dir("f", {"bos_token": "<s>",
                                       "additional_special_tokens": ["<extra>", {"__type": "AddedToken", **flags("<x2>")}]},
                                 {"extra_special_tokens": ["<x3>"]}),
        # tokenizer.json's padding names the pad token; padding and truncation never apply to encode()
        "padding": config_dir("g", {"eos_token": "</s>"}, configure=padded_and_truncated),
        "split_special_tokens": config_dir("h", {"bos_token": "<s>", "eos_token": "</s>", "split_special_tokens": True}),
        "no_config": tiny_bpe(tmp_path / "i"),
    }
    def skipped(tok: HostTokenizer, token: str) -> bool:
        ids = tok.encode(f"a {token} b", add_special_tokens=False)
        return token in tok.decode(ids) and token not in tok.decode(ids, skip_special_tokens=True)

    # Each case does exercise what it says (beyond agreeing with transformers).
    checks: dict[str, Callable[[HostTokenizer], bool]] = {
        "map_overrides": lambda tok: (tok.eos_token, tok.pad_token) == ("</s>", "<unk>"),
        "added_tokens_decoder": lambda tok: tok.eos_token == "</s>" and tok.get_vocab()["<extra>"] == 120,
        "missing_named": lambda tok: skipped(tok, "<mask>") and skipped(tok, "Hello"),
        "promoted": lambda tok: skipped(tok, "<pad>") and not skipped(tok, "<extra>"),
        "model_specific": lambda tok: tok.apply_chat_template(CHATS[0], chat_template=SPECIALS_TEMPLATE).endswith(
            "|<img>||<eoi>|<extra>"),
        "extra_list": lambda tok: all(skipped(tok, token) for token in ("<extra>", "<x2>", "<x3>")),
        "padding": lambda tok: tok.pad_token == "<s>" and len(tok.encode("the lazy dog " * 3)) > 4,
        "split_special_tokens": lambda tok: tok.encode("<s>", add_special_tokens=False) != [1],
        "no_config": lambda tok: tok.bos_token is None and tok.encode("<s>x") == tok.encode("<s>x", False),
    }
    for name, cfg in cases.items():
        try:
            ours, ref = assert_same_tokenizer(cfg, [*TINY_TEXTS, "<x2> <x3> <img><boi><eoi> Hello<s> </s>x"])
            assert_same_template_variables(ours, ref)
            assert checks[name](ours)
        except AssertionError as exc:
            raise AssertionError(f"case {name}: {exc}") from exc


def test_clean_up_tokenization_spaces_like_transformers(tmp_path: Path) -> None:
    words = ["hello", ",", "world", ".", "don", "n't", "it", "'s", "?", "!", "<unk>"]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "wl").mkdir()
    word_level.save(str(tmp_path / "wl" / "tokenizer.json"))
    write_json(tmp_path / "wl" / "tokenizer_config.json", {"unk_token": "<unk>", "clean_up_tokenization_spaces": True})
    ours, ref = assert_same_tokenizer(tmp_path / "wl", ["hello , world . don n't it 's ? !"])
    assert ours.decode(ours.encode("hello , world .")) == "hello, world."  # it did clean up

    # BPE: transformers skips the clean-up (it would eat real spaces) unless forced.
    for name, force in (("bpe", False), ("bpe_forced", True)):
        cfg = tiny_bpe(tmp_path / name)
        forcing = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        write_json(cfg / "tokenizer_config.json", {"clean_up_tokenization_spaces": True, forcing: force})
        ours, ref = assert_same_tokenizer(cfg, ["don't stop ; it 's fine . Isn't it ?"])
        assert (ours.decode(ours.encode("fine .")) == "fine.") is force


# --------------------------------------------------------------------- the legacy-merges cache on tiny tokenizers


def cache_entries(cache: Path) -> list[str]:
    return sorted(path.name.rsplit(".", 1)[-1] for path in cache.iterdir())


def test_cache_writes_once_and_follows_edits(tmp_path: Path) -> None:
    cfg, cache = tiny_bpe(tmp_path / "cfg"), tmp_path / "cache" / "nested"
    plain = HostTokenizer.from_dir(cfg)
    first = HostTokenizer.from_dir(cfg, cache_dir=cache)
    assert cache_entries(cache) == ["json"]
    (entry,) = cache.iterdir()
    assert all(isinstance(merge, str) for merge in json.loads(entry.read_text(encoding="utf-8"))["model"]["merges"])
    written = entry.stat().st_mtime_ns
    second = HostTokenizer.from_dir(cfg, cache_dir=cache)
    assert entry.stat().st_mtime_ns == written  # read, not rewritten
    for text in TINY_TEXTS:
        assert plain.encode(text) == first.encode(text) == second.encode(text)

    tiny_bpe(cfg, corpus=["completely different words here", "zzz yyy xxx"] * 5)  # an edited tokenizer.json
    edited = HostTokenizer.from_dir(cfg, cache_dir=cache)
    assert cache_entries(cache) == ["json", "json"]
    for text in TINY_TEXTS:
        assert edited.encode(text) == HostTokenizer.from_dir(cfg).encode(text)
    assert edited.encode("zzz yyy") != plain.encode("zzz yyy")


def test_the_entry_appears_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cfg = tiny_bpe(tmp_path / "cfg")
    seen: list[list[str]] = []
    rewrite = host_tokenizer._with_legacy_merges

    def watched(data: bytes) -> bytes | None:
        seen.append(cache_entries(tmp_path / "cache"))
        return rewrite(data)

    with monkeypatch.context() as patch:
        patch.setattr(host_tokenizer, "_with_legacy_merges", watched)
        HostTokenizer.from_dir(cfg, cache_dir=tmp_path / "cache")
    assert seen == [["partial"]]  # while rewriting only the temp file exists; the entry's name appears by rename
    assert cache_entries(tmp_path / "cache") == ["json"]

    with ThreadPoolExecutor(4) as pool:  # concurrent first starts: each writes its own temp file
        loaded = list(pool.map(lambda _: HostTokenizer.from_dir(cfg, cache_dir=tmp_path / "racing"), range(4)))
    assert cache_entries(tmp_path / "racing") == ["json"]
    assert len({tuple(tok.encode(TINY_TEXTS[1])) for tok in loaded}) == 1


def test_cache_problems_fall_back_to_the_original(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_bpe(tmp_path / "cfg")
    want = [HostTokenizer.from_dir(cfg).encode(text) for text in TINY_TEXTS]

    def same(tok: HostTokenizer) -> bool:
        return [tok.encode(text) for text in TINY_TEXTS] == want

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert same(HostTokenizer.from_dir(cfg, cache_dir=not_a_dir))  # can't even be created (root can write anywhere)
    assert same(HostTokenizer.from_dir(cfg, cache_dir=not_a_dir / "sub"))

    cache = tmp_path / "cache"
    with monkeypatch.context() as patch:  # a failing write (disk full, ...) leaves no entry and no temp file
        patch.setattr(cache_module.os, "replace", lambda *_: (_ for _ in ()).throw(OSError("disk full")))
        assert same(HostTokenizer.from_dir(cfg, cache_dir=cache))
    assert list(cache.iterdir()) == []

    HostTokenizer.from_dir(cfg, cache_dir=cache)
    (entry,) = cache.iterdir()
    entry.write_text('{"truncated": ')  # a damaged entry: used once, found unreadable, removed
    assert same(HostTokenizer.from_dir(cfg, cache_dir=cache))
    assert list(cache.iterdir()) == []
    assert same(HostTokenizer.from_dir(cfg, cache_dir=cache)) and cache_entries(cache) == ["json"]


def manual_bpe(dest: Path, vocab: list[str], merges: list[tuple[str, str]]) -> Path:
    tok = Tokenizer(models.BPE({token: i for i, token in enumerate(vocab)}, merges, unk_token="<unk>"))
    dest.mkdir(parents=True)
    tok.save(str(dest / "tokenizer.json"))
    return dest


@pytest.mark.parametrize("kind", ["space_in_merge", "version_line", "legacy_already", "word_level"])
def test_merges_the_legacy_form_cannot_say_are_not_rewritten(kind: str, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg"
    if kind == "space_in_merge":
        manual_bpe(cfg, ["<unk>", "a", " ", "b", "a ", "a b"], [("a", " "), ("a ", "b")])
    elif kind == "version_line":  # the legacy reader drops merge lines starting with "#version"
        word = "#version1"
        merges = [(word[:i], word[i]) for i in range(1, len(word))]  # "#" + "v", "#v" + "e", ..., "#version" + "1"
        manual_bpe(cfg, ["<unk>", *word, *(a + b for a, b in merges)], merges)
    elif kind == "legacy_already":
        manual_bpe(cfg, ["<unk>", "a", "b", "ab"], [("a", "b")])
        document = json.loads((cfg / "tokenizer.json").read_text(encoding="utf-8"))
        document["model"]["merges"] = ["a b"]
        write_json(cfg / "tokenizer.json", document)
    else:
        cfg.mkdir()
        Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(cfg / "tokenizer.json"))
    cache = tmp_path / "cache"
    texts = ["a b", "ab a", "#version1", "#version 1", "a  b"]
    want = [HostTokenizer.from_dir(cfg).encode(text) for text in texts]
    for _ in range(2):  # the second start finds the marker
        assert [HostTokenizer.from_dir(cfg, cache_dir=cache).encode(text) for text in texts] == want
        assert cache_entries(cache) == ["original"]
    if kind == "space_in_merge":
        assert want[0] == [5]  # "a b" is one token, through both merges
    if kind == "version_line":
        assert want[2] == [HostTokenizer.from_dir(cfg).get_vocab()["#version1"]]


def test_stale_partial_files_are_cleaned_up(tmp_path: Path) -> None:
    cfg, cache = tiny_bpe(tmp_path / "cfg"), tmp_path / "cache"
    cache.mkdir()
    stale, fresh = cache / f".{host_tokenizer._CACHE_TAG}-dead.1.partial", cache / f".{host_tokenizer._CACHE_TAG}-x.2.partial"
    for path in (stale, fresh):
        path.write_text("half a file")
    os.utime(stale, (1, 1))
    HostTokenizer.from_dir(cfg, cache_dir=cache)
    assert not stale.exists() and fresh.exists()  # a fresh one may be another start's write in progress


def test_host_tokenizer_is_the_tokenizer_the_api_and_the_engine_take(tmp_path: Path) -> None:
    """server.engine.types.Tokenizer is a Protocol, which nothing checks at run time: the type checker holds
    HostTokenizer to it (every method and attribute, with their signatures), with pyproject's settings."""
    check = tmp_path / "served.py"
    check.write_text("from server.engine.types import Tokenizer\nfrom server.model.tokenizer import HostTokenizer\n"
                     "def served(tokenizer: HostTokenizer) -> Tokenizer:\n    return tokenizer\n")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), str(check)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
