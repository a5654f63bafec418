"""Constraints the server refuses, each a 400 naming the field and, for a schema, the JSON pointer of the
keyword at fault; and the conversation's tools and tool messages reaching the chat template. On a tiny
random model: nothing here needs sensible text."""

import copy

import openai
import pytest

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_tags", "parameters": {
             "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# Shows what a tool-capable template must be given: the tools, earlier calls, tool results.
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
            "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}|{% endfor %}")


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    tokenizer = copy.deepcopy(tiny_chat_model.tokenizer)
    tokenizer.chat_template = TEMPLATE
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tokenizer,
                       EngineConfig(block_size=8, num_blocks=128))
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT), engine


def refused(client, **args) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **args)
    return e.value


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("args, param, message", [
    (dict(response_format=json_schema({"type": "object", "properties": {"a": {"type": "strng"}}})),
     "response_format", "invalid JSON schema keyword 'type' at /properties/a/type"),
    (dict(response_format=json_schema({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "not": {"const": "x"}}}}})),
     "response_format", "unsupported JSON schema keyword 'not' at /properties/items/items/not"),
    (dict(response_format={"type": "json_schema"}), "response_format", "needs json_schema.schema"),
    (dict(extra_body={"guided_regex": "[0-9"}), "guided_regex", "guided_regex: structured_outputs.regex '[0-9' "
                                                                "does not compile: unclosed character class"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "exactly one of"),
    (dict(extra_body={"structured_outputs": {"json": "{oops"}}), "structured_outputs", "not valid JSON"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex",
     "give one constraint, not 2: response_format, guided_regex"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice",
     "tool_choice names the function 'get_time', which is not among the tools (get_weather, get_tags)"),
    (dict(tools=TOOLS, tool_choice="required"), "tools[1].function.parameters",
     "tools[1].function.parameters: unsupported JSON schema keyword 'uniqueItems' at /properties/tags/uniqueItems"),
    (dict(tools=TOOLS[:1], tool_choice="auto"), "tool_choice", "--enable-auto-tool-choice"),
    (dict(tools=TOOLS[:1]), "tool_choice", "--enable-auto-tool-choice"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(tools=TOOLS[:1], tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "cannot be combined with tool_choice 'required'"),
])
def test_refusals_name_what_and_where(served, args, param, message):
    client, engine = served
    error = refused(client, **args)
    assert message in error.message
    assert error.param == param
    assert not engine.has_unfinished_requests()


def test_tools_and_tool_messages_reach_the_template(served):
    client, engine = served
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=1)
    expected = ("[tool get_weather][tool get_tags]user: Weather in Paris?|assistant: [call get_weather Paris]|"
                "tool: 21 C(call_1)|")
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(expected, add_special_tokens=False))
    assert r.choices[0].message.tool_calls == []
