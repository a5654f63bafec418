"""When a sample stops, as vLLM decides it: a stop token id, EOS (unless ignore_eos), a stop string
(found by its OutputText), all held off until min_tokens; a constraint whose grammar admits nothing
more; then max_tokens or the context's end."""

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Ids

from paged_jax.core.output_text import OutputText
from paged_jax.core.sequence import Sequence

Reason = tuple[str, int | str | None]  # (finish_reason, stop_reason)


def check_stop(seq: Sequence, token: int, text: OutputText, eos_token_ids: frozenset[int],
               max_model_len: int) -> Reason | None:
    """(finish_reason, stop_reason) once seq, which just took `token` (text holds it too), is done."""
    params = seq.params
    if seq.num_output_tokens >= params.min_tokens:
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in eos_token_ids:
            return "stop", None
        stop = text.find_stop() if params.stop else None
        if stop is not None:
            return "stop", stop
    if seq.guide is not None and seq.guide.finished:
        return "stop", None
    if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length", None
    return None


@dataclasses.dataclass(frozen=True)
class StopRules:
    """An engine's stop rules: its model's EOS ids, its context length, and its constraints' refusal
    of a token (structured_output.GrammarGate.refusal)."""

    eos_token_ids: frozenset[int]
    max_model_len: int
    refusal: Callable[[Sequence, int], Reason | None]

    def needs_each_token(self, seq: Sequence) -> bool:
        """Whether seq's stop depends on more than its ids (a stop string's text, a grammar's state),
        so that its tokens are taken, and checked, one at a time."""
        return bool(seq.params.stop) or seq.guide is not None

    def check(self, seq: Sequence, token: int, text: OutputText) -> Reason | None:
        """check_stop, for seq which just took `token`, after its constraint's refusal."""
        return self.refusal(seq, token) or check_stop(seq, token, text, self.eos_token_ids, self.max_model_len)

    def first(self, seq: Sequence, tokens: Ids[int]) -> tuple[int, Reason] | None:
        """For seq whose stop depends on its ids alone (not needs_each_token), and its next tokens (not
        taken yet): the index of the first that would end it, as check_stop would say after taking it,
        and why; None if none would."""
        params, taken, length = seq.params, seq.num_output_tokens, len(seq.token_ids)
        # The index of the token that reaches max_tokens or the context's end.
        at_length = max(0, min(params.max_tokens - taken, self.max_model_len - length) - 1)
        window = tokens[: at_length + 1]
        ids = set(window)
        # Most rows hold no stop id: one set operation says so, not a Python test a token.
        may_stop = (not ids.isdisjoint(params.stop_token_ids)
                    or not (params.ignore_eos or ids.isdisjoint(self.eos_token_ids)))
        for i, token in enumerate(window if may_stop else ()):
            if taken + i + 1 >= params.min_tokens:
                if token in params.stop_token_ids:
                    return i, ("stop", token)
                if not params.ignore_eos and token in self.eos_token_ids:
                    return i, ("stop", None)
        return (at_length, ("length", None)) if at_length < len(tokens) else None
