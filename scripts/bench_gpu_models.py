"""The models scripts/bench_gpu.py runs, their model call timed, and the same weights in transformers.

- Configs: config.json values shipped in scripts/configs/ (no checkpoint travels to a lent GPU), or
  the same structure shrunk for the CPU (2 layers, hidden 256, head_dim 32, 2 KV heads, a vocabulary
  of 40,960; GQA group, tied embeddings and rope scaling kept).
- Weights: random, drawn by the model's own initializers (normal(0.02) matrices, unit norms) where
  JAX's default device is: on a GPU, Llama-3.1-8B's 16 GB of bfloat16 never pass through the host.
- transformers: the model's parameters as the Hugging Face tensors the loader would have placed in
  them (its weight table run backwards), handed to torch through DLPack on the same device, and
  generated from by transformers' continuous batching (`generate_batch`). torch is imported here
  only, never by the engine.
- The model call: an engine's jitted model step (step_programs.step) on a hand-made batch, timed as the
  runner calls it.
"""

import dataclasses
import json
import pathlib
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import loader
from models.config import ModelConfig
from models.registry import architecture, traits
from paged_jax import SamplingParams
from paged_jax.core import step_programs
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
# The CPU's stand-in sizes. The vocabulary still holds W1's token ids (up to 40,000), and no more: random
# embeddings of 128,256 x 256 took the 2-core machine seconds to draw.
TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=32,
            vocab_size=40960)


def hf_config(name: str, *, tiny: bool = False) -> dict:
    """The config.json values of scripts/configs/<name>.json; tiny: the CPU's stand-in of the same
    structure (TINY's sizes, the GQA group kept: 2 KV heads and 2 * group query heads; no BOS or EOS
    ids, which would lie outside its vocabulary)."""
    hf = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:
        group = hf["num_attention_heads"] // hf["num_key_value_heads"]
        hf |= TINY | {"num_attention_heads": 2 * group, "bos_token_id": None, "eos_token_id": None}
    return hf


