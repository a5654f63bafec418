"""A sample's output text as outputs carry it: decoded one token at a time (detokenizer.py), ended by
its first stop string, and handed out in pieces that never change afterwards. The one owner of stop
strings: the text is searched here, cut here, and held back here while a stop string may be forming.

Each step touches only the text that is new or may still change (the pending text, and the longest
stop string's length before it), so a token costs the same at the 4,000th as at the 100th.
"""

from collections.abc import Sequence

from paged_jax.core.detokenizer import IncrementalDetokenizer, decode


def find_stop(text: str, start: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """(position, string) of the stop string that occurs first in text[start:] (the lesser string
    where two start together), or None."""
    hits = [(i, s) for s in stop if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


def sendable(text: str, sent: int, finished: bool, stop: Sequence[str]) -> int:
    """How much of a text (the sample's whole text so far) may have been handed out now.

    All of it once finished. Before that, not a trailing U+FFFD (a character whose bytes are still
    coming, so it would change), nor a trailing piece that could begin a stop string (the text is cut
    before a stop string once it is whole, so that piece may vanish). Never less than `sent`.
    """
    if finished:
        return max(sent, len(text))
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


class OutputText:
    """One sample's text.

    tokenizer: a transformers tokenizer, or None (the text is then always ""). stop: the stop
    strings. incremental: whether the text is handed out as it grows (take); without, only whole.
    """

    def __init__(self, tokenizer, stop: Sequence[str], *, incremental: bool):
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        # A whole text with no stop string to search is read once, when the sample is finished: its
        # ids are kept and decoded then, in one call, instead of twice a token (the same text:
        # detokenizer.py's invariant). LLM.generate's default; 0.3 s of W1's 35 on the CPU.
        self._ids: list[int] | None = None if incremental or self._stop else []
        self._lookback = max(map(len, self._stop), default=1) - 1
        self._incremental = incremental
        # The confirmed text from character _base on: what a search or a take may still read.
        self._tail, self._base = "", 0
        self._search_from = 0  # no stop string starts before this character but the one found
        self._searched_to = 0  # the confirmed text the last search read ends here
        self._sent = 0  # characters handed out by take
        self._cut: int | None = None  # where the text ends, once a stop string was found

    def add(self, token_ids) -> None:
        """Take the sample's next ids (a non-empty sequence of ints), decoded together. A stop string
        ends the text at the first token completing it only if each token is added, and searched
        (find_stop), alone."""
        if self._ids is not None:
            self._ids.extend(token_ids)
            return
        self._tail += self._detokenizer.extend(token_ids)
        self._forget()

    def find_stop(self) -> str | None:
        """Search the text not searched yet; the stop string found first (the text now ends before
        it), or None. Text added between searches is searched by the next one: min_tokens can
        hold the search off, and a stop string it spans still counts once it is over."""
        found = find_stop(self._tail + self._detokenizer.pending, self._search_from - self._base, self._stop)
        if found is not None:
            self._cut = self._base + found[0]
            return found[1]
        self._searched_to = self._confirmed_end
        # A stop string starting before this would lie inside the confirmed text, just searched.
        self._search_from = max(self._search_from, self._confirmed_end - self._lookback)
        self._forget()
        return None

    def take(self, finished: bool) -> str:
        """The text to hand out now, after what take handed out before (sendable), and, while there
        are stop strings, none that no search has read: min_tokens holds the search off, and a stop
        string found later in that text cuts it."""
        if self._sent < self._base:  # a whole-text sample, handed out only now
            text, offset = self.text, 0
        else:
            text, offset = self._tail + self._detokenizer.pending, self._base
            if self._cut is not None:
                text = text[: self._cut - offset]
        upto = sendable(text, self._sent - offset, finished, self._stop) + offset
        if self._stop and not finished:
            upto = max(self._sent, min(upto, self._searched_to))
        piece = text[self._sent - offset: upto - offset]
        self._sent = upto
        self._forget()
        return piece

    @property
    def text_sent(self) -> str:
        """Everything take handed out (O(n): for outputs that hold the whole text)."""
        return self._detokenizer.text[: self._sent]

    @property
    def text(self) -> str:
        """The whole text, up to the stop string if one was found (O(n): for whole-text outputs)."""
        if self._ids is not None:
            return decode(self._detokenizer.tokenizer, self._ids)
        return self._detokenizer.text[: self._cut]

    @property
    def _confirmed_end(self) -> int:
        return self._base + len(self._tail)

    def _forget(self) -> None:
        """Drop the confirmed text that neither a search nor a take will read again."""
        keep = min(self._search_from if self._stop else self._confirmed_end, self._confirmed_end)
        if self._incremental:
            keep = min(keep, self._sent)
        if keep > self._base:
            self._tail = self._tail[keep - self._base:]
            self._base = keep
