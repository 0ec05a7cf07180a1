"""server/sampling/: exact masks on small vocabularies, distributions, seeds, penalties, soft-cap, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from server.sampling import sampler as sampler_module
from server.sampling.params import SamplingParams
from server.sampling.primitives import argmax, candidates, prompt_logprobs, topk, topk_rows
from server.sampling.sampler import Sampler, sample_rows
from tests.support.sampling_reference import candidate_distribution, chi_square_ok, reference_probs

V = 262_144  # Gemma's vocabulary: the fast paths only engage at realistic sizes
CAP = 30.0  # Gemma-4's final-logit soft-cap
DEFAULT = SamplingParams(temperature=1.0, top_k=64, top_p=0.95)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    # Two intra-op threads stall for milliseconds per op whenever the other core is busy (e.g. a parallel test
    # run); one thread keeps these thousands of 262k-row calls fast and steady. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gemma_like_logits(seed: int, vocab: int = V, scale: float = 8.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale  # (V,) wide enough for the soft-cap to bend them


def as_dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab, dtype=torch.float32).index_put_((ids,), probs)  # (V,)


def draw(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.tensor([sampler.sample(logits).token_id for _ in range(n)])  # (n,)


# --- primitives -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("vocab", "k", "block"),
    [(V, 64, None), (V, 20, None), (V, 512, None), (V, 4096, None), (V, 64, 128), (4096, 8, 16), (50, 5, None)],
)
def test_topk_values_equal_torch_topk(seed: int, vocab: int, k: int, block: int | None) -> None:
    x = gemma_like_logits(seed, vocab)
    values, ids = topk(x, k, block=block)
    ref = torch.topk(x, k)
    assert torch.equal(values, ref.values)
    assert torch.equal(x[ids], values)
    assert len(set(ids.tolist())) == k


def test_topk_adversarial_layouts() -> None:
    # All of the best values crowded into one block, ties across blocks, and -inf (banned) entries.
    x = torch.full((4096,), -math.inf)
    x[100:116] = torch.arange(16.0)  # one 16-wide block holds the top 16
    x[2000:2100] = 3.0  # many ties at the boundary
    for k in (4, 16, 20, 40):
        values, ids = topk(x, k, block=16)
        assert torch.equal(values, torch.topk(x, k).values)
        assert torch.equal(x[ids], values) and len(set(ids.tolist())) == k


@pytest.mark.parametrize("seed", range(5))
def test_argmax_is_first_maximum(seed: int) -> None:
    x = gemma_like_logits(seed)
    assert argmax(x) == int(x.argmax())
    x[[7, 70_000, 200_000]] = 1e4  # ties: the first index wins, as with torch.argmax
    assert argmax(x) == 7 == int(x.argmax())
    small = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert argmax(small) == 1


# --- exact supports on tiny vocabularies ------------------------------------------------------------------


def dist(logits: list[float], **kw: float) -> dict[int, float]:
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    ids, probs = candidate_distribution(torch.tensor(logits), params, None)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    return dict(zip(ids.tolist(), probs.tolist(), strict=True))


def test_top_k_support_and_probabilities() -> None:
    got = dist([0.0, 3.0, -1.0, 2.0, 1.0], top_k=3)
    want = torch.softmax(torch.tensor([3.0, 2.0, 1.0]), 0).tolist()
    assert list(got) == [1, 3, 4]
    assert got[1] == pytest.approx(want[0]) and got[3] == pytest.approx(want[1]) and got[4] == pytest.approx(want[2])


def test_top_p_keeps_the_token_that_crosses() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert dist(logits, top_p=0.7) == pytest.approx({0: 0.5 / 0.8, 1: 0.3 / 0.8})  # 0.5 < 0.7, then 0.8 >= 0.7
    assert dist(logits, top_p=0.4) == pytest.approx({0: 1.0})
    assert dist(logits, top_p=0.9) == pytest.approx({0: 0.5 / 0.95, 1: 0.3 / 0.95, 2: 0.15 / 0.95})


def test_min_p_is_relative_to_the_best_token() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert dist(logits, min_p=0.35) == pytest.approx({0: 0.5 / 0.8, 1: 0.3 / 0.8})  # threshold 0.175
    assert dist(logits, min_p=0.05) == pytest.approx({0: 0.5, 1: 0.3, 2: 0.15, 3: 0.05})


def test_temperature_then_top_k_then_min_p_then_top_p() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(temperature=0.5, top_k=4, min_p=0.01, top_p=0.99)
    scaled = torch.softmax(logits[:4] / 0.5, 0)  # top-k 4, temperature 0.5: [0.865, 0.117, 0.016, 0.002]
    kept = scaled[:3] / scaled[:3].sum()  # min-p 0.01 drops the 4th (0.002 < 0.0087); top-p 0.99 keeps 3
    ids, probs = candidate_distribution(logits, params, None)
    assert ids.tolist() == [0, 1, 2]
    torch.testing.assert_close(probs, kept)


# --- the fast route equals the naive full-sort reference --------------------------------------------------

GRID = [
    DEFAULT,
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_k=64, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.9),  # top-k off: probing path, top-p against the full mass
    SamplingParams(temperature=0.5, min_p=0.1),  # top-k off: probing path, min-p
    SamplingParams(temperature=2.0, top_p=0.5, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=-1, top_p=0.999),
    SamplingParams(temperature=0.8),  # nothing truncates: the whole vocabulary
    SamplingParams(temperature=0.9, top_k=1000, top_p=0.9),  # a top-k beyond the Python-floats route
]


@pytest.mark.parametrize("softcap", [None, CAP])
@pytest.mark.parametrize("params", GRID)
@pytest.mark.parametrize(("vocab", "scale"), [(V, 8.0), (V, 1.0), (1000, 3.0), (7, 2.0)])
def test_distribution_matches_full_sort_reference(
    params: SamplingParams, softcap: float | None, vocab: int, scale: float
) -> None:
    logits = gemma_like_logits(vocab + int(scale), vocab, scale)
    ids, probs = candidate_distribution(logits, params, softcap)
    got = as_dense(ids, probs, vocab)
    want = reference_probs(logits, params, softcap)
    differ = (got > 0) != (want > 0)
    if vocab <= 1000:
        assert not differ.any(), "supports differ"
    else:
        # Over 262k tokens a float32 cumulative sum puts the top-p edge a few ulps apart in the two routes
        # (seen at top_p 0.999): only tokens of negligible probability may switch sides.
        assert float(torch.maximum(got, want)[differ].sum()) < 1e-4
    assert float((got - want).abs().sum()) < 1e-4
    torch.testing.assert_close(got[~differ], want[~differ], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("softcap", [None, CAP])
@pytest.mark.parametrize("params", [DEFAULT, SamplingParams(temperature=1.3, top_k=200, top_p=0.8, min_p=0.05),
                                    SamplingParams(temperature=0.5, top_k=3), SamplingParams(top_k=256, min_p=0.2)])
def test_small_top_k_on_python_floats_equals_the_tensor_route(params: SamplingParams, softcap: float | None) -> None:
    logits = gemma_like_logits(21, V, 4.0)
    small = candidates(logits, params, softcap)  # k <= 256: the Python-floats route
    ids, cum, n = small.ids, small.cum, small.n
    assert isinstance(ids, list)
    c = candidates(logits, params, softcap, floats=False)
    assert c.ids is not None and ids[:n] == c.ids[: c.n].tolist()
    got = torch.tensor(cum[:n], dtype=torch.float64) / cum[n - 1]
    torch.testing.assert_close(got, (c.cum[: c.n] / c.cum[c.n - 1]).double(), atol=1e-6, rtol=1e-5)


def test_flat_distribution_forces_several_probes() -> None:
    # A near-flat row: the top-p nucleus spans thousands of tokens, beyond the first probes of 64 and 512.
    logits = gemma_like_logits(3, V, 0.05)
    params = SamplingParams(top_p=0.02)
    ids, probs = candidate_distribution(logits, params, CAP)
    assert ids.numel() > 512
    torch.testing.assert_close(as_dense(ids, probs, V), reference_probs(logits, params, CAP), atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(temperature=1.5, top_k=8, min_p=0.1, seed=3),
        SamplingParams(temperature=1.0, seed=4),
    ],
)
def test_sampled_frequencies_match_reference(params: SamplingParams) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    sampler = Sampler(params, logits.numel(), [], CAP)
    counts = torch.bincount(draw(sampler, logits, 8000), minlength=logits.numel())
    assert chi_square_ok(counts, reference_probs(logits, params, CAP))


def test_large_vocab_draws_stay_in_support() -> None:
    logits = gemma_like_logits(11)
    sampler = Sampler(replace(DEFAULT, seed=0), V, [], CAP)
    support = reference_probs(logits, DEFAULT, CAP) > 0
    tokens = draw(sampler, logits, 200)
    assert bool(support[tokens].all())
    assert len(set(tokens.tolist())) > 1


# --- a step's rows sampled together (sample_rows) --------------------------------------------------------


def tie_heavy_rows(rows: int, vocab: int = V) -> torch.Tensor:
    """Rows rounded through bf16 (as a bf16 graph's logits are): many exactly equal values, in and around a top-k."""
    g = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, vocab, generator=g) * 3.0).bfloat16().float()  # [R, V]


