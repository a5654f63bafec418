"""The model against transformers: logits of ragged batches, and greedy generation through the paged
cache, for each architecture (tiny random checkpoints) and for the real SmolLM2 GGUF."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import CHAT_PROMPTS, TINY_ARCHS, hf_greedy
from kernels_pallas import AttentionMetadata, KVCache, init_kv_cache
from models import TP_AXIS, ModelConfig, load_model

GREEDY_STEPS = 32


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def nan_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.float32) -> KVCache:
    """A cache whose every slot is NaN until written: reading a slot nobody wrote poisons the logits."""
    cache = init_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype)
    return jax.tree.map(lambda pages: jnp.full_like(pages, jnp.nan), cache)


def block_tables_for(num_seqs: int, max_len: int, block_size: int) -> np.ndarray:
    """int32 [num_seqs, blocks_per_seq]: shuffled physical blocks, block 0 left unused, so the
    sequences' pages interleave in the cache."""
    blocks_per_seq = -(-max_len // block_size)
    return 1 + np.random.default_rng(0).permutation(num_seqs * blocks_per_seq).reshape(num_seqs, blocks_per_seq)


def make_step(chunks: list[tuple[list[int], int]], block_tables: np.ndarray, block_size: int, *,
              num_tokens: int, max_query_len: int):
    """The engine's job, by hand: one flat batch from chunks[i] = (new tokens of sequence i, how many of
    its tokens are cached already); a sequence with no new tokens is padding.

    block_tables: int32 [num_seqs, blocks_per_seq]. num_tokens and max_query_len are the step's shape
    bucket: the tokens are padded to num_tokens.
    Returns input_ids, positions (int32 [num_tokens]), metadata, and int32 [num_seqs], the row of
    each sequence's last new token.
    """
    q_lens = [len(tokens) for tokens, _ in chunks]
    assert sum(q_lens) <= num_tokens and max(q_lens) <= max_query_len
    ids, positions = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.zeros(len(chunks), np.int32)
    for i, (tokens, cached) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        pos = np.arange(cached, cached + len(tokens))
        ids[rows], positions[rows] = tokens, pos
        slots[rows] = block_tables[i, pos // block_size] * block_size + pos % block_size
        seq_lens[i] = cached + len(tokens) if tokens else 0
    metadata = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(block_tables, jnp.int32),
        seq_lens=jnp.asarray(seq_lens),
        query_start_loc=jnp.asarray(starts),
        max_query_len=max_query_len,
    )
    last_rows = np.maximum(starts[1:] - 1, 0).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(positions), metadata, jnp.asarray(last_rows)


def paged_greedy(forward, state, config, prompts, *, block_size: int, chunk_size: int) -> list[list[int]]:
    """GREEDY_STEPS greedy tokens per prompt, all sequences batched in each step; prompts enter in
    chunks of at most chunk_size tokens, so prefill chunks and decode tokens share steps.

    Two shape buckets, so two compilations: steps with a prompt chunk, and pure decode steps.
    """
    num_seqs = len(prompts)
    tables = block_tables_for(num_seqs, max(map(len, prompts)) + GREEDY_STEPS, block_size)
    cache = nan_cache(config, 1 + tables.size, block_size)
    tokens = [list(p) for p in prompts]
    cached = [0] * num_seqs
    generated = [[] for _ in prompts]
    while any(len(g) < GREEDY_STEPS for g in generated):
        chunks = [
            (t[c : c + chunk_size] if len(g) < GREEDY_STEPS else [], c)
            for t, c, g in zip(tokens, cached, generated)
        ]
        if max(len(new) for new, _ in chunks) > 1:
            shape = dict(num_tokens=_bucket(sum(min(len(p), chunk_size) for p in prompts)),
                         max_query_len=_bucket(min(max(map(len, prompts)), chunk_size)))
        else:
            shape = dict(num_tokens=num_seqs, max_query_len=1)
        ids, positions, metadata, last_rows = make_step(chunks, tables, block_size, **shape)
        logits, cache = forward(state, ids, positions, cache, metadata, last_rows)
        assert np.isfinite(np.asarray(logits)).all()
        best = np.asarray(jnp.argmax(logits, axis=-1))
        for i, (new, _) in enumerate(chunks):
            cached[i] += len(new)
            if new and cached[i] == len(tokens[i]):
                tokens[i].append(int(best[i]))
                generated[i].append(int(best[i]))
    return generated


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny_model(request, tiny_checkpoint):
    """(transformers model, our config, our model) for one architecture."""
    folder, hf_model = tiny_checkpoint(request.param)
    model, config, _ = load_model(folder)
    return hf_model, config, model


def make_forward(graphdef: nnx.GraphDef):
    """The model's own call as the engine's step makes it (step_programs.step merges the state into the
    graph and calls the model, under jit, the cache donated), without the sampler: the logits.

        logits, kv_cache = forward(state, input_ids, positions, kv_cache, metadata, logits_indices)
    """

    @functools.partial(jax.jit, donate_argnames=("kv_cache",))
    def forward(state: nnx.State, input_ids, positions, kv_cache: KVCache, metadata: AttentionMetadata, logits_indices):
        return nnx.merge(graphdef, state)(input_ids, positions, kv_cache, metadata, logits_indices)

    return forward


def _with_forward(hf_model, config, model):
    graphdef, state = nnx.split(model)
    return hf_model, config, state, make_forward(graphdef)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(transformers model, our config, split state, jitted forward) for one architecture."""
    return _with_forward(*tiny_model)


@pytest.fixture(scope="module", params=(False, True), ids=("xla_matmul", "packed"))
def tiny_any_matmul(request, tiny_model):
    """`tiny` with XLA's matmuls, or with its weights packed for the C++ CPU matmul (the model's pack_for_cpu)."""
    hf_model, config, model = tiny_model
    return _with_forward(hf_model, config, model.pack_for_cpu() if request.param else model)


def random_prompts(config: ModelConfig, lengths) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]


def ragged_logits(forward, state, config, prompts, *, block_size=6, cache_dtype=jnp.float32) -> list[np.ndarray]:
    """float32 [len(prompt), vocab] per prompt: every row's logits, all prompts in one flat batch."""
    tables = block_tables_for(len(prompts), max(map(len, prompts)), block_size)
    num_tokens = sum(map(len, prompts))
    ids, positions, metadata, _ = make_step(
        [(p, 0) for p in prompts], tables, block_size, num_tokens=num_tokens, max_query_len=max(map(len, prompts))
    )
    all_rows = jnp.arange(num_tokens, dtype=jnp.int32)
    cache = nan_cache(config, 1 + tables.size, block_size, cache_dtype)
    logits, _ = forward(state, ids, positions, cache, metadata, all_rows)
    assert logits.dtype == jnp.float32
    return np.split(np.asarray(logits), np.cumsum(list(map(len, prompts)))[:-1])


