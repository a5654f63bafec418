"""A pure-JAX simulation of KV allocation under continuous batching, over the real block pool and page
tables: jittable, and vmappable over workloads.

Each step, in order:
1. arrived requests are admitted in arrival order (the first waiting is never overtaken) while
   fewer than max_running run and the pool can give each the blocks of max(prompt, reserve) tokens;
2. every running request computes one token (decode); a request whose reservation is used up takes
   a block at each block boundary. When the pool cannot give them all, the newest admitted request is
   preempted (its blocks freed, to be computed again from its first token) until it can: an
   out-of-memory event;
3. usage is counted, then requests that have generated all their tokens are released.

The reservation is the allocation policy: 0 takes blocks on demand (PagedAttention), prompt +
max_tokens reserves a request's whole length at admission (TGI), the context length reserves the
longest possible request (static allocation, before PagedAttention). With block_size 1 a reservation
is contiguous memory counted token by token.

    result = jax.vmap(functools.partial(simulate, num_blocks=..., block_size=16, ...))(workloads)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paged_jax.core import block_pool

from paged_jax.research import page_table

WAITING, RUNNING, FINISHED = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests, in arrival order; under vmap each array gains a leading batch axis."""

    prompt_lens: jax.Array  # int32 [requests]; tokens computed at admission
    output_lens: jax.Array  # int32 [requests]; tokens generated, one a step, >= 1
    arrival_steps: jax.Array  # int32 [requests]; first step (0-based) the request may be admitted
    reserve_tokens: jax.Array  # int32 [requests]; tokens allocated at admission at least (0: on demand)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SimResult:
    """Per step (counted after the step's tokens, before its finished requests are released)."""

    blocks_in_use: jax.Array  # int32 [steps]
    tokens_held: jax.Array  # int32 [steps]; tokens whose KV the blocks hold
    num_running: jax.Array  # int32 [steps]
    num_preempted: jax.Array  # int32 [steps]; out-of-memory events in the step
    finish_step: jax.Array  # int32 [requests]; the step each finished in, -1 if it never did
    pool: block_pool.BlockPool  # at the end: all free once every request finished


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _State:
    table: page_table.PageTable  # lengths: tokens allocated for (reservation or on demand)
    pool: block_pool.BlockPool
    status: jax.Array  # int32 [requests]; WAITING, RUNNING or FINISHED
    held: jax.Array  # int32 [requests]; tokens computed
    generated: jax.Array  # int32 [requests]
    admitted: jax.Array  # int32 [requests]; admission order, the newest highest
    num_admitted: jax.Array  # int32 []
    finish_step: jax.Array  # int32 [requests]


@functools.partial(jax.jit, static_argnames=("num_blocks", "block_size", "max_blocks_per_seq", "num_steps",
                                             "max_running"))