@pytest.mark.parametrize(("vocab", "k"), [(V, 64), (V, 20), (V, 200), (V, 256), (V, 1), (4096, 8), (1000, 64)])
def test_topk_rows_equals_topk_of_each_row_ties_included(vocab: int, k: int) -> None:
    x = tie_heavy_rows(5, vocab)
    values, ids = topk_rows(x, k)
    alone = [topk_rows(row[None], k) for row in x]  # each row alone, as Sampler.sample takes it
    assert values == [v[0] for v, _ in alone] and ids == [i[0] for _, i in alone]  # ids too: ties break the same way
    for row, row_values, row_ids in zip(x, values, ids, strict=True):
        assert row_values == torch.topk(row, k).values.tolist()  # exact: the values of torch's own top-k
        assert row[row_ids].tolist() == row_values and len(set(row_ids)) == k  # each id holds its value



def test_topk_rows_on_masked_nan_and_flat_rows_equals_torch_topk() -> None:
    # A constrained row (-inf but for a few tokens, fewer than k), a row holding NaN (the threshold route cannot
    # order it: torch.topk's own answer, NaN first) and a flat row (the column route for each), beside a plain row:
    # each as torch.topk of that row, and each list the row's own alone.
    x = tie_heavy_rows(4)
    x[0, 10:] = float("-inf")  # 10 allowed tokens, k = 64
    x[1, 12345] = float("nan")
    x[3] = 0.5  # near-flat: every value ties, too many to sort
    values, ids = topk_rows(x, 64)
    alone = [topk_rows(row[None], 64) for row in x]
    assert ids == [i[0] for _, i in alone]  # the plain row's list is its own, whatever route the others took
    for row, row_values, row_ids in zip(x, values, ids, strict=True):
        want = torch.topk(row, 64).values
        assert torch.equal(torch.tensor(row_values).isnan(), want.isnan())
        assert torch.tensor(row_values).nan_to_num(7.0).tolist() == want.nan_to_num(7.0).tolist()
        assert len(set(row_ids)) == 64
    assert values[0][:10] == torch.topk(x[0, :10], 10).values.tolist() and set(ids[0][:10]) == set(range(10))


