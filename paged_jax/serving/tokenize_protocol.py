"""vLLM's tokenizer endpoints' bodies (POST /tokenize, /detokenize), beside OpenAI's in openai_protocol.py."""

from typing import Annotated

from pydantic import BaseModel, Field

from paged_jax.serving.openai_protocol import ChatMessage, OpenAIModel, TokenId


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


TokenizeRequest = Annotated[TokenizeCompletionRequest | TokenizeChatRequest, Field(union_mode="left_to_right")]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
