"""Completions and chat completions: an OpenAI request becomes engine requests, and their outputs an
OpenAI response or a stream of server-sent events. HTTP itself is server.py's business.

Every check that can refuse a request happens before the first engine request is added, and a refusal
is an APIError carrying OpenAI's error body.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel

from paged_jax.serving.async_engine import AsyncLLMEngine, EngineStepError, RequestStream
from paged_jax.core.llm import chat_prompt
from paged_jax.serving.openai_protocol import (AssistantMessage, ChatCompletionChoice, ChatCompletionChunk,
                                       ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice,
                                       ChatLogprobs, ChatMessage, CompletionChoice, CompletionLogprobs,
                                       CompletionRequest, CompletionResponse, DeltaMessage, DetokenizeRequest,
                                       DetokenizeResponse, ErrorInfo, ErrorResponse, SamplingRequest,
                                       TokenizeChatRequest, TokenizeResponse, TokenLogprob, TopLogprob, UsageInfo,
                                       random_id)
from paged_jax.core.outputs import CompletionOutput, RequestOutput
from paged_jax.core.policy import check_priority
from paged_jax.core.sampling_params import SamplingParams, StructuredOutputsParams
from paged_jax.serving import structured_requests, tool_messages
from paged_jax.serving.structured_requests import RequestConstraint
from paged_jax.serving.tool_parsers import ToolCallStream

if TYPE_CHECKING:  # slo.py builds on this module's errors
    from paged_jax.serving.slo import SloGuard

log = logging.getLogger(__name__)

# JSON has no -inf: a logprob shown is at least this (vLLM's floor too).
_MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An answer other than 200: the HTTP status and OpenAI's error body. `cause` names the reason in the
    rejected-requests metric (None: not counted as a rejection)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, cause: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.cause, self.headers = cause, headers or {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.response().model_dump()


def bad_request(message: str, param: str | None = None, *, cause: str = "bad_params",
                code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code, cause=cause)


def sse(payload: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {payload.model_dump_json()}\n\n"


def sendable(text: str, sent: int, finished: bool, stop: Sequence[str]) -> int:
    """How much of a sample's text (the engine's full text so far) a stream may have sent now.

    All of it once finished. Before that, not a trailing U+FFFD (a character whose bytes are still
    coming, so it would change), nor a trailing piece that could begin a stop string (the engine cuts
    the text before a stop string once it has it whole, so that piece may vanish).
    """
    if finished:
        return len(text)
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, end - sent), hold, -1):
            if text.startswith(s[:k], end - k, end):
                hold = k
                break
    return max(sent, end - hold)


@dataclasses.dataclass
class _Sent:
    """What a stream has sent of one choice."""

    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions' logprobs: where the next token starts in the text
    finished: bool = False


@dataclasses.dataclass
class EventStream:
    """A streamed response: its events, and close() to end its requests if the events are not read to
    the end (the client left before the first event, say)."""

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


@dataclasses.dataclass(frozen=True)
class _Prompt:
    text: str | None  # None when given as token ids
    token_ids: list[int]


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_name: str, *, max_tokens_cap: int | None = None,
                 request_timeout: float | None = None, guard: "SloGuard | None" = None,
                 auto_tool_parser: str | None = None):
        """max_tokens_cap: the most tokens one request may ask for. request_timeout: seconds a request
        may take at most (each request may ask for less). guard: latency objectives (slo.py).
        auto_tool_parser: the tool_parsers.PARSERS name tool_choice "auto" reads calls with (None:
        "auto" is refused)."""
        self.engine = engine
        self.guard = guard
        self.model_name = model_name
        self.max_tokens_cap = max_tokens_cap
        self.request_timeout = request_timeout
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine.resolved.max_model_len
        self._max_num_seqs = engine.engine.config.max_num_seqs
        self._vocab_size = engine.engine.model_config.vocab_size
        self._token_strs: dict[int, str] = {}
        self.auto_tool_parser = auto_tool_parser

    # Completions.

    async def create_completion(self, request: CompletionRequest) -> CompletionResponse | EventStream:
        self._check_model(request.model)
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request(f"best_of={request.best_of} is not supported: only best_of equal to n "
                              f"(here {request.n}), as nothing is re-ranked", "best_of", code="unsupported_parameter")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo with logprobs needs the prompt's logprobs, which this server does not compute",
                              "echo", code="unsupported_parameter")
        prompts = self._completion_prompts(request.prompt)
        constraint = await self._constraint(request)
        params = [self._sampling_params(request, len(p.token_ids), request.max_tokens, "max_tokens", request.logprobs,
                                        constraint.structured_outputs, default_max_tokens=16) for p in prompts]
        response_id = random_id("cmpl")
        streams = await self._submit(response_id, prompts, params, request)
        if request.stream:
            return EventStream(_ending(self._completion_events(response_id, request, prompts, streams)), streams)
        finals = await _finals(streams)
        choices = []
        for p, final in zip(prompts, finals):
            for c in final.outputs:
                text = (self._prompt_text(p) if request.echo else "") + c.text
                logprobs = (self._completion_logprobs(c.token_ids, c.logprobs, request.logprobs, 0)
                            if request.logprobs is not None else None)
                choices.append(CompletionChoice(index=len(choices), text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return CompletionResponse(id=response_id, model=self.model_name, choices=choices, usage=_usage(prompts, finals))

    def _completion_prompts(self, prompt: str | list) -> list[_Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return [_Prompt(p, self._encode(p)) if isinstance(p, str) else _Prompt(None, list(p)) for p in prompt]

    async def _completion_events(self, response_id: str, request: CompletionRequest, prompts: list[_Prompt],
                                 streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        sent: dict[int, _Sent] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        async with contextlib.aclosing(_merge(streams)) as outputs:
            async for i, out in outputs:
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    index = i * request.n + c.index
                    first = index not in sent
                    state = sent.setdefault(index, _Sent())
                    if state.finished:
                        continue
                    delta, new_ids, new_logprobs = self._advance(state, c, request.stop)
                    if first and request.echo:
                        delta = self._prompt_text(prompts[i]) + delta
                    if not (delta or new_ids or state.finished):
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._completion_logprobs(new_ids, new_logprobs, request.logprobs, state.text_offset)
                        state.text_offset += sum(map(len, logprobs.tokens))
                    choice = CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    yield sse(CompletionResponse(id=response_id, created=created, model=self.model_name, choices=[choice]))
        if request.stream_options and request.stream_options.include_usage:
            yield sse(CompletionResponse(id=response_id, created=created, model=self.model_name, choices=[],
                                         usage=_usage(prompts, finals)))

    # Chat completions.

    async def create_chat_completion(self, request: ChatCompletionRequest) -> ChatCompletionResponse | EventStream:
        self._check_model(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        constraint = await self._constraint(request)
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        prompt = _Prompt(None, self._chat_ids(request.messages, request.add_generation_prompt, tools=tools))
        if request.max_completion_tokens is not None:
            max_tokens, name = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = request.max_tokens, "max_tokens"
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self._sampling_params(request, len(prompt.token_ids), max_tokens, name, logprobs,
                                       constraint.structured_outputs)
        response_id = random_id("chatcmpl")
        streams = await self._submit(response_id, [prompt], [params], request)
        if request.stream:
            return EventStream(_ending(self._chat_events(response_id, request, prompt, streams[0], constraint)), streams)
        [final] = await _finals(streams)
        choices = []
        for c in final.outputs:
            content, calls = c.text, []
            if constraint.parser is not None:
                content, calls = _tool_reader(constraint).update(c.text, final=True)
            choices.append(ChatCompletionChoice(
                index=c.index, message=AssistantMessage(content=content or None if calls else content,
                                                        tool_calls=[tool_messages.tool_call_out(t) for t in calls]),
                logprobs=self._chat_logprobs(c.token_ids, c.logprobs, logprobs) if request.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, calls), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=choices,
                                      usage=_usage([prompt], [final]))

    async def _chat_events(self, response_id: str, request: ChatCompletionRequest, prompt: _Prompt,
                           stream: RequestStream, constraint: RequestConstraint) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionChunk(id=response_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage))

        # The role comes first, as OpenAI sends it, before any token exists.
        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(request.n)])
        sent: dict[int, _Sent] = {}
        readers: dict[int, ToolCallStream] = {}  # with a tool parser: each choice's calls so far
        final = None
        async for out in stream:
            final = out
            for c in out.outputs:
                state = sent.setdefault(c.index, _Sent())
                if state.finished:
                    continue
                delta, new_ids, new_logprobs = self._advance(state, c, request.stop)
                calls = []
                if constraint.parser is not None:
                    reader = readers.setdefault(c.index, _tool_reader(constraint))
                    delta, calls = reader.update(c.text[: state.chars], state.finished)
                    calls = tool_messages.tool_call_deltas(calls, len(reader.calls) - len(calls))
                if not (delta or new_ids or calls or state.finished):
                    continue
                logprobs = (self._chat_logprobs(new_ids, new_logprobs, request.top_logprobs or 0)
                            if request.logprobs else None)
                called = readers[c.index].calls if c.index in readers else []
                yield chunk([ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=delta, tool_calls=calls or None), logprobs=logprobs,
                    finish_reason=_finish_reason(c.finish_reason, called), stop_reason=c.stop_reason)])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], _usage([prompt], [final]))

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, **options) -> list[int]:
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        conversation = [tool_messages.template_message(m, _content_text(m.content)) for m in messages]
        try:
            return chat_prompt(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt, **options)
        except Exception as e:  # the template refused the conversation (roles out of order, say)
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e

    # Tokenizer endpoints (vLLM's).

    def tokenize(self, request) -> TokenizeResponse:
        self._check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            ids = self._chat_ids(request.messages, request.add_generation_prompt,
                                 add_special_tokens=request.add_special_tokens)
        else:
            ids = self._encode(request.prompt, add_special_tokens=request.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(request.model)
        self._check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self._decode(request.tokens))

    # Shared.

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", cause="not_found")

    def _check_token_ids(self, ids: Sequence[int], param: str) -> None:
        if not all(0 <= t < self._vocab_size for t in ids):
            raise bad_request(f"{param} must be token ids in [0, {self._vocab_size})", param)

    def _encode(self, text: str, **options) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids", "prompt")
        return self.tokenizer.encode(text, **options)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: it speaks token ids only", "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self._decode(prompt.token_ids)

    def _sampling_params(self, request: SamplingRequest, prompt_len: int, max_tokens: int | None, name: str,
                         logprobs: int | None, structured_outputs: StructuredOutputsParams | None = None, *,
                         default_max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams for a prompt of prompt_len tokens; refuses what cannot fit.
        Without max_tokens, a request gets default_max_tokens (None: all the room the context leaves),
        within the server's cap and the context."""
        if request.n > self._max_num_seqs:
            raise bad_request(f"n={request.n} is above this server's max_num_seqs={self._max_num_seqs}", "n")
        if request.stop_token_ids:
            self._check_token_ids(request.stop_token_ids, "stop_token_ids")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"this model's maximum context length is {self.max_model_len} tokens, and the "
                              f"prompt has {prompt_len}: no room for a completion", "prompt", cause="too_long",
                              code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens or room, room, self.max_tokens_cap or room)
        if self.max_tokens_cap is not None and max_tokens > self.max_tokens_cap:
            raise bad_request(f"{name}={max_tokens} is above this server's cap of {self.max_tokens_cap}", name,
                              cause="too_long")
        if prompt_len + max_tokens > self.max_model_len:
            raise bad_request(f"this model's maximum context length is {self.max_model_len} tokens, but "
                              f"{prompt_len + max_tokens} were asked for: {prompt_len} in the prompt and {name}="
                              f"{max_tokens}; shorten either", name, cause="too_long", code="context_length_exceeded")
        try:
            return SamplingParams(
                n=request.n, temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=-1 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, stop=request.stop,
                stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos, logprobs=logprobs,
                structured_outputs=structured_outputs)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from e

    async def _constraint(self, request: SamplingRequest) -> RequestConstraint:
        """The request's constraint, compiled (off the event loop, and cached for the engine), or a 400
        naming the field at fault."""
        try:
            constraint = structured_requests.request_constraint(request, auto_tool_parser=self.auto_tool_parser)
            if constraint.checks and self.engine.engine.grammars is None:
                raise structured_requests.ConstraintError("this model has no tokenizer, which constraints need",
                                                          constraint.checks[-1][0])
            for param, so in constraint.checks:
                await structured_requests.compiled(self.engine.engine.grammars, so, param)
        except structured_requests.ConstraintError as e:
            raise bad_request(str(e), e.param) from e
        return constraint

    def _timeout(self, request: SamplingRequest) -> float | None:
        if request.request_timeout is None:
            return self.request_timeout
        if self.request_timeout is not None and request.request_timeout > self.request_timeout:
            raise bad_request(f"request_timeout={request.request_timeout} is above this server's cap of "
                              f"{self.request_timeout} s", "request_timeout")
        return request.request_timeout

    async def _submit(self, response_id: str, prompts: list[_Prompt], params: list[SamplingParams],
                      request: SamplingRequest) -> list[RequestStream]:
        """One engine request per prompt; if one is refused, the others are aborted."""
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options needs stream set to true", "stream_options")
        timeout = self._timeout(request)
        try:
            check_priority(self.engine.engine.config.scheduling_policy, request.priority)
        except ValueError as e:
            raise bad_request(str(e), "priority") from e
        admission = None if self.guard is None else self.guard.admit(request, len(prompts))
        streams = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                stream = await self.engine.add_request(prompt.token_ids, p, f"{response_id}-{i}", timeout=timeout,
                                                       priority=request.priority)
                streams.append(stream if admission is None else admission.watch(stream))
        except BaseException as e:
            for stream in streams:
                stream.close()
            if isinstance(e, ValueError):  # the engine's own checks (an empty prompt, unknown token ids)
                raise bad_request(str(e), "prompt") from e
            raise
        return streams

    def _advance(self, state: _Sent, c: CompletionOutput, stop) -> tuple[str, list[int], list[dict]]:
        """The text a choice may send now, its tokens not yet sent and their logprobs; moves `state` on."""
        stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
        upto = sendable(c.text, state.chars, c.finished, stops)
        delta = c.text[state.chars:upto]
        new_ids = c.token_ids[state.tokens:]
        new_logprobs = c.logprobs[state.tokens:] if c.logprobs is not None else []
        state.chars, state.tokens, state.finished = max(upto, state.chars), len(c.token_ids), c.finished
        return delta, new_ids, new_logprobs

    def _token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            # Without a tokenizer, vLLM's spelling of a bare token id.
            text = f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
            self._token_strs[token_id] = text
        return text

    def _top(self, entry: dict[int, float], k: int) -> list[tuple[str, float]]:
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        return [(self._token_str(t), max(lp, _MIN_LOGPROB)) for t, lp in best]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                             offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, entry in zip(token_ids, logprobs):
            text = self._token_str(token)
            out.tokens.append(text)
            out.token_logprobs.append(max(entry[token], _MIN_LOGPROB))
            out.top_logprobs.append(dict(self._top(entry, k)))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> ChatLogprobs:
        def top(token: str, logprob: float) -> TopLogprob:
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for token, entry in zip(token_ids, logprobs):
            chosen = top(self._token_str(token), max(entry[token], _MIN_LOGPROB))
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[top(*t) for t in self._top(entry, k)]))
        return ChatLogprobs(content=content)