MIXED = [
    replace(DEFAULT, seed=1),
    replace(DEFAULT, seed=2, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0.7, top_k=64, min_p=0.05, seed=3, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=1.2, top_k=20, seed=4, logit_bias=((7, 4.0), (9, -100.0))),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=5, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=0.0),  # plain greedy: the argmax pass
    SamplingParams(temperature=1.0, top_p=0.9, seed=6),  # top-k off: row by row
    replace(DEFAULT, seed=7),  # min_tokens' ban below: masked in its own row, then sampled with the others
]


def test_rows_sampled_together_equal_each_row_sampled_alone_step_after_step() -> None:
    logits = tie_heavy_rows(len(MIXED))

    def samplers() -> list[Sampler]:
        made = [Sampler(p, V, [1, 2, 3], CAP) for p in MIXED[:-1]]
        top = int(logits[-1].argmax())
        return [*made, Sampler(MIXED[-1], V, [1], CAP, stop_ids=[top], min_tokens=3)]

    together, alone = samplers(), samplers()
    for _ in range(30):
        got = sample_rows(together, logits)
        want = [s.sample(logits[b]) for b, s in enumerate(alone)]
        assert got == want  # tokens, logprobs and top_logprobs, with each row's own generator
        for s, t, result in zip(together, alone, got, strict=True):
            s.accept(result.token_id)
            t.accept(result.token_id)
    assert len({r.token_id for r in got[:5]}) > 1


def test_rows_sampled_together_in_part_of_a_batch_equal_alone() -> None:
    # The small-top-k rows are not a contiguous range of the batch: they are gathered (a copy), not viewed.
    logits = tie_heavy_rows(4)
    params = [replace(DEFAULT, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2), replace(DEFAULT, seed=3),
              replace(DEFAULT, top_k=32, seed=4)]
    got = sample_rows([Sampler(p, V, [], CAP) for p in params], logits)
    assert got == [Sampler(p, V, [], CAP).sample(logits[b]) for b, p in enumerate(params)]


