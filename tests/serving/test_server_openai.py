"""The server through the official `openai` client, on the real SmolLM2-135M: greedy text equals
LLM.generate and LLM.chat, streams equal unstreamed answers, n samples, stop strings, seeds, logprobs,
usage, and the client's typed errors (429 is in test_server_queue.py)."""

import openai
import pytest

from conftest import CHAT_PROMPTS, running_server
from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT

KEY = "sk-test"
MODEL = "smollm2"
# test_engine's SmolLM2 engine: in one pytest run the two share their compiled steps.
ENGINE = dict(block_size=16, num_blocks=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m")


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def client(loaded):
    with running_server(build_app(make_engine(loaded), ServerConfig(served_model_name=MODEL, api_key=KEY))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def llm(loaded):
    """The offline API on its own engine over the same weights: the reference."""
    return LLM.from_engine(make_engine(loaded))


def test_greedy_completions_equal_llm_generate_streamed_or_not(client, llm):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [c.text for c in r.choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.outputs[0].finish_reason for e in expected]
    assert r.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert r.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True))
    assert len(chunks) > 3  # one chunk per new text, not one at the end
    assert "".join(c.choices[0].text for c in chunks) == r.choices[1].text
    assert chunks[-1].choices[0].finish_reason == r.choices[1].finish_reason


def test_greedy_chat_equals_llm_chat_and_streams_the_same(client, llm):
    messages = [{"role": "user", "content": CHAT_PROMPTS[1]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    [expected] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    counts = lambda usage: (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    assert counts(chunks[-1].usage) == counts(r.usage)  # the cached tokens differ: the stream came second


def test_n_samples_and_seeds(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=1.0)
    first = client.chat.completions.create(n=3, seed=1234, **args)
    again = client.chat.completions.create(n=3, seed=1234, **args)
    other = client.chat.completions.create(n=3, seed=4321, **args)
    texts = lambda r: [c.message.content for c in r.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts(first) == texts(again) != texts(other)
    assert 3 <= first.usage.completion_tokens <= 3 * 6


def test_stop_strings(client):
    args = dict(model=MODEL, prompt="Count: one, two, three, four, five,", max_tokens=12, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop = full.strip().split()[1]
    r = client.completions.create(stop=[stop, "zzz"], **args)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **args))
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == logprob == top[token] <= 0  # greedy: the top token

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes) == entry.token.encode()


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4080 tokens"):  # 255 blocks of 16
        client.completions.create(model=MODEL, prompt="hi", max_tokens=9000)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="hi", logit_bias={"5": 10})
    with pytest.raises(openai.BadRequestError, match="functions is not supported"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       functions=[{"name": "f", "parameters": {"type": "object"}}])
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"top_k": -5})
    assert error.value.code == "invalid_value" and error.value.param == "top_k"
