"""A hand-weighted tiny Gemma-4 that behaves like an agent's model: fixed text, or a tool call when the user asks.

transformers' own `Gemma4ForCausalLM`, two layers, every weight set here (nothing trained), the tests' Gemma-4
tokenizer and template. Greedy, it answers:

- a prompt that holds a trigger (`READ_TRIGGER`, `SHELL_TRIGGER`) and no tool result: that trigger's tool call in
  Gemma-4's format (`<|tool_call>call:NAME{...}<tool_call|>`), then `<|tool_response>` (a stop token);
- a prompt that holds a tool result (`<|tool_response>` / `<tool_response|>`): `TOOL_TEXT`, then `<turn|>`;
- any other prompt: `PLAIN_TEXT`, then `<turn|>`.

How (all in the residual stream's named dimensions, `_Dims`):
- the embedding gives every token a constant BIAS dimension, and the few tokens the model knows (the chains' tokens,
  BOS, the triggers, the tool-response markers) one identity dimension each; every other token is the bias alone;
- layer 0 (sliding, with a window larger than any prompt, so its ring never wraps and the server's prefix reuse
  works) is a previous-token head: its query and key are the bias dimension, rotated so that the score peaks at
  distance 1 (RoPE's frequencies, `_PREV_THETA`, chosen so that distance 1 beats every other distance up to the
  context by a wide margin); its value is the previous token's identity, written to the PREV dimensions;
- layer 1 (global) is the decision head: in its dimensions RoPE leaves alone (partial rotary), a query from the bias
  matches keys only the trigger, tool-response and BOS tokens have, scored response > trigger > BOS (the sink when
  nothing matches); its value names the winner in a FLAG dimension;
- the MLPs are zero; the untied lm_head reads (current token, previous token, flag): logit[next] is a*[cur] +
  c*[prev] (+ f*[flag] where the flag decides), a > c > f, so a chain token that repeats (`:` and `<|"|>` do) is
  told apart by its predecessor, and the one choice that needs the whole prompt (at the generation prompt's end:
  call, or text) by the flag.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_TRIGGER = "🦉"  # one token each in the Gemma tokenizer, and found in no agent's own prompt
SHELL_TRIGGER = "🐙"
PLAIN_TEXT = "Hello from the tiny agent model."
TOOL_TEXT = "The notes say: all done."
NOTES_FILE = "notes.txt"  # the file the tool calls read, relative to the agent's working directory
# The calls, in the model's own format (the server's Gemma-4 parser turns them into tool calls):
# Claude Code's Read (file_path), Codex's exec_command (cmd).
READ_CALL = '<|tool_call>call:Read{file_path:<|"|>' + NOTES_FILE + '<|"|>}<tool_call|><|tool_response>'
SHELL_CALL = '<|tool_call>call:exec_command{cmd:<|"|>cat ' + NOTES_FILE + '<|"|>}<tool_call|><|tool_response>'

MAX_POSITIONS = 65536
HIDDEN = 128
KNOWN = 60  # identity dimensions: the most tokens the model can know (the chains use ~45)
HEAD_DIM = 64  # both layers' heads (the previous-token head's value carries a token identity)
_PREV_THETA = 3.0  # layer 0's RoPE base: frequencies 1 .. 1/3, distance 1 wins by >= 20% of the peak score
_PREV_SCORE = 1.8  # q_norm and k_norm scale on layer 0: peak score 64 * 1.8^2 = 207, every other distance >= 41 less
# The lm_head's weights (in logits) for the current token, the previous one, the flag: the smallest margin, _F, is
# 20 logits, so that sampling at temperature 1 (what agents send, or nothing) picks the chain's token as greedy does.
_A, _C, _F = 80.0, 40.0, 20.0


@dataclass(frozen=True)
class _Dims:
    bias: int = 0
    known: int = 1  # .. known + KNOWN: identity of the current token
    prev: int = 1 + KNOWN  # .. prev + KNOWN: identity of the previous token
    prev_none: int = 1 + 2 * KNOWN  # the previous token is one the model does not know
    flag: int = 2 + 2 * KNOWN  # flag + 0: nothing matched (BOS), + 1: a tool result, + 2 + i: trigger i


D = _Dims()
_BOS_FLAG, _RESULT_FLAG = 0, 1


def agent_config() -> Any:
    from transformers.models.gemma4 import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=262144, hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=1, num_key_value_heads=1, head_dim=HEAD_DIM, global_head_dim=HEAD_DIM,
        num_global_key_value_heads=1, attention_k_eq_v=False, enable_moe_block=False, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"], sliding_window=MAX_POSITIONS,
        max_position_embeddings=MAX_POSITIONS, final_logit_softcapping=None, tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": _PREV_THETA},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class _Chain:
    """Tokens the model emits after `starts` (a generation prompt's last token), given `flag` (None: any)."""
    starts: tuple[int, ...]
    tokens: tuple[int, ...]
    flag: int | None


def _chains(tokenizer: Any) -> list[_Chain]:
    vocab = tokenizer.get_vocab()
    channel_close, result_close = vocab["<channel|>"], vocab["<tool_response|>"]
    newline = _ids(tokenizer, "\n")[0]  # the last token of a generation prompt with thinking on ("<|turn>model\n")
    prompt_ends = (channel_close, newline)
    turn_end = vocab["<turn|>"]
    return [
        _Chain(prompt_ends, (*_ids(tokenizer, PLAIN_TEXT), turn_end), _BOS_FLAG),
        _Chain((*prompt_ends, result_close), (*_ids(tokenizer, TOOL_TEXT), turn_end), _RESULT_FLAG),
        _Chain(prompt_ends, tuple(_ids(tokenizer, READ_CALL)), 2),
        _Chain(prompt_ends, tuple(_ids(tokenizer, SHELL_CALL)), 3),
    ]


def trigger_ids(tokenizer: Any) -> list[int]:
    ids = [_ids(tokenizer, READ_TRIGGER), _ids(tokenizer, SHELL_TRIGGER)]
    assert all(len(one) == 1 for one in ids), ids
    return [one[0] for one in ids]


def build_agent_model(tokenizer: Any) -> Any:
    """The model, its weights set as the module docstring says (float32, eval mode)."""
    import torch
    from transformers.models.gemma4 import Gemma4ForCausalLM

    model = Gemma4ForCausalLM(agent_config()).eval()
    vocab = tokenizer.get_vocab()
    chains = _chains(tokenizer)
    triggers = trigger_ids(tokenizer)
    results = [vocab["<|tool_response>"], vocab["<tool_response|>"]]
    bos = int(tokenizer.bos_token_id)
    known: dict[int, int] = {}  # token id -> its identity index
    for token in [bos, *triggers, *results, *(t for c in chains for t in (*c.starts, *c.tokens))]:
        known.setdefault(token, len(known))
    assert len(known) <= KNOWN, f"{len(known)} known tokens, room for {KNOWN}"

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in _norms(model):
            norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(1.0)
        emb = model.model.embed_tokens.weight
        emb[:, D.bias] = 1.0
        for token, index in known.items():
            emb[token, D.known + index] = 1.0
        _previous_token_head(model.model.layers[0].self_attn, known)
        _decision_head(model, model.model.layers[1].self_attn, known, bos, triggers, results)
        _readout(model, tokenizer, chains, known)
    return model


def _norms(model: Any) -> list[Any]:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    return [m for m in model.modules() if isinstance(m, Gemma4RMSNorm) and m.with_scale]


def _previous_token_head(attn: Any, known: dict[int, int]) -> None:
    """Query and key from the bias alone, phased so that q.k = sum_i cos((d - 1) * theta_i): largest at distance
    d = 1 (rotate_half pairs dims i and i + HEAD_DIM/2, rotated by position * theta_i)."""
    half = HEAD_DIM // 2
    thetas = [_PREV_THETA ** (-i / half) for i in range(half)]
    for i, theta in enumerate(thetas):
        # q = e^{-i theta}, k = 1 (as complex pairs): q(m).k(n) = cos((m - n) theta - theta)
        attn.q_proj.weight[i, D.bias] = math.cos(theta)
        attn.q_proj.weight[i + half, D.bias] = -math.sin(theta)
        attn.k_proj.weight[i, D.bias] = 1.0
    attn.q_norm.weight.fill_(_PREV_SCORE)
    attn.k_norm.weight.fill_(_PREV_SCORE)
    # Value: [bias, identity]; out: the bias to PREV_NONE (never a zero vector for the norm to blow up), identity to PREV.
    attn.v_proj.weight[0, D.bias] = 1.0
    attn.o_proj.weight[D.prev_none, 0] = 1.0
    for index in known.values():
        attn.v_proj.weight[1 + index, D.known + index] = 1.0
        attn.o_proj.weight[D.prev + index, 1 + index] = 1.0


def _decision_head(model: Any, attn: Any, known: dict[int, int], bos: int, triggers: Sequence[int],
                   results: Sequence[int]) -> None:
    """In two dimensions RoPE leaves alone: q = (1, 0) from the bias; key (s, sqrt(1 - s^2)) for BOS (s = 1/3),
    a trigger (2/3), a tool-response marker (1), none for every other token: scores 30 / 60 / 90 / 0."""
    inv_freq = model.model.rotary_emb.full_attention_inv_freq
    still = [i for i in range(HEAD_DIM // 2) if float(inv_freq[i]) == 0.0]
    assert len(still) >= 2, "the global layer's RoPE rotates every dimension"
    a, z = still[0], still[1]
    attn.q_proj.weight[a, D.bias] = 1.0
    scale = math.sqrt(90.0 / HEAD_DIM)  # q_norm, k_norm: |q| = |k| = sqrt(HEAD_DIM) * scale at one dimension
    attn.q_norm.weight.fill_(1.0)
    attn.q_norm.weight[a] = scale
    attn.k_norm.weight.fill_(1.0)
    attn.k_norm.weight[a] = scale
    keyed = [(bos, 1 / 3, _BOS_FLAG), *[(t, 2 / 3, 2 + i) for i, t in enumerate(triggers)],
             *[(t, 1.0, _RESULT_FLAG) for t in results]]
    for token, s, flag in keyed:
        column = D.known + known[token]
        attn.k_proj.weight[a, column] = s
        attn.k_proj.weight[z, column] = math.sqrt(1 - s * s)
        attn.v_proj.weight[flag, column] = 1.0
        attn.o_proj.weight[D.flag + flag, flag] = 1.0


def _readout(model: Any, tokenizer: Any, chains: Sequence[_Chain], known: dict[int, int]) -> None:
    """lm_head rows from the chains. The sizes of the current-token, previous-token and flag parts after the final
    norm are measured on a probe (they are fixed by the layers above), so that _A, _C, _F are logit units."""
    import torch

    probe = torch.tensor([[int(tokenizer.bos_token_id), *(t for c in chains for t in c.tokens)][:16]])
    hidden = model.model(input_ids=probe).last_hidden_state[0, -1]
    flags = hidden[D.flag:D.flag + 4]
    cur_size = float(hidden[D.known:D.known + KNOWN].abs().max())
    prev_size = float(hidden[D.prev:D.prev + KNOWN].abs().max())
    flag_size = float(flags.abs().max())
    assert min(cur_size, prev_size, flag_size) > 0.05, (cur_size, prev_size, flag_size)

    head = model.lm_head.weight
    pairs: dict[tuple[int, int], tuple[int, int | None]] = {}
    for chain in chains:
        for start in chain.starts:
            sequence = (start, *chain.tokens)
            # the first token: decided by the prompt's last token and the flag alone (its predecessor varies)
            first = chain.tokens[0]
            head[first, D.known + known[start]] = _A / cur_size
            if chain.flag is not None:
                head[first, D.flag + chain.flag] = _F / flag_size
            for i in range(1, len(sequence) - 1):
                prev, cur, nxt = sequence[i - 1], sequence[i], sequence[i + 1]
                seen = pairs.setdefault((prev, cur), (nxt, chain.flag))
                assert seen[0] == nxt or seen[1] != chain.flag, f"tokens {prev}, {cur} lead to {seen[0]} and {nxt}"
                head[nxt, D.known + known[cur]] = _A / cur_size
                head[nxt, D.prev + known[prev]] = _C / prev_size
                if chain.flag is not None and chain.flag >= 2:  # a call's tokens: the trigger tells calls apart
                    head[nxt, D.flag + chain.flag] = _F / flag_size


def save_agent_checkpoint(dest: Path, cfg_dir: Path) -> Path:
    """The model saved as a checkpoint under `dest` with the Gemma-4 tokenizer files of `cfg_dir` (built once)."""
    from transformers import AutoTokenizer

    from tests.support.models import save_checkpoint

    if (dest / "config.json").is_file():
        return dest
    tokenizer = AutoTokenizer.from_pretrained(cfg_dir)
    model = build_agent_model(tokenizer)

    def add_files(staging: Path) -> None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(cfg_dir / name, staging / name)

    return save_checkpoint(model, dest, add_files)


MAX_TOTAL = 40960  # the context: Claude Code's prompts are 9-30k Gemma tokens
PREFILL_BUCKET = 2048  # prefill chunk: ~2 s each on 2 cores, so a 20k prompt prefills in well under a minute


def agent_artifacts(root: Path, *, max_total: int = MAX_TOTAL, prefill_bucket: int = PREFILL_BUCKET) -> Path:
    """The model exported under `root` as an artifact dir for `--graph hf`, with the tests' Gemma-4 tokenizer and
    template (what tests/support/gemma4_app.py does for the random tiny Gemma-4)."""
    from server.tools.export import export
    from tests.support.gemma4_tokenizer import gemma4_cfg_dir

    source = gemma4_cfg_dir()
    checkpoint = save_agent_checkpoint(root / "checkpoint", source)
    dest = root / "artifacts"
    if not (dest / "graph.json").is_file():
        export(checkpoint, dest, prefill_bucket=prefill_bucket, max_total=max_total, dtype="float32")
        cfg = dest / "cfg"
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copyfile(source / name, cfg / name)
        (cfg / "special_tokens_map.json").unlink(missing_ok=True)
    return dest