@pytest.mark.parametrize("softcap", [None, CAP])
def test_rows_sampled_together_each_match_their_reference(softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Four rows of one step, each its own logits and parameters, drawn together 4000 times: each row's tokens
    # against that row's full-sort reference distribution.
    params = [SamplingParams(temperature=1.0, top_k=8, seed=1), SamplingParams(temperature=0.7, top_k=8, min_p=0.1, seed=2),
              SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=3),
              SamplingParams(temperature=1.5, top_k=64, top_p=0.8, seed=4)]
    logits = torch.stack([gemma_like_logits(40 + b, V, 2.0) for b in range(len(params))])  # [R, V]
    samplers = [Sampler(p, V, [], softcap) for p in params]
    calls = []

    def counted(x: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        calls.append((x.shape[0], k))
        return topk_rows(x, k)

    monkeypatch.setattr(sampler_module, "topk_rows", counted)
    drawn = torch.tensor([[r.token_id for r in sample_rows(samplers, logits)] for _ in range(4000)])  # [N, R]
    assert set(calls) == {(2, 8), (2, 64)}  # the rows of each k were taken together
    for b, p in enumerate(params):
        counts = torch.bincount(drawn[:, b], minlength=V)
        assert chi_square_ok(counts, reference_probs(logits[b], p, softcap)), b


def peaked_rows(rows: int, seed: int, peaks: int = 24) -> torch.Tensor:
    """[R, V] rows shaped like a language model's: a Gaussian bulk and `peaks` tokens well above it, so a top-p
    nucleus is tens of tokens (one probe) or, with many peaks, more than the first probe holds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 2.0  # [R, V]
    top = torch.randint(0, V, (rows, peaks), generator=g)  # [R, peaks]
    return x.scatter_(1, top, torch.rand(rows, peaks, generator=g) * 4.0 + 12.0)  # [R, V]


def tied_at_the_nucleus_edge() -> torch.Tensor:
    """[V]: one token at 4, six at 2 spread over the vocabulary, the rest far below: top-p 0.75 crosses inside the
    tie (54.6, then 7.39 each: 0.75 of 98.9 is reached by the third of the six)."""
    x = torch.full((V,), -30.0)
    x[1234] = 4.0
    x[torch.tensor([5, 70_000, 70_001, 131_072, 200_000, V - 1])] = 2.0
    return x


def test_top_p_rows_sampled_together_equal_alone_ties_and_mixed_params() -> None:
    tied = tied_at_the_nucleus_edge()
    logits = torch.cat([peaked_rows(3, 50), tied[None], peaked_rows(2, 51, peaks=300)])  # [6, V]
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(top_p=0.5, seed=2, logprobs=True, top_logprobs=4),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3), SamplingParams(top_p=0.75, seed=4),
              SamplingParams(top_p=0.95, seed=5), replace(DEFAULT, seed=6)]

    def samplers() -> list[Sampler]:
        made = [Sampler(p, V, [1, 2, 3], CAP) for p in params[:-2]]
        top = int(logits[4].argmax())  # min_tokens' ban: this row is masked (soft-capped) in its own row first
        return [*made, Sampler(params[4], V, [], CAP, stop_ids=[top], min_tokens=2), Sampler(params[5], V, [], CAP)]

    together, alone = samplers(), samplers()
    for _ in range(20):
        got = sample_rows(together, logits)
        assert got == [s.sample(logits[b]) for b, s in enumerate(alone)]  # tokens, logprobs, each its own generator
        for s, t, result in zip(together, alone, got, strict=True):
            s.accept(result.token_id)
            t.accept(result.token_id)
    # At the tie: as many tokens kept as the sorted reference keeps, with the same values (which three of the six
    # equal ones is the sort's order, as in the reference).
    ids, probs = candidate_distribution(tied, params[3], CAP)
    want = reference_probs(tied, params[3], CAP)
    assert ids.numel() == int((want > 0).sum()) == 4
    assert sorted(tied[ids].tolist()) == sorted(tied[want > 0].tolist()) == [2.0, 2.0, 2.0, 4.0]
    torch.testing.assert_close(probs.sort().values, want[want > 0].sort().values)


def test_top_p_rows_sampled_together_each_match_their_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three top-p rows of one step (different top_p, one needing more than the first probe) drawn together 2000
    # times, each against its own full-sort reference distribution.
    logits = torch.cat([peaked_rows(2, 60), peaked_rows(1, 61, peaks=200)])  # [3, V]
    params = [SamplingParams(top_p=0.9, seed=1), SamplingParams(top_p=0.6, seed=2), SamplingParams(top_p=0.8, seed=3)]
    samplers = [Sampler(p, V, [], CAP) for p in params]
    calls = []
    nucleus_rows = sampler_module.nucleus_rows

    def counted(x: torch.Tensor, *args: Any) -> Any:
        calls.append(x.shape[0])
        return nucleus_rows(x, *args)

    monkeypatch.setattr(sampler_module, "nucleus_rows", counted)
    drawn = torch.tensor([[r.token_id for r in sample_rows(samplers, logits)] for _ in range(2000)])  # [N, R]
    assert set(calls) == {3}  # the three rows were taken together
    for b, p in enumerate(params):
        want = reference_probs(logits[b], p, CAP)
        assert chi_square_ok(torch.bincount(drawn[:, b], minlength=V), want), b
    assert int((reference_probs(logits[2], params[2], CAP) > 0).sum()) > 64  # beyond the first probe


# --- seeds, greedy ----------------------------------------------------------------------------------------


def run(params: SamplingParams, logits: torch.Tensor, n: int = 40, softcap: float | None = CAP) -> list[int]:
    sampler = Sampler(params, logits.numel(), [1, 2, 3], softcap)
    out = []
    for _ in range(n):
        token = sampler.sample(logits).token_id
        sampler.accept(token)
        out.append(token)
    return out


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    logits = gemma_like_logits(0, scale=1.0)
    params = SamplingParams(top_k=64, top_p=0.95, seed=1234)
    assert run(params, logits) == run(params, logits)
    other = SamplingParams(top_k=64, top_p=0.95, seed=1235)
    assert run(params, logits) != run(other, logits)
    unseeded = SamplingParams(top_k=64, top_p=0.95)
    assert run(unseeded, logits) != run(unseeded, logits)  # fresh generator per request


def test_greedy_is_argmax_of_raw_logits() -> None:
    for seed in range(5):
        logits = gemma_like_logits(seed)
        sampler = Sampler(SamplingParams(temperature=0.0), V, [], CAP)
        assert sampler.sample(logits).token_id == int(logits.argmax())
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.1).greedy


def test_caller_logits_are_not_modified() -> None:
    logits = gemma_like_logits(5)
    before = logits.clone()
    params = SamplingParams(
        top_k=64, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias=((9, 5.0),), logprobs=True, top_logprobs=5,
    )
    sampler = Sampler(params, V, [1, 2, 3], CAP)
    for _ in range(3):
        sampler.accept(sampler.sample(logits).token_id)
    assert torch.equal(logits, before)


# --- penalties and bias -----------------------------------------------------------------------------------


def test_penalties_change_exactly_the_seen_tokens() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    prompt = [0, 1, 1]
    sampler = Sampler(params, 8, prompt, None)
    for token in (2, 3, 3, 0):
        sampler.accept(token)
    got = sampler.adjust(logits)
    want = logits.clone()
    for token in {0, 1, 2, 3}:  # prompt + output, once per distinct token
        want[token] = want[token] / 2.0 if want[token] > 0 else want[token] * 2.0
    for token, count in {2: 1, 3: 2, 0: 1}.items():  # output only, OpenAI: presence + frequency * count
        want[token] -= 0.25 + 0.5 * count
    torch.testing.assert_close(got, want)
    assert torch.equal(got[4:], logits[4:]), "unseen tokens must be untouched"


def test_penalty_history_grows_past_its_initial_capacity() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    sampler = Sampler(params, 1000, [], None)
    for token in list(range(300)) + [5, 5]:
        sampler.accept(token)
    got = sampler.adjust(torch.zeros(1000))
    assert float(got[5]) == -3.0 and float(got[299]) == -1.0 and float(got[300]) == 0.0


def test_no_penalties_means_no_copy() -> None:
    logits = torch.zeros(10)
    assert Sampler(SamplingParams(), 10, [1, 2], None).adjust(logits) is logits


def test_logit_bias_forces_and_bans() -> None:
    logits = gemma_like_logits(2)
    forced = SamplingParams(top_k=64, top_p=0.95, logit_bias=((12345, 100.0),), seed=0)
    assert set(run(forced, logits, 10)) == {12345}
    assert Sampler(SamplingParams(temperature=0.0, logit_bias=((777, 100.0),)), V, [], CAP).sample(logits).token_id == 777
    best = int(logits.argmax())
    banned = SamplingParams(temperature=0.0, logit_bias=((best, -100.0),))
    assert Sampler(banned, V, [], CAP).sample(logits).token_id == int(torch.topk(logits, 2).indices[1])


# --- soft-cap ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [DEFAULT, SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(temperature=1.0, top_k=64, min_p=0.05)],
)
def test_softcap_on_candidates_equals_softcap_on_everything(params: SamplingParams) -> None:
    raw = gemma_like_logits(9, scale=10.0)
    capped = CAP * torch.tanh(raw / CAP)  # (V,) what the naive server would sample from
    for seed in range(30):
        seeded = replace(params, seed=seed)
        assert Sampler(seeded, V, [], CAP).sample(raw) == Sampler(seeded, V, [], None).sample(capped)


def test_softcap_changes_the_distribution() -> None:
    raw = torch.tensor([60.0, 50.0, 40.0])  # far beyond the cap: the soft-cap squeezes the gaps
    params = SamplingParams(top_k=3)
    capped = dict(zip(*(t.tolist() for t in candidate_distribution(raw, params, CAP)), strict=True))
    assert capped[1] > 0.05 and dict(zip(*(t.tolist() for t in candidate_distribution(raw, params, None)),
                                         strict=True))[1] < 1e-4


# --- logprobs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("softcap", [None, CAP, 100.0])  # 100: the shifted normaliser branch
def test_logprobs_are_raw_log_softmax_of_capped_adjusted_logits(temperature: float, softcap: float | None) -> None:
    logits = gemma_like_logits(4, scale=10.0)
    params = SamplingParams(
        temperature=temperature, top_k=64, top_p=0.9, repetition_penalty=1.2, logit_bias=((3, 2.0),),
        logprobs=True, top_logprobs=20, seed=0,
    )
    sampler = Sampler(params, V, [5, 6, 7], softcap)
    result = sampler.sample(logits)
    adjusted = sampler.adjust(logits).clone()  # (V,) bias and penalties, as sample() saw them
    capped = adjusted if softcap is None else softcap * torch.tanh(adjusted / softcap)
    want = torch.log_softmax(capped.double(), 0)  # (V,)
    assert result.logprob == pytest.approx(float(want[result.token_id]), abs=2e-5)
    assert len(result.top_logprobs) == 20
    ids = [t for t, _ in result.top_logprobs]
    values = [lp for _, lp in result.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert ids == torch.topk(want, 20).indices.tolist()
    torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), want[ids], atol=2e-5, rtol=0)
    if temperature == 0.0:
        assert result.token_id == ids[0]


def test_no_logprobs_unless_asked() -> None:
    result = Sampler(DEFAULT, V, [], CAP).sample(gemma_like_logits(0))
    assert result.logprob is None and result.top_logprobs == ()
    chosen_only = Sampler(SamplingParams(logprobs=True), 10, [], CAP).sample(torch.zeros(10))
    assert chosen_only.logprob == pytest.approx(-math.log(10)) and chosen_only.top_logprobs == ()


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("rows", [1, 32, 70])  # one block of rows, exactly one, several with a short last one
def test_prompt_logprobs_are_log_softmax_of_the_capped_rows(rows: int, softcap: float | None) -> None:
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 1000, generator=generator) * 20  # [T, V]: large enough for the cap to matter
    targets = torch.randint(0, 1000, (rows,), generator=generator).tolist()
    before = logits.clone()
    got = prompt_logprobs(logits, targets, 3, softcap)
    assert torch.equal(logits, before), "the caller's logits are not modified"
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    want = torch.log_softmax(capped.double(), dim=-1)  # [T, V]
    assert len(got) == rows
    for row, (target, (logprob, best)) in enumerate(zip(targets, got, strict=True)):
        assert logprob == pytest.approx(float(want[row, target]), abs=1e-4)
        values, ids = torch.topk(want[row], 3)
        assert [t for t, _ in best] == ids.tolist()
        assert [v for _, v in best] == pytest.approx(values.tolist(), abs=1e-4)
    # A target that is its row's best has exactly the best value (what "is greedy" compares).
    argmaxes = logits.argmax(1).tolist()
    for logprob, best in prompt_logprobs(logits, argmaxes, 1, softcap):
        assert logprob == best[0][1]
    assert all(best == [] for _, best in prompt_logprobs(logits, targets, 0, softcap))
