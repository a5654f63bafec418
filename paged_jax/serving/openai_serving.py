"""The OpenAI-compatible API over an AsyncLLMEngine, as one object for the HTTP layer (server.py):
completions (openai_completions.py), chat completions (openai_chat.py) and vLLM's tokenizer
endpoints. Each answers a pydantic response, an EventStream of server-sent events, or raises an
APIError carrying OpenAI's error body."""

from paged_jax.core.errors import RequestError
from paged_jax.core.validation import check_token_ids
from paged_jax.serving.openai_chat import ChatServing
from paged_jax.serving.openai_completions import CompletionServing
from paged_jax.serving.openai_errors import APIError, refused
from paged_jax.serving.tokenize_protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                 TokenizeResponse)
from paged_jax.serving.openai_streams import EventStream

__all__ = ["APIError", "EventStream", "OpenAIServing"]


class OpenAIServing(CompletionServing, ChatServing):
    """OpenAIServing(engine, models, max_tokens_cap=..., request_timeout=...): see OpenAIBase."""

    def tokenize(self, request) -> TokenizeResponse:
        self._check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            ids = self._chat_ids(request.messages, request.add_generation_prompt,
                                 add_special_tokens=request.add_special_tokens)
        else:
            ids = self._encode(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.limits.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        try:
            check_token_ids(request.tokens, self.limits.vocab_size, "tokens")
        except RequestError as e:
            raise refused(e) from e
        return DetokenizeResponse(prompt=self._decode(request.tokens))
