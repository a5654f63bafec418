"""Forks (n samples, beams) on a pool too small for them: preempted in both modes, they give the tokens
they give on a roomy pool, and the pool comes back all free."""

import pytest

from engine_cases import (FORK_OPTIONS, GREEDY, assert_all_free, finish_all, generate_forks, make_engine,  # noqa: F401
                          prompts, tiny)
from paged_jax import LLM, SamplingParams

# Head-major pages on the full pool, against token-major ones on the roomy pool: copy-on-write block
# copies and swaps in that layout too.
@pytest.mark.parametrize("mode, kv_layout", [("recompute", "token_major"), ("swap", "token_major"),
                                             ("swap", "head_major")])
def test_forks_preempted_on_a_full_pool_give_the_same_tokens(tiny, prompts, mode, kv_layout):
    roomy, _ = generate_forks(make_engine(tiny, **FORK_OPTIONS | dict(num_blocks=256)), prompts)
    engine = make_engine(tiny, **FORK_OPTIONS, preemption_mode=mode, kv_layout=kv_layout)
    tokens, preemptions = generate_forks(engine, prompts)
    assert tokens == roomy
    assert all(len(c) == 40 for samples in tokens[:3] for c in samples)
    assert all(preemptions), preemptions  # every request lost blocks to the others at least once
    assert_all_free(engine)


def test_n_samples_of_a_prompt_with_nothing_left_to_share_start(tiny, prompts):
    """A one-token prompt has no shared part to compute before forking, and neither has a prompt
    whose shared part is all in the prefix cache; both once waited forever at the queue's head."""
    engine = make_engine(tiny, block_size=8, num_blocks=64)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    cached = prompts[1][:17]  # 16 shared tokens: two full blocks
    ids = [engine.add_request(p, params) for p in (prompts[0][:1], cached)]
    done = finish_all(engine)
    ids.append(engine.add_request(cached, params))
    done |= finish_all(engine)
    assert [len(done[i].outputs) for i in ids] == [2, 2, 2]
    assert done[ids[2]].outputs[0].token_ids == done[ids[1]].outputs[0].token_ids  # seeded
    assert_all_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_beam_search_wider_than_the_pool_gives_the_same_beams(tiny, prompts, mode):
    """Four beams of 40 tokens need 14 blocks beyond their shared prompt; the pool has 7, so beams
    that await their siblings make way for them."""
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=20, ignore_eos=True)
    roomy = LLM.from_engine(make_engine(tiny, block_size=8, num_blocks=64)).generate(
        [prompts[4][:20]], params, use_tqdm=False)[0]
    engine = make_engine(tiny, block_size=8, num_blocks=8, preemption_mode=mode)
    request_id = engine.add_request(prompts[4][:20], params)
    small = finish_all(engine)[request_id]
    assert [c.token_ids for c in small.outputs] == [c.token_ids for c in roomy.outputs]
    assert engine.stats().num_preemptions > 0
    assert_all_free(engine)


def test_the_context_length_fits_the_pool(tiny):
    engine = make_engine(tiny, block_size=8, num_blocks=13)
    assert engine.resolved.max_model_len == 96  # 12 blocks of 8, below the model's 256
    with pytest.raises(ValueError, match="max_model_len is 96"):
        engine.add_request(list(range(2, 102)), GREEDY)
    with pytest.raises(ValueError, match=r"exceeds what the KV cache holds \(12 blocks of 8\): 96 tokens"):
        make_engine(tiny, block_size=8, num_blocks=13, max_model_len=100)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens, as chunked prefill is off: 64"):
        make_engine(tiny, max_model_len=100, max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert make_engine(tiny, max_num_batched_tokens=64, enable_chunked_prefill=False).resolved.max_model_len == 64


# Where a step fails: (object, method) -> what the fault does in its place.
