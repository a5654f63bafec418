"""The rejection sampler emits tokens distributed as the target's processed distribution, whatever
the draft, in every sampling mode; greedy rows accept exactly the argmax."""

import numpy as np
import pytest
import scipy.stats

from paged_jax.core import sampling, sampling_tensors
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.spec_decode.rejection import num_accepted, rejection_sample

V = 8
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 1.2], np.float32)
N = 40_000  # rows, each its own seed


def tensors(params, n, history=()):
    return sampling_tensors.make_sampling_tensors([params] * n, list(range(n)), [list(history)] * n, [[]] * n, [],
                                          pad_rows_to=n, vocab_size=V, history_width=16)


def softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def expected(mode):
    """The target distribution, written out in numpy from vLLM's definitions of each parameter."""
    l = LOGITS.astype(np.float64)
    if mode == "temperature":
        return softmax(l / 0.7)
    if mode == "top_k":
        keep = np.argsort(-l)[:3]
        return softmax(np.where(np.isin(np.arange(V), keep), l, -np.inf))
    if mode == "top_p":
        p = softmax(l)
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = order[before < 0.6]
        return softmax(np.where(np.isin(np.arange(V), keep), l, -np.inf))
    if mode == "min_p":
        p = softmax(l)
        return softmax(np.where(p >= 0.3 * p.max(), l, -np.inf))
    if mode == "repetition":
        seen = np.isin(np.arange(V), [0, 7])
        return softmax(np.where(seen, np.where(l > 0, l / 1.8, l * 1.8), l))


PARAMS = {
    "temperature": (SamplingParams(temperature=0.7), ()),
    "top_k": (SamplingParams(temperature=1.0, top_k=3), ()),
    "top_p": (SamplingParams(temperature=1.0, top_p=0.6), ()),
    "min_p": (SamplingParams(temperature=1.0, min_p=0.3), ()),
    "repetition": (SamplingParams(temperature=1.0, repetition_penalty=1.8), (0, 7)),
}


@pytest.mark.parametrize("mode", list(PARAMS))
@pytest.mark.parametrize("draft", [0, 2, 6, -1])  # the likeliest, a middling one, one often masked, none
def test_emitted_tokens_follow_the_target_distribution(mode, draft):
    params, history = PARAMS[mode]
    target = expected(mode)
    out, accepted = rejection_sample(np.tile(LOGITS, (N, 1)), tensors(params, N, history),
                                     np.full(N, draft, np.int32))
    tokens, accepted = np.asarray(out.tokens), np.asarray(accepted)
    counts = np.bincount(tokens, minlength=V)
    assert counts[target == 0].sum() == 0
    live = target > 0
    assert scipy.stats.chisquare(counts[live], N * target[live]).pvalue > 1e-3
    assert 0.5 * np.abs(counts / N - target).sum() < 0.015
    if draft >= 0:  # accepted exactly with the draft's probability, and then it is the draft emitted
        assert (tokens[accepted] == draft).all()
        assert abs(accepted.mean() - target[draft]) < 4 * np.sqrt(max(target[draft], 1e-3) / N) + 1e-9
    else:
        assert not accepted.any()


def test_a_row_without_a_draft_draws_what_sample_draws():
    t = tensors(SamplingParams(temperature=0.9, top_k=5), 64)
    logits = np.random.default_rng(0).normal(size=(64, V)).astype(np.float32)
    out, _ = rejection_sample(logits, t, np.full(64, -1, np.int32))
    assert (np.asarray(out.tokens) == np.asarray(sampling.sample(logits, t).tokens)).all()


def test_greedy_rows_accept_the_argmax_and_emit_it_with_its_logprob():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, V)).astype(np.float32)
    best = logits.argmax(-1)
    drafts = np.array([best[0], (best[1] + 1) % V, best[2], best[3], -1, best[5]], np.int32)
    t = tensors(SamplingParams(temperature=0, logprobs=1), 6)
    out, accepted = rejection_sample(logits, t, drafts)
    assert np.asarray(out.tokens).tolist() == best.tolist()
    assert np.asarray(accepted).tolist() == [True, False, True, True, False, True]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out.logprobs), logp[np.arange(6), best], rtol=1e-5)
    # Rows 0..2 verify one sequence's 2 drafts (and its bonus row): the first is accepted, the second not.
    assert num_accepted(np.asarray(accepted), 0, 2) == 1
    assert num_accepted(np.asarray(accepted), 2, 2) == 2


def test_a_greedy_row_beside_drawing_rows_stays_greedy():
    params = [SamplingParams(temperature=0)] + [SamplingParams(temperature=1.0)] * 3
    t = sampling_tensors.make_sampling_tensors(params, [1, 2, 3, 4], [[]] * 4, [[]] * 4, [], pad_rows_to=4, vocab_size=V,
                                       history_width=0)
    logits = np.tile(LOGITS, (4, 1))
    out, accepted = rejection_sample(logits, t, np.array([3, 3, 3, 3], np.int32))
    assert int(out.tokens[0]) == 0 and not bool(accepted[0])
