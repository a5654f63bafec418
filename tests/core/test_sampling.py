"""The sampler: its distribution, masks, penalties and shapes (its seeds: test_sampling_seeds.py)."""

import numpy as np
import pytest

from paged_jax.core.sampling import apply_penalties, argmax, draw_logits, sample
from paged_jax.core.sampling_params import MAX_LOGPROBS, SamplingParams
from sampler_rows import EOS, VOCAB_SIZE, build, log_softmax

# --- greedy and the distribution ------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 100)).astype(np.float32)
    params = [SamplingParams(temperature=t) for t in (0.0, 1e-6, 2.0)] * 2
    tokens = np.asarray(sample(logits, build(params)).tokens)
    greedy_rows = [0, 1, 3, 4]
    np.testing.assert_array_equal(tokens[greedy_rows], logits[greedy_rows].argmax(-1))


@pytest.mark.parametrize("vocab", [1, 100, 512, 49152, 50257])
def test_argmax_takes_the_first_maximum_as_numpy_does(vocab):
    rng = np.random.default_rng(vocab)
    # Few distinct values, so that most rows have their maximum in several places, in several blocks.
    logits = rng.integers(-3, 4, size=(5, vocab)).astype(np.float32)
    logits[4] = -np.inf  # a row with every token banned still names one
    np.testing.assert_array_equal(argmax(logits), logits.argmax(-1))
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    np.testing.assert_array_equal(argmax(logits), logits.argmax(-1))


def test_a_greedy_batch_is_a_program_without_random_draws():
    logits = np.random.default_rng(8).normal(size=(4, 100)).astype(np.float32)
    greedy = build([SamplingParams(temperature=0)] * 3, pad_rows_to=4)
    mixed = build([SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)], pad_rows_to=4)
    assert not greedy.do_random and mixed.do_random
    np.testing.assert_array_equal(sample(logits, greedy).tokens[:3], logits[:3].argmax(-1))
    assert sample(logits, mixed).tokens[0] == logits[0].argmax()


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)])
def test_masks_that_leave_one_token_equal_greedy(kwargs):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(64, 50)).astype(np.float32)
    params = [SamplingParams(temperature=1.5, **kwargs)] * 64
    np.testing.assert_array_equal(sample(logits, build(params)).tokens, logits.argmax(-1))


def expected_distribution(logits, temperature, top_k, top_p, min_p):
    """logits: float64 [V] -> float64 [V]; plain numpy, one rule at a time in the documented order."""
    probs = np.exp(log_softmax(logits / temperature))
    order = np.argsort(-probs)
    allowed = order[: top_k if top_k > 0 else len(order)]
    head = probs[allowed] / probs[allowed].sum()
    mass, kept = 0.0, []
    for token, p in zip(allowed, head):
        kept.append(token)
        mass += p
        if mass >= top_p:
            break
    kept = [t for t in kept if probs[t] >= min_p * probs.max()]
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


# A permuted, distinct-valued vocabulary, so sorting and un-sorting mistakes show.
SMALL_VOCAB_LOGITS = np.log([0.04, 0.2, 0.1, 0.3, 0.02, 0.12, 0.07, 0.15]).astype(np.float32)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (0.7, -1, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, -1, 0.6, 0.0),
        (1.0, -1, 1.0, 0.3),
        (0.5, 5, 0.8, 0.1),
        (1.5, 6, 0.9, 0.2),
        # top_p then min_p keeps two tokens; min_p first would renormalise and let top_p keep one.
        (1.0, -1, 0.45, 0.45),
    ],
)
def test_sampled_frequencies_match_the_renormalised_distribution(temperature, top_k, top_p, min_p):
    num = 16384  # one draw per row, each row its own seed
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * num
    tokens = np.asarray(sample(np.tile(SMALL_VOCAB_LOGITS, (num, 1)), build(params)).tokens)
    freq = np.bincount(tokens, minlength=len(SMALL_VOCAB_LOGITS)) / num
    expected = expected_distribution(SMALL_VOCAB_LOGITS.astype(np.float64), temperature, top_k, top_p, min_p)
    assert np.all(freq[expected == 0] == 0), (freq, expected)
    # Five standard errors per token: a wrong rule (or a silent greedy) is off by far more.
    tolerance = 5 * np.sqrt(expected * (1 - expected) / num)
    assert np.all(np.abs(freq - expected) <= tolerance), (freq, expected)
    assert (expected > 0).sum() > 1, "the case must leave a choice, or it tests nothing"


