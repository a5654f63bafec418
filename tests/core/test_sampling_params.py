"""SamplingParams: vLLM's parameters, each bad value refused by name, normalised and frozen."""

import dataclasses

import pytest

from paged_jax.core.sampling_params import MAX_LOGPROBS, SamplingParams


BAD_PARAMS = [
    dict(temperature=-0.5),
    dict(top_p=0.0),
    dict(top_p=1.5),
    dict(top_k=-2),
    dict(min_p=-0.1),
    dict(min_p=1.1),
    dict(n=0),
    dict(max_tokens=0),
    dict(min_tokens=-1),
    dict(min_tokens=17),  # above the default max_tokens of 16
    dict(repetition_penalty=0.0),
    dict(repetition_penalty=float("nan")),
    dict(temperature=float("inf")),
    dict(temperature=1e300),
    dict(length_penalty=float("nan"), use_beam_search=True, n=2, temperature=0.0),
    dict(presence_penalty=2.5),
    dict(presence_penalty=-2.5),
    dict(frequency_penalty=-2.1),
    dict(logprobs=-1),
    dict(logprobs=MAX_LOGPROBS + 1),
    dict(stop=("end", "")),
    dict(stop_token_ids=(5, -1)),
    dict(length_penalty=0.5),
    dict(n=2, temperature=0.0),
    dict(n=1, use_beam_search=True, temperature=0.0),
    dict(temperature=1.0, use_beam_search=True, n=4),
    dict(top_p=0.9, use_beam_search=True, n=4, temperature=0.0),
    dict(top_k=5, use_beam_search=True, n=4, temperature=0.0),
    dict(min_p=0.1, use_beam_search=True, n=4, temperature=0.0),
]


@pytest.mark.parametrize("kwargs", BAD_PARAMS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_parameter_is_named_with_its_value(kwargs):
    # The first key of each case is the parameter at fault; the others set up the context.
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{name} ") and message.endswith(f"got {value!r}"), message


def test_params_are_normalised_and_frozen():
    p = SamplingParams(stop="###", stop_token_ids=[7, 9], top_k=0)
    assert (p.stop, p.stop_token_ids, p.top_k) == (("###",), (7, 9), -1)
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5


def test_greedy_below_eps_and_valid_beam_search():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    beam = SamplingParams(use_beam_search=True, n=4, temperature=0.0, length_penalty=0.8)
    assert beam.greedy and beam.length_penalty == 0.8


