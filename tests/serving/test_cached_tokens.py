"""usage.prompt_tokens_details.cached_tokens through the official `openai` client: the prompt tokens the
prefix cache served, on completions and chat, answered whole or streamed with a final usage chunk."""

import openai
import pytest

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app

MODEL = "tiny"
TIMEOUT = 300.0  # generous: the test checks what the server says, never how fast it says it
ENGINE = dict(block_size=16, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
USAGE = {"include_usage": True}


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer, EngineConfig(**ENGINE))
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_the_prompt_tokens_the_prefix_cache_served(client, stream):
    def usage(prompt):
        if not stream:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                                stream=True, stream_options=USAGE))
        assert all(c.usage is None for c in chunks[:-1])
        return chunks[-1].usage

    prompt = list(range(1000 + 200 * stream, 1100 + 200 * stream))  # 100 tokens, new to the cache
    first = usage(prompt)
    assert first.prompt_tokens == 100 and cached(first) == 0
    # 99 tokens are looked up (the last one is always computed, for its logits): 6 whole blocks.
    assert cached(usage(prompt)) == 96
    # A prompt sharing its first 40 tokens: 2 whole blocks of them are reused.
    assert cached(usage(prompt[:40] + [7] * 60)) == 32
    # Two prompts in one request: their hits add up.
    two = client.completions.create(model=MODEL, prompt=[prompt, list(range(5000 + stream * 100, 5050 + stream * 100))],
                                    max_tokens=2, temperature=0)
    assert cached(two.usage) == 96


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_the_prompt_tokens_the_prefix_cache_served(client, stream):
    # A system prompt of its own from the first token, so no earlier chat shares its first block.
    messages = [{"role": "system", "content": f"Variant {int(stream)} of a long system prompt: " + "be brief. " * 30},
                {"role": "user", "content": "What is PagedAttention?"}]

    def usage():
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0).usage
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                     stream=True, stream_options=USAGE))
        return chunks[-1].usage

    first = usage()
    assert first.prompt_tokens > 100 and cached(first) == 0
    again = usage()
    assert again.prompt_tokens == first.prompt_tokens
    assert cached(again) == (first.prompt_tokens - 1) // 16 * 16