def test_masked_tokens_are_never_sampled_in_a_mixed_batch():
    rng = np.random.default_rng(2)
    vocab, num = 256, 512
    logits = rng.normal(scale=3.0, size=(num, vocab)).astype(np.float32)
    settings = [(1.0, 5, 1.0, 0.0), (2.0, -1, 0.5, 0.0), (1.0, -1, 1.0, 0.2), (3.0, 20, 0.9, 0.05)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in settings]
    params = params * (num // len(params))
    tokens = np.asarray(sample(logits, build(params)).tokens)
    for row, (token, p) in enumerate(zip(tokens, params)):
        allowed = expected_distribution(np.float64(logits[row]), p.temperature, p.top_k, p.top_p, p.min_p)
        assert allowed[token] > 0, (row, p)


def kept_by_sorting(row, top_k, top_p):
    """float32 [V] -> bool [V]: what top_k then top_p keep, by the rule as a sort states it: the values
    from the k-th largest up (ties too), then down a descending running sum of their renormalised
    probabilities, every token whose value's larger values hold less than top_p."""
    desc = np.sort(row)[::-1]
    kth = desc[min(top_k, len(row)) - 1] if top_k > 0 else desc[-1]
    top = row[row >= kth].astype(np.float64)
    probs = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
    cut = kth
    if top_p < 1:
        cut = min(v for v in np.unique(top) if probs[top > v].sum() < top_p)
    return (row >= cut) & np.isfinite(row)


@pytest.mark.parametrize("vocab", [7, 300, 49152])
def test_top_k_top_p_keep_exactly_what_a_sorted_running_sum_keeps(vocab):
    rng = np.random.default_rng(vocab)
    rows = 24
    # Half the rows of few distinct values (ties at every cut-off), half continuous.
    logits = np.concatenate([rng.integers(-8, 8, size=(rows // 2, vocab)) / 2,
                             rng.normal(scale=3.0, size=(rows // 2, vocab))]).astype(np.float32)
    logits[0, : vocab // 2] = -np.inf  # banned tokens are never kept
    top_ks = rng.choice([0, 1, 5, 50, vocab, vocab + 3], size=rows)
    top_ps = np.where(rng.random(rows) < 0.25, 1.0, rng.uniform(0.01, 0.99, size=rows)).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_k=int(k) or -1, top_p=float(p)) for k, p in zip(top_ks, top_ps)]
    kept = np.isfinite(np.asarray(draw_logits(logits, build(params))))
    for r in range(rows):
        np.testing.assert_array_equal(kept[r], kept_by_sorting(logits[r], top_ks[r], top_ps[r]),
                                      err_msg=f"row {r}: top_k {top_ks[r]}, top_p {top_ps[r]}")


# --- penalties and min_tokens ---------------------------------------------------------------------


def test_penalties_follow_vllm_formulas():
    rng = np.random.default_rng(3)
    vocab = 40
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    logits[:, 5] = 0.0  # zero is neither divided nor multiplied into anything else
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=2.0),
        SamplingParams(),
    ]
    prompts = [[3, 5, 5, 11], [3, 30], [12], [1, 2]]
    outputs = [[5, 7, 7, 7, 2], [8, 8], [12, 13, 13], [2, 2]]
    got = np.asarray(apply_penalties(logits, build(params, prompts=prompts, outputs=outputs)))

    want = logits.copy()
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for token in set(prompt) | set(output):
            x = want[row, token]
            want[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in output:
            want[row, token] -= p.frequency_penalty
        for token in set(output):
            want[row, token] -= p.presence_penalty
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[:3], logits[:3]), "the cases must move some logits"


def test_penalties_change_the_greedy_choice():
    logits = np.array([[0.0, 3.0, 2.9, 1.0]], np.float32)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.1)]
    assert sample(logits, build(params, outputs=[[]])).tokens[0] == 1
    assert sample(logits, build(params, outputs=[[1, 1]])).tokens[0] == 2


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    vocab = 16
    # Token preference: EOS, then stop ids 4, 5, 6, 8, 9 (more than the narrowest bucket), then 7.
    logits = np.full((1, vocab), -5.0, np.float32)
    logits[0, [EOS, 4, 5, 6, 8, 9, 7]] = [9, 8, 7.9, 7.8, 7.7, 7.6, 7]
    stop_ids = [4, 5, 6, 8, 9]

    def greedy_token(generated, **kwargs):
        p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stop_ids, **kwargs)
        return int(sample(logits, build([p], outputs=[[7] * generated])).tokens[0])

    assert greedy_token(0) == 7 and greedy_token(2) == 7
    assert greedy_token(3) == EOS
    # ignore_eos keeps EOS out of the stop set, so min_tokens has no reason to ban it.
    assert greedy_token(1, ignore_eos=True) == EOS

    num = 512
    sampled = [SamplingParams(temperature=5.0, min_tokens=2, stop_token_ids=stop_ids)] * num
    tokens = np.asarray(sample(np.tile(logits, (num, 1)), build(sampled, outputs=[[7]] * num)).tokens)
    assert not np.isin(tokens, [EOS, *stop_ids]).any()
    assert len(set(tokens.tolist())) > 3


# --- logprobs and compilation -----------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(4, 64)).astype(np.float32)
    params = [
        SamplingParams(logprobs=5, temperature=0.5),
        SamplingParams(logprobs=0, temperature=0.0, repetition_penalty=1.5),
        SamplingParams(logprobs=None, top_k=10),
        SamplingParams(logprobs=MAX_LOGPROBS, frequency_penalty=1.0),
    ]
    out = sample(logits, build(params, prompts=[[1, 2]] * 4, outputs=[[3, 3]] * 4))
    raw = log_softmax(logits.astype(np.float64))
    chosen = np.take_along_axis(raw, np.asarray(out.tokens)[:, None], -1)[:, 0]
    np.testing.assert_allclose(out.logprobs, chosen, atol=1e-5)
    assert out.top_logprobs.shape == out.top_ids.shape == (4, MAX_LOGPROBS)
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-raw, axis=-1)[:, :MAX_LOGPROBS], atol=1e-5)
    top_ids_logprobs = np.take_along_axis(raw, np.asarray(out.top_ids), -1)
    np.testing.assert_allclose(out.top_logprobs, top_ids_logprobs, atol=1e-5)


