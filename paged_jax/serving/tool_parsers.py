"""Tool calls read out of a model's text: the formats `--tool-call-parser` names, and the JSON that
`tool_choice` "required" and a named function constrain the model to write (tool_constraints.py).

Each parser reads the text generated so far and says what of it is settled: the reply's content, and
the calls that are complete, in order. As the text grows, content only grows and calls only get
appended, so a stream sends the difference each time and a stream's calls are exactly the unstreamed
reply's. A call is sent whole, never a half-written argument object, so the concatenated `arguments`
of a streamed call always parse as JSON.

A call is an object with a string "name" and an object "arguments" (or "parameters", Llama's word).
Malformed calls are dropped; a text with no well-formed call at all is the reply's content, whole.
"""

import dataclasses
import json
import re
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object, as JSON text


@dataclasses.dataclass(frozen=True)
class ParsedTools:
    content: str  # the reply's text outside its calls, as far as it is settled
    calls: list[ToolCall]


class ToolParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedTools:
        """What is settled of `text` (the whole reply if final, else its start so far)."""


def _call(value) -> ToolCall | None:
    """A call from a decoded JSON value, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _held(text: str, marker: str) -> int:
    """Length of the longest end of text that could begin marker (a stream waits for the rest)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


def _settled(content: str, calls: list[ToolCall], text: str, final: bool) -> ParsedTools:
    # No well-formed call in the whole reply: it is all content (vLLM's fallback).
    return ParsedTools(text, []) if final and not calls else ParsedTools(content, calls)


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them (Hermes, Qwen2.5
    and many fine-tunes). The content is the text before the first call; the last call may lack its
    closing tag when the model stops right after it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool) -> ParsedTools:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedTools(text if final else text[: len(text) - _held(text, self.OPEN)], [])
        blocks = self._BLOCK.findall(text, start)
        tail = text.rfind(self.OPEN)
        if final and text.find(self.CLOSE, tail) < 0:
            blocks.append(text[tail + len(self.OPEN):])
        calls = [c for c in (_call(_loads(b)) for b in blocks) if c is not None]
        return _settled(text[:start], calls, text, final)


def _json_values(text: str, start: int, separator: str) -> list:
    """The complete JSON values from text[start:], separated by `separator` and whitespace, up to the
    end or to what does not parse (yet)."""
    decoder = json.JSONDecoder()
    values, i = [], start
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == separator):
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return values
        values.append(value)


class Llama3JsonParser:
    """Llama 3.1's JSON calls: the reply is `{"name": ..., "parameters": {...}}`, several separated by
    ";", perhaps after <|python_tag|>; a reply that does not open with "{" is content."""

    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedTools:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            undecided = not final and (not body or self.PYTHON_TAG.startswith(body))
            return ParsedTools("" if undecided else text, [])
        values = _json_values(body, 0, ";")
        return _settled("", [c for c in map(_call, values) if c is not None], text, final)


class RequiredParser:
    """tool_choice "required": a JSON array of {"name", "parameters"} objects, as constrained."""

    def parse(self, text: str, final: bool) -> ParsedTools:
        start = text.find("[")
        values = _json_values(text, start + 1, ",") if start >= 0 else []
        return _settled("", [c for c in map(_call, values) if c is not None], text, final)


class NamedParser:
    """tool_choice naming a function: the reply is that function's arguments object, as constrained."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedTools:
        call = _call({"name": self.name, "arguments": _loads(text)}) if final else None
        return _settled("", [call] if call else [], text, final)


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


class ToolCallStream:
    """One reply read as it grows: `update` gives what is newly settled (content, then whole calls).
    A reply that is not streamed is one update with final=True."""

    def __init__(self, parser: ToolParser, *, single_call: bool = False):
        """single_call: keep the first call only (parallel_tool_calls false)."""
        self.parser = parser
        self.single_call = single_call
        self.num_chars = 0  # of the content
        self.calls: list[ToolCall] = []

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        parsed = self.parser.parse(text, final)
        calls = parsed.calls[:1] if self.single_call else parsed.calls
        content, new = parsed.content[self.num_chars:], calls[len(self.calls):]
        self.num_chars, self.calls = len(parsed.content), calls
        return content, new
