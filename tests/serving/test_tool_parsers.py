"""The tool-call parsers on fixed texts: each format, several calls, text around them, malformed ones;
and a stream's view (every prefix of the text) adding up to the whole reply's."""

import json

import pytest

from paged_jax.serving.tool_parsers import (HermesParser, Llama3JsonParser, NamedParser, RequiredParser, ToolCall,
                                            ToolCallStream)

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", '{"zone": "Europe/Paris"}')

CASES = [
    # (parser, text, content, calls)
    (HermesParser(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                     '</tool_call>', "", [WEATHER]),
    (HermesParser(), 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                     '"unit": "celsius"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
                     '{"zone": "Europe/Paris"}}</tool_call>\nDone.', "Let me check.\n", [WEATHER, TIME]),
    # The model stopped right after its last call, without the closing tag.
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}', "", [TIME]),
    # Arguments written as a JSON string.
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"Europe/Paris\\"}"}</tool_call>',
     "", [TIME]),
    # One malformed call among good ones is dropped; with none good, everything is content.
    (HermesParser(), '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call><tool_call>{"name": '
                     '"get_time", "arguments": {"zone": "Europe/Paris"}}</tool_call>', "", [TIME]),
    (HermesParser(), 'Hi <tool_call>{"name": 3, "arguments": {}}</tool_call>',
     'Hi <tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    (HermesParser(), "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.",
     []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                         '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}', "", [WEATHER, TIME]),
    (Llama3JsonParser(), 'The weather in Paris is {"mild"}.', 'The weather in Paris is {"mild"}.', []),
    (Llama3JsonParser(), '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": '
                                                                          '{"city": ', []),
    (RequiredParser(), '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                       '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}]', "", [WEATHER, TIME]),
    (NamedParser("get_time"), '{"zone": "Europe/Paris"}', "", [TIME]),
    (NamedParser("get_time"), '{"zone": "Eur', '{"zone": "Eur', []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_replies(parser, text, content, calls):
    parsed = parser.parse(text, final=True)
    assert parsed.content == content
    assert parsed.calls == calls
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_a_stream_adds_up_to_the_whole_reply(parser, text, content, calls):
    """Fed every prefix, as a stream sees the text grow: content only grows, calls only get appended,
    and what the stream sent adds up to the whole reply's parse."""
    stream, sent_content, sent_calls = ToolCallStream(parser), "", []
    for end in range(len(text) + 1):
        final = end == len(text)
        parsed = parser.parse(text[:end], final)
        assert parsed.content.startswith(sent_content) and parsed.calls[: len(sent_calls)] == sent_calls
        more_content, more_calls = stream.update(text[:end], final)
        sent_content, sent_calls = sent_content + more_content, sent_calls + more_calls
    assert (sent_content, sent_calls) == (content, calls)


def test_single_call_keeps_the_first():
    text = ('[{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}, '
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]')
    assert ToolCallStream(RequiredParser(), single_call=True).update(text, final=True) == ("", [TIME])


def test_hermes_holds_back_what_may_open_a_call():
    assert HermesParser().parse("Checking <tool_c", final=False).content == "Checking "
    assert HermesParser().parse("Checking <tool_c", final=True).content == "Checking <tool_c"
    assert Llama3JsonParser().parse("  ", final=False).content == ""
