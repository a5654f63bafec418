"""Logprobs as OpenAI's two APIs spell them: completions' parallel lists, chat's entries with bytes."""

from paged_jax.serving.openai_protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

# JSON has no -inf: a logprob shown is at least this (vLLM's floor too).
_MIN_LOGPROB = -9999.0


class LogprobFormatter:
    """tokenizer: a transformers tokenizer, or None (tokens are then shown as "token_id:<id>", vLLM's
    spelling). A token's string is decoded once and kept."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._token_strs: dict[int, str] = {}

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                   offset: int) -> CompletionLogprobs:
        """token_ids and their logprobs entries (each {id: logprob}, the chosen id's and the top ones);
        offset: where the first token starts in the choice's text."""
        out = CompletionLogprobs()
        for token, entry in zip(token_ids, logprobs):
            text = self._token_str(token)
            out.tokens.append(text)
            out.token_logprobs.append(max(entry[token], _MIN_LOGPROB))
            out.top_logprobs.append(dict(self._top(entry, k)))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> ChatLogprobs:
        def top(token: str, logprob: float) -> TopLogprob:
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for token, entry in zip(token_ids, logprobs):
            chosen = top(self._token_str(token), max(entry[token], _MIN_LOGPROB))
            content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[top(*t) for t in self._top(entry, k)]))
        return ChatLogprobs(content=content)

    def _token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self._tokenizer is None else self._tokenizer.decode([token_id])
            self._token_strs[token_id] = text
        return text

    def _top(self, entry: dict[int, float], k: int) -> list[tuple[str, float]]:
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        return [(self._token_str(t), max(lp, _MIN_LOGPROB)) for t, lp in best]
