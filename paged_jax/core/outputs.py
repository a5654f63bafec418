"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes.

What an output holds follows its request's SamplingParams.output_kind: everything so far
(CUMULATIVE), what is new since the request's previous output (DELTA: the new text, token ids and
logprobs; a sample with nothing new is left out), or everything once, when the request finishes
(FINAL_ONLY). RequestOutput.add folds a later delta into an output.
"""

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Sum of the chosen tokens' logprobs; None unless the request asked for logprobs (as in vLLM:
    # the sampler computes none otherwise). Beam search always has it.
    cumulative_logprob: float | None
    # Per generated token: {token id: logprob} holding the chosen token and the top N.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> "CompletionOutput":
        """A copy whose lists are its own."""
        return dataclasses.replace(self, token_ids=list(self.token_ids),
                                   logprobs=None if self.logprobs is None else list(self.logprobs))

    def add(self, delta: "CompletionOutput") -> None:
        """Append what a later DELTA output of this sample holds."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_output_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None = None  # when the request first left the waiting queue

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when the request failed inside a step (its completions' finish_reason is then "error"):
    # the exception's type and message. The engine logs the traceback and serves the other requests.
    error: str | None = None

    def add(self, delta: "RequestOutput") -> None:
        """Fold a later DELTA output of this request into this one (which then holds both)."""
        samples = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            if c.index in samples:
                samples[c.index].add(c)
            else:
                self.outputs.append(c.copy())
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.metrics, self.error = delta.finished, delta.metrics, delta.error
