"""The host's loaders: the light tokenizer loader is the AutoTokenizer tokenizer, id for id."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from server.runtime import load_tokenizer, release_freed_memory
from tests.models import tokenizer_dir

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Korean 안녕하세요, emoji 🎉🧑‍🚀, Chinese 中文, accents déjà vu",
    "tabs\tand\nnewlines\n\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "Question: What is the capital of France?\nAnswer:",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    return load_tokenizer(tokenizer_dir()), AutoTokenizer.from_pretrained(tokenizer_dir())


@pytest.mark.parametrize("text", TEXTS)
def test_light_loader_encodes_and_decodes_like_autotokenizer(pair: tuple[object, object], text: str) -> None:
    light, auto = pair
    for special in (True, False):
        ids = light(text, add_special_tokens=special)["input_ids"]  # type: ignore[operator]
        assert ids == auto(text, add_special_tokens=special)["input_ids"]  # type: ignore[operator]
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]


def test_light_loader_has_the_same_chat_template_and_specials(pair: tuple[object, object]) -> None:
    light, auto = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]
    render = {"add_generation_prompt": True, "tokenize": False}
    assert light.apply_chat_template(messages, **render) == auto.apply_chat_template(messages, **render)  # type: ignore[attr-defined]
    assert (light.bos_token_id, light.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)  # type: ignore[attr-defined]
    assert light.get_vocab() == auto.get_vocab()  # type: ignore[attr-defined]


def test_release_freed_memory_is_safe_to_call() -> None:
    release_freed_memory()
    release_freed_memory()
