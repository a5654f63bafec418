"""Incremental detokenization: the text of a growing list of token ids at O(1) work per id.

Decoding the whole output again every step costs O(n) a token, O(n^2) a sequence. Here each new id
is decoded within a short window of the ids before it (vLLM's prefix_offset / read_offset, as the
`tokenizers` library's DecodeStream does): the window starts a few ids back, so that a decoder that
looks at neighbours (a leading space stripped at the start, bytes that make one character together)
sees the context it would see in a full decode, and the new text is what the window's decode adds
to the decode of its first part.

Text that may still change is held as `pending`, not confirmed: a trailing U+FFFD (a character
whose bytes are still coming) and a byte-fallback token ("<0xE2>"), whose group of bytes decodes
differently when more bytes follow. The confirmed text plus the pending text always equals
`tokenizer.decode(ids, skip_special_tokens=True)` (tests/core/test_detokenizer.py checks this on
random ids); a run of ids that never completes a character keeps the window growing until one does.
"""

import re

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDetokenizer:
    """The text of one sequence's output ids, an id (or a few) at a time.

    tokenizer: a transformers tokenizer, or None for a model without one (whose text is always "").
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._window: list[int] = []  # the ids from the window's start (vLLM's prefix_offset) on
        self._read = 0  # window[:read] is context, decoded to prefix_text; what follows is new
        self._prefix_text = ""
        self._pieces: list[str] = []  # the confirmed text, joined only when the whole is asked for
        self.num_confirmed_chars = 0
        self.pending = ""  # text of the ids after the confirmed ones; it may still change

    def add(self, token_id: int) -> str:
        """Decode one more id; returns the text it confirms ("" while held)."""
        return self.extend((token_id,))

    def extend(self, token_ids) -> str:
        """Decode several more ids (a non-empty sequence of ints) in one call: the same text as adding
        them one by one (the window's decode is the whole decode's suffix either way); returns the
        text they confirm."""
        if self.tokenizer is None:
            return ""
        self._window.extend(token_ids)
        new = self._decode(self._window)[len(self._prefix_text):]
        if new and not new.endswith("\ufffd") and not self._is_byte(token_ids[-1]):
            self._pieces.append(new)
            self.num_confirmed_chars += len(new)
            self._window = self._window[self._read:]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)
            self.pending = ""
            return new
        if not new and self._read:
            # They add no text after the context (special tokens that decoding skips): forget them,
            # or a run of them would widen the window without end.
            del self._window[-len(token_ids):]
        self.pending = new
        return ""

    @property
    def confirmed_text(self) -> str:
        """All confirmed text (O(n): for whole-text outputs, not for every step)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def text(self) -> str:
        """The decode of every id so far, pending text included."""
        return self.confirmed_text + self.pending

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    def _is_byte(self, token_id: int) -> bool:
        # A byte-fallback decoder turns a run of byte tokens into one string only if all its bytes
        # make valid UTF-8 (and into one U+FFFD a byte otherwise): the run is held until it ends.
        return _BYTE_TOKEN.fullmatch(self.tokenizer.convert_ids_to_tokens(token_id) or "") is not None


def decode(tokenizer, ids) -> str:
    """The text of ids (a sequence of ints) as outputs carry it, special tokens skipped; "" without a
    tokenizer (a model loaded without tokenizer files speaks token ids only)."""
    if tokenizer is None:
        return ""
    # A fast tokenizer that cleans up no spaces decodes exactly as its Rust backend does, without the
    # Python around it: 4 us a call against 10, and this runs twice a token.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode(list(ids), skip_special_tokens=True)
    return tokenizer.decode(list(ids), skip_special_tokens=True)
