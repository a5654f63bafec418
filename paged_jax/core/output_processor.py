"""A step's samples into the engine's records of requests (append_tokens), and RequestOutputs from
those records, as each request's output_kind asks.

A DELTA output costs what is new since the previous one; a FINAL_ONLY request costs nothing until it
finishes, then its whole text once; a CUMULATIVE output copies everything so far, as it must. Beam
search outputs are decoded whole: its beams are reordered and replaced as the search goes.
"""

from paged_jax.core import beam_search
from paged_jax.core.detokenizer import decode
from paged_jax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.core.request import Request
from paged_jax.core.sampling_params import RequestOutputKind
from paged_jax.core.sequence import Sequence
from paged_jax.core.stop_checker import Reason, StopRules

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def request_output(request: Request, now: float) -> RequestOutput | None:
    """The output of a request that a step advanced; None while a FINAL_ONLY request runs."""
    finished = request.finished
    if request.params.output_kind is FINAL_ONLY and not finished:
        return None
    if request.params.use_beam_search:
        return _beam_output(request, finished, now)
    completions = [c for seq in sorted(request.seqs, key=lambda s: s.index)
                   if (c := _completion(request, seq)) is not None]
    last = [s.finish_time for s in request.seqs if s.finish_time is not None]
    metrics = _metrics(request, max(last) if finished and last else None,
                       max(s.num_output_tokens for s in request.seqs))
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished, metrics)


def append_tokens(request: Request, seq: Sequence, sampled, row: int, count: int, now: float,
                  stops: StopRules) -> Reason | None:
    """Take seq's next `count` tokens, step j's at sampled.*[j, row] (a numpy SamplerOutput with a
    leading axis of steps): their ids, logprobs and text, up to the first that ends it, for which it
    returns (finish_reason, stop_reason); the tokens after that one are dropped.

    Tokens taken together are decoded in one call, unless a stop string or a grammar needs each
    token's text or state: they are then taken, and checked, one at a time."""
    tokens = sampled.tokens[:count, row].tolist()
    text = request.sample(seq).text
    if seq.first_token_time is None:
        seq.first_token_time = now
    if stops.needs_each_token(seq):
        for step, token in enumerate(tokens):
            _take(seq, tokens[step : step + 1], sampled, step, row)
            text.add((token,))
            if (reason := stops.check(seq, token, text)) is not None:
                return reason
        return None
    found = stops.first(seq, tokens)
    kept = tokens if found is None else tokens[: found[0] + 1]
    _take(seq, kept, sampled, 0, row)
    text.add(kept)
    return None if found is None else found[1]


def _take(seq: Sequence, tokens: list[int], sampled, step: int, row: int) -> None:
    """Append tokens, those of steps step, step + 1, ..., and their logprobs if seq asks for them."""
    seq.token_ids.extend(tokens)
    if seq.params.logprobs is not None:
        for i, token in enumerate(tokens, step):
            _append_logprobs(seq, token, sampled, i, row)


def _append_logprobs(seq: Sequence, token: int, sampled, step: int, row: int) -> None:
    logprob = float(sampled.logprobs[step, row])
    entry = {token: logprob}
    top = seq.params.logprobs
    for tid, lp in zip(sampled.top_ids[step, row, :top].tolist(), sampled.top_logprobs[step, row, :top].tolist()):
        entry.setdefault(tid, lp)
    seq.logprobs.append(entry)
    # Only then does the sampler compute logprobs (sampling.py); vLLM's rule too.
    seq.cumulative_logprob += logprob


def failed_output(request: Request, error: Exception, now: float) -> RequestOutput:
    """The last output of a request that a failed step ended: every sample says "error", with no text
    (decoding may be what failed)."""
    completions = []
    for seq in sorted(request.seqs, key=lambda s: s.index):
        sent = request.sample(seq).num_tokens_sent if request.params.output_kind is DELTA else 0
        completions.append(CompletionOutput(seq.index, "", seq.token_ids[seq.num_prompt_tokens + sent:],
                                            _cumulative_logprob(seq), None, "error"))
    metrics = _metrics(request, now, max((s.num_output_tokens for s in request.seqs), default=0))
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True, metrics,
                         error=f"{type(error).__name__}: {error}")


def _completion(request: Request, seq: Sequence) -> CompletionOutput | None:
    """A sample's part of its request's output; None in a DELTA output when it has nothing new."""
    sample = request.sample(seq)
    finished = seq.finish_reason is not None
    start = sample.num_tokens_sent if request.params.output_kind is DELTA else 0
    token_ids = seq.token_ids[seq.num_prompt_tokens + start:]
    if request.params.output_kind is DELTA:
        if not token_ids and (sample.finish_sent or not finished):
            return None
        text = sample.text.take(finished)
    elif finished:
        text = sample.text.text
    else:
        sample.text.take(False)
        text = sample.text.text_sent
    sample.num_tokens_sent, sample.finish_sent = seq.num_output_tokens, finished
    logprobs = seq.logprobs[start:] if seq.params.logprobs is not None else None
    return CompletionOutput(seq.index, text, token_ids, _cumulative_logprob(seq), logprobs, seq.finish_reason,
                            seq.stop_reason)


def _beam_output(request: Request, finished: bool, now: float) -> RequestOutput:
    """The live beams while the search runs; the best n hypotheses once it is over."""
    if finished:
        ranked = beam_search.best(request.hypotheses, request.params.n, request.params.length_penalty)
        completions = [CompletionOutput(i, decode(request.tokenizer, h.token_ids), list(h.token_ids),
                                        h.cumulative_logprob, None, h.finish_reason, h.stop_reason)
                       for i, h in enumerate(ranked)]
    else:
        completions = [CompletionOutput(b.index, decode(request.tokenizer, b.output_token_ids), b.output_token_ids,
                                        b.cumulative_logprob, None, None) for b in request.seqs]
    metrics = _metrics(request, now if finished else None, max((len(c.token_ids) for c in completions), default=0))
    return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished, metrics)


def _metrics(request: Request, finish_time: float | None, num_output_tokens: int) -> RequestMetrics:
    first = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
    return RequestMetrics(
        arrival_time=request.arrival_time,
        first_token_time=min(first) if first else None,
        finish_time=finish_time,
        num_output_tokens=num_output_tokens,
        num_prefix_hit_tokens=request.seqs[0].num_prefix_hit_tokens if request.seqs else 0,
        num_preemptions=sum(s.num_preemptions for s in request.seqs),
        first_scheduled_time=request.first_scheduled_time)


def _cumulative_logprob(seq) -> float | None:
    # The sampler computes logprobs only for requests that ask for them (sampling.py), as vLLM does.
    return seq.cumulative_logprob if seq.params.logprobs is not None else None
