"""Structured outputs and tool calls through the official `openai` client against the server on the real
SmolLM2-135M: parsed pydantic replies, sampled JSON that `jsonschema` validates, choice, regex, tool
calls whose arguments validate against the tool's parameters, streamed and not."""

import json
import re
from collections import defaultdict
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import running_server
from models import load_model
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT

MODEL = "smollm2"
# test_server_openai's SmolLM2 engine: in one pytest run the two share their compiled steps.
ENGINE = dict(block_size=16, num_blocks=256)

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client():
    loaded = load_model("smollm2-135m")
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**ENGINE))
    config = ServerConfig(served_model_name=MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running_server(build_app(engine, config)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
                                      response_format=City, max_tokens=64, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City)
    assert City.model_validate_json(r.choices[0].message.content) == r.choices[0].message.parsed


def test_twenty_sampled_replies_validate_streamed_and_not(client):
    messages = [{"role": "user", "content": "Make up a user profile as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "profile", "schema": PROFILE, "strict": True}}
    args = dict(model=MODEL, messages=messages, response_format=response_format, n=20, max_tokens=128,
                temperature=1.0)
    r = client.chat.completions.create(seed=1, **args)
    replies = [c.message.content for c in r.choices]
    assert [c.finish_reason for c in r.choices] == ["stop"] * 20
    streamed, reasons = defaultdict(str), {}
    for chunk in client.chat.completions.create(seed=2, stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert reasons == {i: "stop" for i in range(20)}
    for text in replies + list(streamed.values()):
        jsonschema.validate(json.loads(text), PROFILE)
    assert len(set(replies)) > 10  # sampled


def test_choice_and_regex(client):
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The film was wonderful. Sentiment?"}], max_tokens=8,
        n=4, temperature=1.0, seed=3, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "When did the Berlin wall fall?"}], max_tokens=16,
        n=4, temperature=1.0, seed=4, extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert all(re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", c.message.content) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="The Berlin wall fell on", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": " [0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch(" [0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text)


def streamed_calls(chunks) -> tuple[list[dict], str | None]:
    """The tool calls a stream sent, their deltas joined by index, and the last finish_reason."""
    calls, finish = defaultdict(lambda: {"id": "", "name": "", "arguments": ""}), None
    for chunk in chunks:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                call = calls[delta.index]
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice(client, tool_choice):
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=96, temperature=0.8,
                seed=5)
    r = client.chat.completions.create(**args)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls
    unstreamed = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    streamed, finish = streamed_calls(client.chat.completions.create(stream=True, **args))
    assert finish == "tool_calls"
    for calls in (unstreamed, streamed):
        for call in calls:
            assert call["id"].startswith("call")
            parameters = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
            jsonschema.validate(json.loads(call["arguments"]), parameters)
        if isinstance(tool_choice, dict):
            assert [c["name"] for c in calls] == ["get_time"]
    # The same sampled calls, streamed or not (ids apart).
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in unstreamed]


def test_auto_reads_hermes_calls_from_the_text(client):
    """The model made to write a Hermes call (with a regex, as SmolLM2 does not know the format): the
    server's parser turns the text into a tool call, streamed and not."""
    regex = r'I will check\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", ' \
            r'"unit": "(celsius|fahrenheit)"\}\}</tool_call>'
    args = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**args)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].message.content == "I will check.\n"
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(client.chat.completions.create(stream=True, **args))
    calls, finish = streamed_calls(chunks)
    assert (calls[0]["name"], calls[0]["arguments"], finish) == ("get_weather", call.function.arguments, "tool_calls")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I will check.\n"
