"""The OpenAI-compatible API's request and response bodies, as pydantic models (so /openapi.json is the
API the server really speaks). Names and shapes are OpenAI's, with vLLM's extra sampling fields. The
ranges written here are the API's documented ones (a client reads them from /openapi.json); SamplingParams
checks them again, with what no schema says (min_tokens at most max_tokens, n > 1 needs sampling).

Requests refuse what they do not know: an OpenAI parameter the engine does not implement is a 400
naming it (unless sent with its "off" value, as some clients do), any other unknown field too.
"""

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from paged_jax.core.sampling_params import MAX_LOGPROBS
from paged_jax.serving.structured_protocol import ConstraintFields, DeltaToolCall, ToolCallIn, ToolCallOut, ToolFields


def one_of(forms: str) -> WrapValidator:
    """One error naming the forms a union field takes, instead of pydantic's one per member."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            raise PydanticCustomError("invalid_form", "must be {forms}", {"forms": forms}) from e

    return WrapValidator(validate)


TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
Prompt = Annotated[
    Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)],
    one_of("a non-empty text, a non-empty list of token ids (ints >= 0), or a non-empty list of either")]


class OpenAIModel(BaseModel):
    # NaN or infinite numbers are never meant: JSON has no such literals, Python's parser accepts them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Parameters of OpenAI's API the engine does not implement, with the values that mean "not used".
_OFF_VALUES = {
    "modalities": (["text"],),
    "service_tier": ("auto", "default"),
}


class _Request(OpenAIModel):
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in cls.UNSUPPORTED:
            value = data.get(name)
            if value is None or value is False or value in ([], {}) or value in _OFF_VALUES.get(name, ()):
                data = {k: v for k, v in data.items() if k != name}
            else:
                raise PydanticCustomError("unsupported_parameter", "{param} is not supported by this server",
                                          {"param": name})
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(_Request, ConstraintFields):
    """What completions and chat completions share: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = Field(None, description="The served model's name; omitted means that model.")
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, description="Default 1.0; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = None
    stop: Annotated[str | list[str] | None, one_of("a string or a list of strings")] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    priority: int = Field(0, description="Under --scheduling-policy priority, lower runs first (and is "
                                         "preempted last); any other policy accepts only 0.")
    # paged-jax's own.
    request_timeout: float | None = Field(
        None, gt=0, description="Seconds this request may take, within the server's --request-timeout.")
    slo_ttft_ms: float | None = Field(
        None, gt=0, description="This request's time-to-first-token objective in ms, within the server's "
                                "--slo-ttft-ms: refused (429) when the queue already makes it unattainable.")
    slo_tpot_ms: float | None = Field(
        None, gt=0, description="This request's time-per-output-token objective in ms, within the server's "
                                "--slo-tpot-ms; requests meeting their objectives count as goodput.")


class CompletionRequest(SamplingRequest):
    UNSUPPORTED: ClassVar = ("logit_bias", "suffix", "prompt_logprobs")

    prompt: Prompt = Field(description="A text, a list of token ids, or a list of either (one choice set per prompt).")
    max_tokens: int | None = Field(None, ge=1, description="Default 16 (OpenAI's), within the server's cap.")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="Top logprobs per generated token (and the chosen one's).")
    best_of: int | None = Field(None, description="Only best_of equal to n (no re-ranking) is supported.")


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextContentPart] | None, one_of("a string or a list of text parts "
                                                                 "({'type': 'text', 'text': ...})")] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingRequest, ToolFields):
    UNSUPPORTED: ClassVar = ("logit_bias", "functions", "function_call", "audio", "modalities", "prediction",
                             "reasoning_effort", "web_search_options", "service_tier", "store", "metadata", "verbosity")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI for max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


# Responses.


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


FinishReason = Literal["stop", "length", "tool_calls", "abort", "timeout", "error"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="The stop token id or stop string that ended it.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = []


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paged-jax"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (its id), as vLLM lists it
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None  # OpenAI's are strings; vLLM's own errors give the HTTP status


class ErrorResponse(BaseModel):
    error: ErrorInfo


class VersionResponse(BaseModel):
    version: str
