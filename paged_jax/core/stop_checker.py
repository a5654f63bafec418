"""When a sample stops, as vLLM decides it: a stop token id, EOS (unless ignore_eos), a stop string
(found by its OutputText), all held off until min_tokens; a constraint whose grammar admits nothing
more; then max_tokens or the context's end."""

from paged_jax.core.output_text import OutputText
from paged_jax.core.sequence import Sequence


def check_stop(seq: Sequence, token: int, text: OutputText, eos_token_ids: frozenset[int],
               max_model_len: int) -> tuple[str, int | str | None] | None:
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
