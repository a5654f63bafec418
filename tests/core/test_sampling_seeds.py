"""The sampler's seeds: each row draws from its own seed and step, whatever else the batch holds."""

import jax
import numpy as np
import pytest

from paged_jax.core.sampling import sample
from paged_jax.core.sampling_tensors import make_sampling_tensors
from paged_jax.core.sampling_params import SamplingParams
from sampler_rows import EOS, HISTORY_WIDTH, VOCAB_SIZE, build


def test_a_row_draws_with_fold_in_of_its_seed_and_step():
    logits = np.random.default_rng(4).normal(size=(1, 1000)).astype(np.float32)
    for seed, step in [(7, 0), (7, 3), (123456, 9)]:
        t = build([SamplingParams()], seeds=[seed], outputs=[[1] * step])
        u = float(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), step)))
        # The token where the running sum of the row's probabilities passes u of their total.
        cdf = np.cumsum(np.exp(np.float64(logits[0]) - logits[0].max()))
        assert sample(logits, t).tokens[0] == np.searchsorted(cdf, u * cdf[-1], side="right")


def test_seeded_rows_ignore_the_rest_of_the_batch():
    rng = np.random.default_rng(5)
    vocab = 1000
    seeded = [SamplingParams(seed=s, top_p=0.95 if s % 2 else 1.0) for s in range(11, 19)]
    seeded_logits = rng.normal(size=(8, vocab)).astype(np.float32)
    seeded_outputs = [[3] * i for i in range(8)]
    alone = np.asarray(
        sample(seeded_logits, build(seeded, seeds=[p.seed for p in seeded], outputs=seeded_outputs)).tokens
    )
    assert (alone != seeded_logits.argmax(-1)).any(), "the rows must be sampled, not greedy"

    # The same rows shuffled among others that switch on every optional path, in a larger bucket.
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, repetition_penalty=1.2),
        SamplingParams(min_p=0.1, frequency_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.3, presence_penalty=0.5),
    ]
    rows = [("seeded", i) for i in range(8)] + [("other", i) for i in range(4)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    params = [seeded[i] if kind == "seeded" else others[i] for kind, i in rows]
    logits = np.zeros((16, vocab), np.float32)  # padding rows' logits stay zero
    for position, (kind, i) in enumerate(rows):
        logits[position] = seeded_logits[i] if kind == "seeded" else rng.normal(size=vocab)
    outputs = [seeded_outputs[i] if kind == "seeded" else [1, 2, 3] for kind, i in rows]
    seeds = [seeded[i].seed if kind == "seeded" else 1000 + i for kind, i in rows]
    t = build(params, seeds=seeds, prompts=[[4, 5]] * len(rows), outputs=outputs, pad_rows_to=16)
    assert t.do_penalties and t.do_top_k_top_p and t.any_logprobs
    mixed = np.asarray(sample(logits, t).tokens)
    for position, (kind, i) in enumerate(rows):
        if kind == "seeded":
            assert mixed[position] == alone[i], (position, i)


def test_steps_of_one_seed_draw_different_tokens():
    uniform = np.zeros((64, 1000), np.float32)
    params = [SamplingParams(seed=42)] * 64
    tokens = sample(uniform, build(params, seeds=[42] * 64, outputs=[[1] * i for i in range(64)])).tokens
    assert len(set(np.asarray(tokens).tolist())) > 50


def test_seeds_keep_all_64_bits():
    t = build([SamplingParams()] * 3, seeds=[2**40 + 5, -1, 9], pad_rows_to=4)
    # PRNGKey's threefry words (high, low) of a 64-bit seed; the padding row gets zeros.
    np.testing.assert_array_equal(t.key_data, [[256, 5], [2**32 - 1, 2**32 - 1], [0, 9], [0, 0]])


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="3 params, 2 seeds"):
        make_sampling_tensors([SamplingParams()] * 3, [1, 2], [[]] * 3, [[]] * 3, [EOS], pad_rows_to=4,
                              vocab_size=VOCAB_SIZE, history_width=HISTORY_WIDTH)
    with pytest.raises(ValueError, match=r"pad_rows_to \(2\)"):
        build([SamplingParams()] * 3, pad_rows_to=2)
    with pytest.raises(ValueError, match="logits have 3 rows, the sampling tensors 4"):
        sample(np.zeros((3, 10), np.float32), build([SamplingParams()] * 3, pad_rows_to=4))
