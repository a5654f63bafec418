"""Shared fixtures: tiny random Hugging Face checkpoints of each supported architecture, the real
SmolLM2 GGUF (ours and transformers'), greedy decoding by transformers as the reference, a server run
in a thread on a free localhost port, and faults (or slowness) to inject into an engine step."""

import contextlib
import functools
import gc
import socket
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
import uvicorn
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from models import load_model
from models.loader import load_tokenizer, resolve

_TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5, attn_implementation="eager",
)
# name -> (transformers model class, config); each exercises what sets it apart.
TINY_ARCHS = {
    # Llama 3.1's rope scaling, sized so that the test's positions cross all three of its regimes.
    "llama3": (LlamaForCausalLM, lambda: LlamaConfig(**_TINY, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    # head_dim set apart from hidden_size // num_heads, as Mistral Nemo does.
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**_TINY, head_dim=32, sliding_window=128)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_TINY)),  # biases on q/k/v
    "smollm2": (LlamaForCausalLM, lambda: LlamaConfig(**_TINY, tie_word_embeddings=True, rope_theta=100000.0)),
    # q/k norms, and head_dim set apart from hidden_size // num_heads as every Qwen3 has it.
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**_TINY, head_dim=32)),
    # Gemma 3's shape in small: head_dim 256, a window of 8 that the tests' prompts pass, sliding layers
    # around a full one (each with its own rotary base), the attention scale and a logit cap of their own.
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **_TINY | dict(num_hidden_layers=3), head_dim=256, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=64,
        final_logit_softcapping=5.0, rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)))),
    # Gemma 2: Gemma 3's layers without q/k norms, every second layer sliding, and its attention
    # scores soft-capped (a cap of 2 bends most of them).
    "gemma2": (Gemma2ForCausalLM, lambda: Gemma2Config(
        **_TINY | dict(num_hidden_layers=3), head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=5.0, attn_logit_softcapping=2.0)),
    # Mixtures of experts. Qwen3-MoE: 8 experts, top 2 renormalised, a dense layer between two sparse ones.
    "qwen3_moe": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **_TINY | dict(num_hidden_layers=3), head_dim=32, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    # The odd one: top 3 of 6 experts not renormalised, every second layer sparse, experts 40 wide (not
    # a whole number of the packed matmul's 16-column panels).
    "qwen3_moe_odd": (Qwen3MoeForCausalLM, lambda: Qwen3MoeConfig(
        **_TINY | dict(num_hidden_layers=4), head_dim=32, num_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=2)),
    # Mixtral: Mistral's layers, each with 8 experts as wide as its dense MLP, top 2 always renormalised.
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(**_TINY, num_local_experts=8, num_experts_per_tok=2)),
}

@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """After each test module, the programs its engines compiled are let go. XLA maps each compiled
    program's code into memory of its own, and a whole run's programs held at once went past Linux's
    limit on a process's mappings (vm.max_map_count, 65,530; 63,000 mappings and 9 GB by the last
    server tests), where the next compile crashed with a segmentation fault. Later modules load what
    they need again from the persistent compilation cache."""
    yield
    gc.collect()
    jax.clear_caches()


# The transformers references are small models. With two threads, torch's forward waits on a core that
# another process holds: ten SmolLM2 forwards took 36 s that way against 2 s on one thread.
torch.set_num_threads(1)


def make_tiny_model(arch: str, **config_overrides) -> torch.nn.Module:
    """A float32 transformers model with every weight random.

    transformers initializes norms to 1 and biases to 0; a loader that dropped them would pass.
    """
    model_class, config = TINY_ARCHS[arch]
    torch.manual_seed(list(TINY_ARCHS).index(arch))  # in the table's order: a new entry changes no one's weights
    config = config()
    config.update(config_overrides)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    return model


def make_peft_adapter(hf_model, folder: Path, seed: int, **lora_config) -> torch.nn.Module:
    """PEFT's model of a random LoRA adapter (peft.LoraConfig(**lora_config)) over a copy of hf_model, every
    A and B normal (B non-zero, unlike PEFT's initialization), saved in folder with save_pretrained."""
    import copy

    import peft

    model = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(**lora_config)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """arch -> (folder holding config.json and model.safetensors, the transformers model), made once."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(arch: str) -> tuple[Path, torch.nn.Module]:
        if arch not in made:
            model = make_tiny_model(arch)
            folder = tmp_path_factory.mktemp(arch)
            model.save_pretrained(folder)
            made[arch] = folder, model
        return made[arch]

    return get


CHAT_PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is and when to use one.",
    "What causes the seasons on Earth?",
)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct GGUF, loaded once: ours, its tokenizer, and transformers' own."""
    model, config, tokenizer = load_model("smollm2-135m")
    path = resolve("smollm2-135m")
    hf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, config, tokenizer, hf_model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens from transformers with its own KV cache, never stopping at EOS."""
    out = model(torch.tensor([prompt]), use_cache=True)
    generated = []
    while True:
        generated.append(int(out.logits[0, -1].argmax()))
        if len(generated) == steps:
            return generated
        out = model(torch.tensor([generated[-1:]]), past_key_values=out.past_key_values, use_cache=True)


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory) -> Path:
    """A tiny random SmolLM2-shaped model that speaks SmolLM2's vocabulary, with its real tokenizer and
    chat template: for server tests, where speed matters and sensible text does not. Its random
    tokens decode to any bytes, split UTF-8 characters included."""
    tokenizer = load_tokenizer("smollm2-135m")
    folder = tmp_path_factory.mktemp("tiny-chat")
    make_tiny_model("smollm2", vocab_size=len(tokenizer), max_position_embeddings=512, bos_token_id=1,
                    eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_chat_folder):
    return load_model(tiny_chat_folder)


@contextlib.contextmanager
def running_server(app, *, graceful_shutdown_s: float = 5.0):
    """Serve `app` with uvicorn in a thread on a free localhost port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                          timeout_graceful_shutdown=graceful_shutdown_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def slow_steps(engine, seconds: float) -> None:
    """Make each of the engine's steps take `seconds` longer (a sleep before the model runs): a known
    pace, for tests of what happens over time."""
    dispatch = engine.runner.dispatch

    def slow(*args):
        time.sleep(seconds)
        return dispatch(*args)

    engine.runner.dispatch = slow


def fail_on_host(*args):
    """A fault in the host's part of a step, in place of any method."""
    raise RuntimeError("injected fault")


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def fail_in_xla(kv_cache):
    """A fault at run time inside XLA, in a call the KV cache was donated to (as a kernel's error
    would be): XLA frees the donated buffers all the same."""
    def fail():
        raise RuntimeError("injected fault")
    return jax.pure_callback(fail, jax.ShapeDtypeStruct((), jnp.int32)), kv_cache
