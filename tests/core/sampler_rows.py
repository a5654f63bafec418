"""Rows for the sampler's tests: one step's SamplingTensors from a few params."""

import numpy as np

from paged_jax.core.sampling_tensors import all_allowed, make_sampling_tensors

EOS = 0
# A ban mask wide enough for every test's vocabulary (the sampler reads the logits' width of it), and
# room for every test's history.
VOCAB_SIZE = 1024
HISTORY_WIDTH = 64


def build(params, *, seeds=None, prompts=None, outputs=None, pad_rows_to=None):
    """Tensors for rows with empty histories and seeds 0, 1, ... unless given."""
    n = len(params)
    return make_sampling_tensors(
        params,
        list(range(n)) if seeds is None else seeds,
        [[]] * n if prompts is None else prompts,
        [[]] * n if outputs is None else outputs,
        [EOS],
        allowed=all_allowed(n if pad_rows_to is None else pad_rows_to, VOCAB_SIZE),
        pad_rows_to=n if pad_rows_to is None else pad_rows_to,
        vocab_size=VOCAB_SIZE,
        history_width=HISTORY_WIDTH,
    )


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
