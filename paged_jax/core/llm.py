"""LLM: the offline API. Give it prompts, get one RequestOutput per prompt back, in order."""

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from models import DEFAULT_MODEL
from paged_jax.core.engine import LLMEngine
from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.outputs import RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model="smollm2-135m", **engine_options).generate(prompts, sampling_params)`.

    engine_options are EngineConfig's fields (block_size, max_num_seqs, enable_prefix_caching, ...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        self.engine = LLMEngine.from_pretrained(model, **engine_options)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """prompts: a text, a list of token ids, or a list of either. sampling_params: one for all, or
        one per prompt. priority: one per prompt, for scheduling_policy "priority" (lower runs first).
        lora_request: the LoRA adapter every prompt runs with, or one (or None: the base model) per prompt.
        Every request is checked before any runs: one bad prompt, or a constraint that does not compile
        (a GrammarError, a RequestError), fails the call and leaves the engine as it was. Each output is
        whole, whatever output_kind the params ask for."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(lora_request)} LoRA requests for {len(prompts)} prompts")
        compiler = self.engine.gate.compiler
        for params in sampling_params:
            if params is not None and params.structured_outputs is not None and compiler is not None:
                compiler.submit(params.structured_outputs).result()
        ids = []
        try:
            for prompt, params, rank, adapter in zip(prompts, sampling_params, priority, lora_request):
                whole = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self.engine.add_request(prompt, whole, priority=rank, lora_request=adapter))
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them. tools:
        OpenAI's function tools ({"type": "function", "function": {"name", "parameters", ...}}), for the
        chat template to show the model; the reply's tool calls are in its text, in the model's format
        (paged_jax.serving.tool_parsers reads them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt(c, tools=tools) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], *, tools: list[dict] | None = None) -> list[int]:
        """The token ids of a conversation under the tokenizer's chat template, ready for a reply."""
        return chat_prompt(self.tokenizer, conversation, tools=tools)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="requests", disable=not use_tqdm or len(request_ids) < 2) as bar:
            while len(done) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in request_ids]


def chat_prompt(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
                add_special_tokens: bool = False, tools: list[dict] | None = None,
                chat_template: str | None = None) -> list[int]:
    """The token ids of a conversation under the tokenizer's chat template, or `chat_template` where
    given (the template writes the special tokens, so none are added by default). tools: given to the
    template, which shows them to the model if it knows how."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         tools=tools, chat_template=chat_template)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