def simulate(workload: Workload, *, num_blocks: int, block_size: int, max_blocks_per_seq: int, num_steps: int,
             max_running: int) -> SimResult:
    """Run num_steps steps of continuous batching over a pool of num_blocks blocks (block 0 reserved).

    max_blocks_per_seq: a page-table row's length; it must hold the longest request and reservation.
    """
    num_requests = workload.prompt_lens.shape[-1]
    rows = jnp.arange(num_requests, dtype=jnp.int32)
    initial = _State(
        table=page_table.init_page_table(num_requests, max_blocks_per_seq, block_size),
        pool=block_pool.init_pool(num_blocks),
        status=jnp.zeros(num_requests, jnp.int32), held=jnp.zeros(num_requests, jnp.int32),
        generated=jnp.zeros(num_requests, jnp.int32), admitted=jnp.zeros(num_requests, jnp.int32),
        num_admitted=jnp.zeros((), jnp.int32), finish_step=jnp.full(num_requests, -1, jnp.int32))

    def admit(carry):
        """Admit the first waiting arrived request, if it fits; blocked when it does not."""
        state, _, step = carry
        i = jnp.argmax(waiting(state, step))
        tokens = jnp.maximum(workload.prompt_lens[i], workload.reserve_tokens[i])
        table, pool, ok = page_table.append_tokens(state.table, state.pool, i[None], tokens[None],
                                                   max_new_blocks=max_blocks_per_seq)
        state = dataclasses.replace(
            state, table=table, pool=pool,
            status=state.status.at[i].set(jnp.where(ok, RUNNING, WAITING)),
            held=state.held.at[i].set(jnp.where(ok, workload.prompt_lens[i], 0)),
            admitted=state.admitted.at[i].set(state.num_admitted),
            num_admitted=state.num_admitted + 1)
        return state, ~ok, step

    def admitting(carry):
        state, blocked, step = carry
        return ~blocked & jnp.any(waiting(state, step)) & (jnp.sum(state.status == RUNNING) < max_running)

    def waiting(state, step):
        return (state.status == WAITING) & (workload.arrival_steps <= step)

    def grow(state):
        """Each running request's next token: (state, ok), nothing changed unless ok."""
        running = state.status == RUNNING
        extra = jnp.maximum(state.held + 1 - state.table.lengths, 0)
        table, pool, ok = page_table.append_tokens(state.table, state.pool, jnp.where(running, rows, -1),
                                                   jnp.where(running, extra, 0), max_new_blocks=num_requests)
        return dataclasses.replace(state, table=table, pool=pool), ok

    def preempt_newest(carry):
        state, _, preempted = carry
        running = state.status == RUNNING
        victim = jnp.argmax(jnp.where(running, state.admitted, -1))
        table, pool, _ = page_table.release(state.table, state.pool, victim[None])
        state = dataclasses.replace(
            state, table=table, pool=pool, status=state.status.at[victim].set(WAITING),
            held=state.held.at[victim].set(0), generated=state.generated.at[victim].set(0))
        grown, ok = grow(state)
        return grown, ok, preempted + 1

    def step_fn(state, step):
        # One request per iteration, so a step costs what it admits, not the whole queue.
        state, _, _ = jax.lax.while_loop(admitting, admit, (state, jnp.array(False), step))
        grown, ok = grow(state)
        # A lone running request always fits (max_blocks_per_seq fits the pool), so this ends.
        state, _, preempted = jax.lax.while_loop(lambda c: ~c[1], preempt_newest, (grown, ok, jnp.int32(0)))
        running = state.status == RUNNING
        state = dataclasses.replace(state, held=state.held + running, generated=state.generated + running)
        record = (block_pool.num_in_use(state.pool), jnp.sum(jnp.where(running, state.held, 0)),
                  jnp.sum(running, dtype=jnp.int32), preempted)
        done = running & (state.generated >= workload.output_lens)
        table, pool, _ = page_table.release(state.table, state.pool, jnp.where(done, rows, -1))
        state = dataclasses.replace(state, table=table, pool=pool, status=jnp.where(done, FINISHED, state.status),
                                    finish_step=jnp.where(done, step, state.finish_step))
        return state, record

    final, (in_use, held, num_running, preempted) = jax.lax.scan(step_fn, initial, jnp.arange(num_steps))
    return SimResult(blocks_in_use=in_use, tokens_held=held, num_running=num_running, num_preempted=preempted,
                     finish_step=final.finish_step, pool=final.pool)


def waste(result: SimResult, block_size: int) -> jax.Array:
    """float32 [...]: share of the allocated token slots, summed over steps, that hold no token
    (internal fragmentation and unused reservation); leading batch axes are kept."""
    slots = jnp.sum(result.blocks_in_use, axis=-1) * block_size
    return 1.0 - jnp.sum(result.tokens_held, axis=-1) / jnp.maximum(slots, 1)


def peak_blocks(result: SimResult) -> jax.Array:
    """int32 [...]: the most blocks in use at any step."""
    return jnp.max(result.blocks_in_use, axis=-1)


def oom_events(result: SimResult) -> jax.Array:
    """int32 [...]: preemptions for want of a free block, over the run."""
    return jnp.sum(result.num_preempted, axis=-1)
