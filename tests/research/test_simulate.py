"""The pure-JAX allocation simulation: vmap over 1,000 workloads equals a loop over them, the pool is
all free once every request finished, and reservations waste at least what on-demand blocks do."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.research import simulate

NUM_WORKLOADS, REQUESTS = 1000, 6
OPTIONS = dict(num_blocks=13, block_size=4, max_blocks_per_seq=12, num_steps=40, max_running=4)


def random_workloads(key, reserve: bool = False) -> simulate.Workload:
    """NUM_WORKLOADS workloads of REQUESTS requests; arrays [NUM_WORKLOADS, REQUESTS]."""
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (NUM_WORKLOADS, REQUESTS)
    prompts = jax.random.randint(k1, shape, 1, 24)
    outputs = jax.random.randint(k2, shape, 1, 12)
    return simulate.Workload(prompt_lens=prompts, output_lens=outputs,
                             arrival_steps=jax.random.randint(k3, shape, 0, 6),
                             reserve_tokens=prompts + outputs if reserve else jnp.zeros(shape, jnp.int32))


def test_vmap_over_a_thousand_workloads_equals_a_loop():
    workloads = random_workloads(jax.random.key(0))
    run = functools.partial(simulate.simulate, **OPTIONS)
    batched = jax.vmap(run)(workloads)
    assert batched.blocks_in_use.shape == (NUM_WORKLOADS, OPTIONS["num_steps"])
    for i in range(NUM_WORKLOADS):
        one = run(jax.tree.map(lambda x: x[i], workloads))
        for name in ("blocks_in_use", "tokens_held", "num_running", "num_preempted", "finish_step"):
            np.testing.assert_array_equal(getattr(batched, name)[i], getattr(one, name),
                                          err_msg=f"{name}, workload {i}")
    # The small pool makes some workloads preempt, and the loop agreed on those too.
    assert int(simulate.oom_events(batched).sum()) > 0


def test_every_block_returns_and_usage_is_consistent():
    result = jax.vmap(functools.partial(simulate.simulate, **OPTIONS))(random_workloads(jax.random.key(1)))
    finished = np.asarray((result.finish_step >= 0).all(axis=-1))
    assert finished.mean() > 0.9
    # Blocks never leak: a workload whose requests all finished leaves the pool all free.
    np.testing.assert_array_equal(np.asarray(result.pool.num_free)[finished], OPTIONS["num_blocks"] - 1)
    assert not np.asarray(result.pool.refcounts)[finished].any()
    slots = np.asarray(result.blocks_in_use) * OPTIONS["block_size"]
    held = np.asarray(result.tokens_held)
    assert (held <= slots).all() and (np.asarray(result.blocks_in_use) <= OPTIONS["num_blocks"] - 1).all()
    # On demand, a request wastes less than a block: the slots exceed the tokens by under one block each.
    assert (slots - held < OPTIONS["block_size"] * np.maximum(np.asarray(result.num_running), 1)).all()
    waste = np.asarray(simulate.waste(result, OPTIONS["block_size"]))
    assert ((waste >= 0) & (waste <= 1)).all()


def test_reserving_the_whole_request_never_wastes_less_and_never_preempts():
    key = jax.random.key(2)
    run = jax.vmap(functools.partial(simulate.simulate, **OPTIONS))
    paged, reserved = run(random_workloads(key)), run(random_workloads(key, reserve=True))
    assert (np.asarray(simulate.oom_events(reserved)) == 0).all()
    both = np.asarray((paged.finish_step >= 0).all(-1) & (reserved.finish_step >= 0).all(-1))
    on_demand = np.asarray(simulate.waste(paged, 4))[both]
    up_front = np.asarray(simulate.waste(reserved, 4))[both]
    assert (up_front >= on_demand - 1e-6).all() and up_front.mean() > on_demand.mean()