# 70 tokens pass llama3 rope's original 64 positions; the block size of 6 divides no length.
LOGIT_PROMPT_LENGTHS = (7, 13, 70)


def test_logits_match_transformers(tiny_any_matmul):
    hf_model, config, state, forward = tiny_any_matmul
    prompts = random_prompts(config, LOGIT_PROMPT_LENGTHS)
    for prompt, got in zip(prompts, ragged_logits(forward, state, config, prompts), strict=True):
        with torch.no_grad():
            want = hf_model(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_packed_head_multiplies_only_the_wanted_rows(tiny_model):
    """logits(x, num_rows): the leading rows as every row's logits have them, the padding rows zeros."""
    _, config, model = tiny_model
    x = jnp.asarray(np.random.default_rng(2).normal(size=(6, config.hidden_size)), jnp.float32)
    want = np.asarray(model.logits(x))
    got = np.asarray(model.pack_for_cpu().logits(x, jnp.int32(4)))
    assert np.abs(got[:4] - want[:4]).max() <= 1e-5 * np.abs(want).max()
    assert (got[4:] == 0).all()


@pytest.mark.parametrize("chunk_size", [64, 5], ids=["whole", "chunked"])
def test_greedy_through_paged_cache_matches_transformers(tiny_any_matmul, chunk_size):
    hf_model, config, state, forward = tiny_any_matmul
    prompts = random_prompts(config, (9, 23, 14))
    got = paged_greedy(forward, state, config, prompts, block_size=4, chunk_size=chunk_size)
    assert got == [hf_greedy(hf_model, p, GREEDY_STEPS) for p in prompts]


@pytest.mark.parametrize("chunk_size", [64, 5], ids=["whole", "chunked"])
def test_fused_greedy_head_matches_transformers(tiny_model, chunk_size):
    """The packed model's greedy_tokens (the lm_head and argmax in one C++ call, no logits written) in
    place of its logits' argmax: transformers' greedy tokens still. A soft-capped head never fuses."""
    hf_model, config, model = tiny_model
    packed = model.pack_for_cpu()
    assert packed.greedy_head == (config.final_logit_softcapping is None)
    if not packed.greedy_head:
        return
    graphdef, state = nnx.split(packed)

    @functools.partial(jax.jit, donate_argnames=("kv_cache",))
    def forward(state, input_ids, positions, kv_cache, metadata, logits_indices):  # one-hot rows of the tokens
        model = nnx.merge(graphdef, state)
        x, kv_cache = model.hidden_states(input_ids, positions, kv_cache, metadata)
        return jax.nn.one_hot(model.greedy_tokens(x[logits_indices]), config.vocab_size), kv_cache

    prompts = random_prompts(config, (9, 23, 14))
    got = paged_greedy(forward, state, config, prompts, block_size=4, chunk_size=chunk_size)
    assert got == [hf_greedy(hf_model, p, GREEDY_STEPS) for p in prompts]


def test_bfloat16_tracks_float32(tiny_checkpoint):
    """bfloat16 parameters and cache: logits near float32's, and the same argmax almost everywhere."""
    folder, _ = tiny_checkpoint("llama3")
    logits = []
    for dtype in ("float32", "bfloat16"):  # by name, as an engine config gives them
        model, config, _ = load_model(folder, dtype=dtype)
        graphdef, state = nnx.split(model)
        assert {leaf.dtype for leaf in jax.tree.leaves(state)} == {jnp.dtype(dtype)}
        prompts = random_prompts(config, LOGIT_PROMPT_LENGTHS)
        logits.append(np.concatenate(ragged_logits(make_forward(graphdef), state, config, prompts, cache_dtype=dtype)))
    f32, bf16 = logits
    assert np.abs(bf16 - f32).max() <= 0.06 * np.abs(f32).max()
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.9


def test_gemma3_bfloat16_is_as_near_float32_as_transformers(tiny_checkpoint):
    """Gemma in bfloat16 strays further from float32 than Llama (q/k norms of weight about 2 over
    head_dim 256, a logit cap): transformers' own bfloat16 model strays by about a fifth of the logits'
    range on the tiny checkpoint. Ours, with its (1 + w) norms and embedding scale rounded where
    transformers rounds them, may stray no further than that, nor lose more argmaxes."""
    folder, hf_model = tiny_checkpoint("gemma3")
    prompts = random_prompts(load_model(folder).config, LOGIT_PROMPT_LENGTHS)
    ours = {}
    for dtype in ("float32", "bfloat16"):
        model, config, _ = load_model(folder, dtype=dtype)
        graphdef, state = nnx.split(model)
        ours[dtype] = np.concatenate(ragged_logits(make_forward(graphdef), state, config, prompts, cache_dtype=dtype))
    with torch.no_grad():
        f32 = np.concatenate([hf_model(torch.tensor([p])).logits[0].numpy() for p in prompts])
        hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
        theirs = np.concatenate([hf_bf16(torch.tensor([p])).logits[0].float().numpy() for p in prompts])
    assert np.abs(ours["float32"] - f32).max() <= 1e-4 * np.abs(f32).max()
    assert np.abs(ours["bfloat16"] - f32).max() <= 1.25 * np.abs(theirs - f32).max()
    agree = lambda logits: (logits.argmax(-1) == f32.argmax(-1)).mean()
    assert agree(ours["bfloat16"]) >= agree(theirs) - 0.05


# What each weight's dims mean for tensor parallelism, by the param's name.
EXPECTED_SHARDING = {
    "embed": (TP_AXIS, None),  # vocab
    "lm_head": (None, TP_AXIS),  # vocab
    "qkv": (None, TP_AXIS, None, None),  # column-parallel: kv heads
    "qkv_bias": (TP_AXIS, None, None),
    "o": (TP_AXIS, None),  # row-parallel: input dim
    "gate_up": (None, None, TP_AXIS),  # column-parallel: intermediate
    "down": (TP_AXIS, None),  # row-parallel: intermediate
    "weight": (None,),  # norms, replicated
    "router": (None, None),  # replicated: every device routes every token alike
    "expert_gate_up": (None, None, None, TP_AXIS),  # each expert column-parallel: intermediate
    "expert_down": (None, TP_AXIS, None),  # each expert row-parallel: intermediate
}


def test_every_param_carries_a_partition_spec(tiny):
    hf_model, config, state, forward = tiny
    names = set()
    for path, param in nnx.to_flat_state(state):
        assert isinstance(param, nnx.Param)
        assert param.get_metadata()["out_sharding"] == EXPECTED_SHARDING[path[-1]], path
        names.add(path[-1])
    assert "lm_head" in names or config.tie_word_embeddings
    assert "qkv_bias" in names or not config.qkv_bias
    # The specs place the state on a mesh (sharding propagated by the compiler: Auto axes), and the
    # placed model computes what the unplaced one does.
    mesh = jax.make_mesh((len(jax.devices()),), (TP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
    placed = jax.device_put(state, nnx.get_named_sharding(state, mesh))
    prompts = random_prompts(config, (5, 9))
    unplaced = ragged_logits(forward, state, config, prompts)
    for got, want in zip(ragged_logits(forward, placed, config, prompts), unplaced, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_smollm2_gguf_greedy_matches_transformers(smollm2):
    model, config, tokenizer, hf_model = smollm2
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.eos_token_ids == (2,)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, return_dict=False)
        for c in CHAT_PROMPTS
    ]
    block_size = 16
    assert any(len(p) % block_size for p in prompts)
    graphdef, state = nnx.split(model)
    got = paged_greedy(make_forward(graphdef), state, config, prompts, block_size=block_size, chunk_size=24)
    want = [hf_greedy(hf_model, p, GREEDY_STEPS) for p in prompts]
    assert got == want
