"""The engine's record of one request: its sequences, and what its outputs have handed out so far."""

import dataclasses

from paged_jax.core.beam_search import Hypothesis
from paged_jax.core.output_text import OutputText
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams
from paged_jax.core.sequence import Sequence


@dataclasses.dataclass(eq=False)
class Sample:
    """One sample's output so far (beam search keeps none: its beams are replaced as it goes)."""

    text: OutputText
    num_tokens_sent: int = 0  # token ids handed out by DELTA outputs
    finish_sent: bool = False  # whether an output has said it finished


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None  # None when given as token ids
    prompt_token_ids: list[int]
    params: SamplingParams  # as asked (a beam's sequence asks the sampler for 2n logprobs)
    seqs: list[Sequence]  # its samples, or its live beams under beam search
    arrival_time: float  # the one record of it: each sequence's copy is the scheduler's sort key
    tokenizer: object  # a transformers tokenizer, or None
    first_scheduled_time: float | None = None
    samples: dict[int, Sample] = dataclasses.field(default_factory=dict)  # by sample index
    hypotheses: list[Hypothesis] = dataclasses.field(default_factory=list)

    def sample(self, seq: Sequence) -> Sample:
        sample = self.samples.get(seq.index)
        if sample is None:
            incremental = self.params.output_kind is not RequestOutputKind.FINAL_ONLY
            sample = self.samples[seq.index] = Sample(OutputText(self.tokenizer, self.params.stop,
                                                                 incremental=incremental))
        return sample

    @property
    def finished(self) -> bool:
        if self.params.use_beam_search:
            return all(beam.is_finished for beam in self.seqs)
        return len(self.seqs) == self.params.n and all(s.finish_reason is not None for s in self.seqs)


def new_request(request_id: str, prompt: str | list[int], token_ids: list[int], params: SamplingParams, *,
                seq_id: int, seed: int, priority: int, lora, arrival_time: float, tokenizer) -> Request:
    """A request and its first sequence (seq_id; a request with n samples forks ids seq_id + 1 .. + n - 1
    once its prompt is computed). lora: its LoRARequest or None."""
    # Beams ask the sampler for their 2n best proposals.
    seq_params = dataclasses.replace(params, logprobs=2 * params.n) if params.use_beam_search else params
    seq = Sequence(seq_id=seq_id, request_id=request_id, token_ids=list(token_ids),
                   num_prompt_tokens=len(token_ids), params=seq_params, seed=seed, arrival_time=arrival_time,
                   priority=priority, forks=1 if params.use_beam_search else params.n, lora=lora)
    return Request(request_id, prompt if isinstance(prompt, str) else None, list(token_ids), params, [seq],
                   arrival_time, tokenizer)