def test_top_logprobs_are_one_shape_capped_at_the_vocabulary():
    logits = np.log(np.arange(1, 9, dtype=np.float32))[None].repeat(2, 0)
    # Asked for or not, one shape (one program); filled only when some row asks.
    unasked = sample(logits, build([SamplingParams(logprobs=0), SamplingParams()]))
    asked = sample(logits, build([SamplingParams(logprobs=2), SamplingParams()]))
    assert unasked.top_ids.shape == asked.top_ids.shape == (2, 8)
    np.testing.assert_array_equal(asked.top_ids[0], np.arange(8)[::-1])


def test_more_stop_ids_than_a_word_of_the_ban_mask_are_all_banned():
    vocab = 100
    logits = np.linspace(0, 1, vocab, dtype=np.float32)[None]
    stop_ids = list(range(40, vocab))  # the 60 most likely tokens, over two words of the mask and a part
    p = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=stop_ids + [VOCAB_SIZE + 5])
    assert sample(logits, build([p])).tokens[0] == 39
    assert sample(logits, build([p], outputs=[[1]])).tokens[0] == vocab - 1


def test_a_ban_mask_narrower_than_the_logits_is_refused():
    with pytest.raises(ValueError, match="covers 1024 tokens, the logits 2000"):
        sample(np.zeros((1, 2000), np.float32), build([SamplingParams()]))


def test_logprobs_only_when_asked():
    logits = np.zeros((2, 8), np.float32)
    none = sample(logits, build([SamplingParams(), SamplingParams()]))
    assert not np.asarray(none.logprobs).any()  # the log-softmax's branch did not run
    for asked in (0, 2):  # logprobs=0 still asks for the chosen token's
        out = sample(logits, build([SamplingParams(logprobs=asked), SamplingParams()]))
        np.testing.assert_allclose(out.logprobs, [np.log(1 / 8)] * 2, rtol=1e-6)


def test_batches_of_one_bucket_share_one_compilation():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(16, 100)).astype(np.float32)

    def run(temperatures, history_lengths, pad_rows_to=8):
        params = [SamplingParams(temperature=t, top_p=0.9, presence_penalty=0.5) for t in temperatures]
        outputs = [[1] * n for n in history_lengths]
        seeds = rng.integers(0, 2**31, len(params)).tolist()
        t = build(params, seeds=seeds, outputs=outputs, pad_rows_to=pad_rows_to)
        sample(logits[:pad_rows_to], t)
        return sample._cache_size()

    before = run([0.5, 1.0, 0.8], [0, 5, 9])
    # Other rows, values, seeds and history lengths within the same buckets: no new program.
    assert run([1.2, 0.7, 0.9, 1.1, 0.4, 2.0], [30, 1, 2, 3, 4, 5]) == before
    assert run([0.9], [17]) == before
    # A larger row bucket does compile, so the counter is really counting.
    assert run([0.9], [17], pad_rows_to=16) == before + 1
