"""Tool calls in chat messages: a reply's calls as OpenAI's message and stream fields, and the
conversation's earlier calls and tool results as the chat template expects them."""

import json

from paged_jax.serving.openai_base import random_id
from paged_jax.serving.structured_protocol import (DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallOut)
from paged_jax.serving.tool_parsers import ToolCall


def tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=random_id("call"), function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_call_deltas(calls: list[ToolCall], first_index: int) -> list[DeltaToolCall]:
    """Whole calls as stream deltas, each with its id, name and complete arguments; first_index: the
    reply's number of calls before these."""
    return [DeltaToolCall(index=first_index + k, id=out.id, type="function",
                          function=DeltaFunctionCall(name=out.function.name, arguments=out.function.arguments))
            for k, out in enumerate(map(tool_call_out, calls))]


def template_message(message, content: str) -> dict:
    """A ChatMessage as chat templates take it. content: its text. Templates write an earlier call's
    arguments with `tojson`, so they get the object, not its JSON text (as vLLM gives them)."""
    out = {"role": message.role, "content": content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