def model_config(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf_config(hf, traits, source="scripts/configs")


def random_model(config: ModelConfig, *, dtype=jnp.bfloat16, seed: int = 0) -> nnx.Module:
    """The model of `config` with the weights its initializers draw, made on JAX's default device.
    models/tiny.py's random_model draws a second set over these, normal(0.15), so that tests compare
    tokens away from near-ties: twice the weights' memory at its peak (32 GB for Llama-3.1-8B)."""
    return architecture(config.architecture).model_class(config, dtype=dtype, rngs=nnx.Rngs(seed))


def weight_bytes(model: nnx.Module) -> int:
    """Bytes of the parameters the model call (step_programs.step) reads whole: all but the embedding, of
    which it gathers a row a token, and the lm_head, which the sampler's call reads (a tied one is the
    embedding)."""
    return sum(v.size * v.dtype.itemsize for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
               if path not in (("embed",), ("lm_head",)) for v in [var.get_value()])


def hf_tensors(model: nnx.Module) -> dict[str, jax.Array]:
    """Every Hugging Face tensor the loader would place into `model` (name -> [its Hugging Face shape],
    on the model's device), taken back out of the model's fused parameters.

    Each rule of the architecture's weight table places a tensor by a transpose or a reshape into a
    slice of a parameter: a linear map, so its transpose (jax.linear_transpose), a permutation, reads the
    tensor back from that slice."""
    config = model.config
    params = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = {}
    # The loader's own expansion of the table, per layer: the names and paths it would read and fill.
    for name, (rule, path, expert) in loader._expected(config).items():
        assert expert is None, "a dense model's weights only"
        where = []

        def place(a, rule=rule, where=where):
            index, value = rule.place(a, config)
            where.append(index)
            return value

        back = jax.linear_transpose(place, jax.ShapeDtypeStruct(rule.hf_shape(config), params[path].dtype))
        (tensors[name],) = back(params[path][where[0]])
    return tensors


def continuous_batching_missing() -> str | None:
    """Why transformers' continuous batching cannot run here, or None when it can."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return f"torch or transformers is missing ({e})"
    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        return f"transformers {transformers.__version__} has no generate_batch (continuous batching)"
    if jax.default_backend() == "gpu" and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU"
    return None


def transformers_model(model: nnx.Module, hf: dict):
    """A transformers model of config.json values `hf` holding `model`'s weights, as torch tensors over
    the same device's buffers (DLPack: no copy through the host), with attention "sdpa" (transformers'
    continuous batching switches to flash attention where it is installed)."""
    import torch
    import transformers

    tensors = {name: torch.from_dlpack(a) for name, a in hf_tensors(model).items()}
    with torch.device("meta"):  # no weights drawn only to be replaced
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**hf), attn_implementation="sdpa")
    hf_model.load_state_dict(tensors, strict=True, assign=True)
    # The rotary frequencies are a buffer outside the state dict, made on the meta device above.
    device = next(iter(tensors.values())).device
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(hf_model.config).to(device)
    return hf_model.eval()


def transformers_generate(hf_model, prompts: list[list[int]], max_new_tokens: int, *, max_batch_tokens: int,
                          page_size: int = 256) -> tuple[float, list[list[int]], str]:
    """(seconds, each prompt's greedy tokens, the attention implementation that ran) of
    `hf_model.generate_batch` on `prompts`, EOS ignored, timed on a second call to a manager that the
    first made and warmed up (its cache allocated, its CUDA graphs captured), as our engine is timed
    after its compiles. Its KV cache holds every request at once (blocks of page_size tokens) and a
    step takes at most max_batch_tokens tokens, as ours."""
    import transformers
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(map(len, prompts)) + max_new_tokens
    # Only the sizes this version of transformers takes (the GPU image's is older than ours), and a
    # block count only where blocks are page_size tokens: without one it sizes its cache from the memory
    # it finds free.
    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    sizes = dict(max_batch_tokens=max_batch_tokens)
    if "page_size" in known:
        sizes |= dict(page_size=page_size, num_blocks=len(prompts) * (-(-longest // page_size) + 1))
    batching = ContinuousBatchingConfig(**{k: v for k, v in sizes.items() if k in known})
    generation = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0)

    def run():
        return hf_model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching,
                                       persistent_manager=True, progress_bar=False)

    try:
        run()
        start = time.perf_counter()
        results = run()
        elapsed = time.perf_counter() - start
    finally:
        hf_model.destroy_cached_continuous_batching_manager()
    failed = [r.error for r in results.values() if r.error]
    if failed:
        raise RuntimeError(f"transformers failed {len(failed)} requests: {failed[0]}")
    # In the prompts' order, found by prompt: not every version returns them in the order given.
    by_prompt = {tuple(r.prompt_ids): list(r.generated_tokens) for r in results.values()}
    return elapsed, [by_prompt.get(tuple(p), []) for p in prompts], hf_model.config._attn_implementation


def scheduled_batch(num_seqs: int, context: int, new: int, *, vocab: int, block_size: int) -> list[ScheduledSeq]:
    """num_seqs sequences of `context` random tokens whose last `new` a step computes (1: a decode step;
    context: a whole prompt), each in blocks of its own, numbered from 1 (0 is the null block)."""
    rng = np.random.default_rng(0)
    per_seq, out = -(-context // block_size), []
    for i in range(num_seqs):
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=rng.integers(2, vocab, context).tolist(),
                       num_prompt_tokens=context, params=SamplingParams(temperature=0.0), seed=i, arrival_time=0.0)
        seq.block_ids = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        seq.num_computed_tokens = context - new
        out.append(ScheduledSeq(seq, new))
    return out


def random_pages(kv_cache):
    """The cache (a KVCache, donated) with normal(0, 1) in every page: the contexts a timed decode step
    attends over were never written by a step (on the CPU the pool is unwritten memory, NaN at times).
    Committed to the cache's device, as the runner's is: an uncommitted cache compiles the step again.

    One page array at a time through one program: a single program drawing all of Llama-3.1-8B's 64
    arrays took longer to compile on an H100 than the 250 s its part had (docs/gpu.md)."""
    pages, tree = jax.tree.flatten(kv_cache)
    draw = jax.jit(lambda key, p: jax.random.normal(key, p.shape, p.dtype), donate_argnums=1,
                   out_shardings=pages[0].sharding)
    keys = jax.random.split(jax.random.key(0), len(pages))
    return jax.tree.unflatten(tree, [draw(k, p) for k, p in zip(keys, pages)])


class Timing(NamedTuple):
    first_s: float  # the first call, its compile included
    median_s: float  # of the calls after it
    finite: bool  # whether the last call's output is
    recompiles: int  # programs compiled after the first call (0, or the timing holds compiles)


def time_model_call(engine, scheduled: list[ScheduledSeq], repeats: int) -> Timing:
    """An LLMEngine's model call on `scheduled`, with the host arrays its runner would pass
    (step_programs.step on what runner.step_args gives), over random pages, called 1 + repeats times.
    The KV cache is donated: each call takes the one the last returned, as the runner's steps do, and
    the runner is given a fresh one after."""
    (graph, weights, kv_cache, *step_inputs), keywords = engine.runner.step_args(scheduled)
    kv_cache = random_pages(kv_cache)
    times, compiled = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        hidden, kv_cache = step_programs.step(graph, weights, kv_cache, *step_inputs, **keywords)
        jax.block_until_ready((hidden, kv_cache))
        times.append(time.perf_counter() - start)
        compiled.append(engine.runner.num_compiles)
    finite = bool(jnp.isfinite(hidden).all())
    del kv_cache
    engine.runner.restore_kv_cache()
    return Timing(times[0], float(np.median(times[1:])), finite, compiled[-1] - compiled[0])
