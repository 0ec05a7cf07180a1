"""The hand-weighted agent model (tests/support/agent_model.py) under transformers' own generate(), with the tests'
Gemma-4 template: what it answers with and without a trigger, after a tool's result, with thinking on, sampled at
temperature 1, and at the far end of its context. The agent CLI tests (test_agents_cli.py) rely on exactly this."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import agent_model as am
from tests.support.gemma4_tokenizer import STOP_IDS, gemma4_cfg_dir

CALL = {"id": "call_1", "type": "function", "function": {"name": "Read", "arguments": {"file_path": am.NOTES_FILE}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma4_cfg_dir())


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return am.build_agent_model(tokenizer)


def _answer(model: Any, tokenizer: Any, messages: list[dict[str, Any]], *, thinking: bool = False, filler: int = 0,
            sample: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if filler:  # ordinary tokens the model does not know, after BOS: a long agent prompt's bulk
        noise = torch.randint(1000, 200_000, (1, filler), generator=torch.Generator().manual_seed(0))
        ids = torch.cat([ids[:, :1], noise, ids[:, 1:]], dim=1)
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else \
        {"do_sample": False}
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=40, eos_token_id=list(STOP_IDS), pad_token_id=0, **kwargs)
    return str(tokenizer.decode(out[0, ids.shape[1]:]))


def test_plain_prompt_answers_the_fixed_text(model: Any, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Say hello."}]
    assert _answer(model, tokenizer, messages) == am.PLAIN_TEXT + "<turn|>"
    assert _answer(model, tokenizer, messages, thinking=True) == am.PLAIN_TEXT + "<turn|>"
    assert _answer(model, tokenizer, messages, sample=True) == am.PLAIN_TEXT + "<turn|>"


@pytest.mark.parametrize(("trigger", "call"), [(am.READ_TRIGGER, am.READ_CALL), (am.SHELL_TRIGGER, am.SHELL_CALL)])
def test_trigger_calls_its_tool(model: Any, tokenizer: Any, trigger: str, call: str) -> None:
    messages = [{"role": "user", "content": f"Show me {am.NOTES_FILE} {trigger}"}]
    assert _answer(model, tokenizer, messages) == call
    assert _answer(model, tokenizer, messages, thinking=True, sample=True) == call


def test_after_the_tool_result_the_fixed_text(model: Any, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": f"Read it {am.READ_TRIGGER}"},
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "the notes"}]
    assert _answer(model, tokenizer, messages) == am.TOOL_TEXT + "<turn|>"
    # a user turn after the result (an agent's reminder text): the result still wins over the trigger
    assert _answer(model, tokenizer, [*messages, {"role": "user", "content": "Go on."}]) == am.TOOL_TEXT + "<turn|>"


def test_the_far_end_of_the_context(model: Any, tokenizer: Any) -> None:
    """38k tokens of filler: the previous-token head still finds distance 1, the decision head the trigger."""
    messages = [{"role": "user", "content": f"Read it {am.READ_TRIGGER}"}]
    assert _answer(model, tokenizer, messages, filler=38_000) == am.READ_CALL