def _content_text(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def _tool_reader(constraint: RequestConstraint) -> ToolCallStream:
    return ToolCallStream(constraint.parser, single_call=constraint.single_call)


def _finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _usage(prompts: list[_Prompt], finals: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _engine_error(e: EngineStepError) -> APIError:
    return APIError(500, str(e), type="server_error", code="engine_error")


async def _ending(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then `data: [DONE]`. A failure midway (the status line has gone out) becomes an
    error event: this request fails alone, the server carries on."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except EngineStepError as e:
        yield sse(_engine_error(e).response())
    except APIError as e:  # after the status line: a queue timeout (slo.py), say
        yield sse(e.response())
    except Exception as e:
        log.exception("a streamed response failed")
        yield sse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").response())
    yield "data: [DONE]\n\n"


async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's finished output. An engine failure (raised, or finish_reason "error") or a timeout
    is an APIError; the streams are closed whatever happens (so a cancelled caller aborts its requests)."""

    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    try:
        finals = await asyncio.gather(*map(last, streams))
    except EngineStepError as e:
        raise _engine_error(e) from e
    finally:
        for stream in streams:
            stream.close()
    if any(c.finish_reason == "error" for f in finals for c in f.outputs):
        raise APIError(500, "the engine failed while running this request", type="server_error", code="engine_error")
    timed_out = [f for f in finals if any(c.finish_reason == "timeout" for c in f.outputs)]
    if timed_out:
        elapsed = timed_out[0].metrics.finish_time - timed_out[0].metrics.arrival_time
        raise APIError(408, f"the request ran out of time after {elapsed:.1f} s, with "
                       f"{sum(len(c.token_ids) for c in timed_out[0].outputs)} tokens generated",
                       type="timeout_error", param="request_timeout", code="request_timeout")
    return finals


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
