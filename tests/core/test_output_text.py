"""A sample's output text: what may be handed out while it grows (never a character that may still
change, a U+FFFD standing for bytes still to come, nor the start of a stop string that may be cut
away), where a stop string cuts it, and that the pieces handed out add up to the whole text."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.loader import load_tokenizer
from paged_jax.core.output_text import OutputText, sendable


@pytest.mark.parametrize("text, sent, finished, stop, expected", [
    ("Hello", 0, False, (), 5),
    ("Hello \ufffd", 0, False, (), 6),  # the emoji's bytes are still coming
    ("Hello \ufffd\ufffd", 0, False, (), 6),
    ("Hello \ufffd", 0, True, (), 7),  # finished: it is what it is
    ("a\ufffdb", 0, False, (), 3),  # a replacement character in the middle stays
    ("Hello wor", 0, False, ("world",), 6),  # "wor" may become "world", which is cut
    ("Hello w", 0, False, ("xyz", "wx"), 6),
    ("Hello wo", 0, False, ("wx",), 8),  # "wo" cannot begin "wx"
    ("Hello", 3, False, ("lo!",), 3),  # holds back "lo", never goes back on what was sent
    ("Hello wor", 0, True, ("world",), 9),
    ("abc", 5, False, (), 5),  # the text got shorter than what was sent: send nothing more
])
def test_sendable(text, sent, finished, stop, expected):
    assert sendable(text, sent, finished, stop) == expected


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def test_the_pieces_add_up_to_the_text_cut_at_the_first_stop_string(tokenizer):
    @settings(max_examples=100, deadline=None, derandomize=True)
    @given(st.text(alphabet="ab é🙂\n", max_size=30),
           st.lists(st.text(alphabet="ab é", min_size=1, max_size=3), max_size=2))
    def check(text, stop):
        pieces, found, cut = run(tokenizer, text, stop)
        whole = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False))
        hits = [(whole.find(s), s) for s in stop if s in whole]
        assert "".join(pieces) == cut
        if found is None:
            assert cut == whole and not hits
        else:
            assert cut == whole[: whole.find(found)] and (whole.find(found), found) == min(hits)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])

    check()


def run(tokenizer, text: str, stop, *, search_from: int = 0, incremental: bool = True):
    """Feed text's tokens one by one, searching for stop strings from the search_from'th token on (as
    min_tokens does); the pieces take handed out, the stop string found and the final text."""
    output = OutputText(tokenizer, stop, incremental=incremental)
    pieces, found = [], None
    for k, token in enumerate(tokenizer.encode(text, add_special_tokens=False), 1):
        output.add((token,))
        found = output.find_stop() if stop and k > search_from else None
        if incremental:
            pieces.append(output.take(found is not None))
        if found:
            break
    if not found and incremental:
        pieces.append(output.take(True))
    return pieces, found, output.text


def test_a_stop_string_cuts_the_text_and_is_never_handed_out(tokenizer):
    pieces, found, text = run(tokenizer, "The capital of France is Paris. It is big.", ["Paris", "big"])
    assert found == "Paris" and text == "The capital of France is " == "".join(pieces)
    # "Par" could have begun "Paris": held back, so nothing handed out is ever taken back.
    assert not any("P" in p for p in pieces)


def test_a_stop_string_before_min_tokens_counts_once_the_search_starts(tokenizer):
    # The engine's rule since before it decoded incrementally: the first occurrence anywhere.
    for incremental in (False, True):
        pieces, found, text = run(tokenizer, "one two three four five six", ["two"], search_from=4,
                                  incremental=incremental)
        assert found == "two" and text == "one "
        # Streamed, nothing the search had not read went out: "two" was never handed out.
        assert not incremental or "".join(pieces) == "one "


def test_a_whole_text_decoded_once_at_the_end_is_the_text_decoded_token_by_token(tokenizer):
    # A whole-text sample without stop strings keeps its ids and decodes them when read; any ids
    # (special tokens, bytes that make no character) give the text the incremental decode gives.
    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.lists(st.integers(0, len(tokenizer) - 1), max_size=24))
    def check(ids):
        whole, streamed = (OutputText(tokenizer, (), incremental=incremental) for incremental in (False, True))
        for token in ids:
            whole.add((token,))
            streamed.add((token,))
        assert whole.text == streamed.text == "".join([streamed.take(False), streamed.take(True)])

    check()
    assert OutputText(None, (), incremental=False).text == ""
