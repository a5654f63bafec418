"""The OpenAI API's bodies for structured outputs and tools, as pydantic models: `response_format`,
vLLM's `structured_outputs` extra body, `tools` and `tool_choice`, and the tool calls a reply carries
(whole in a reply, as deltas in a stream)."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    description: str | None = None
    # "schema" would shadow pydantic's own attribute.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra body: exactly one constraint."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ConstraintFields(_Strict):
    """What completions and chat completions take to constrain the output: vLLM's structured_outputs,
    or one of its older guided_* fields."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class ToolFields(_Strict):
    """A chat completion's fields for JSON replies and tool calls (OpenAI's)."""

    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description='Default "auto" with tools, "none" without.')
    parallel_tool_calls: bool | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
