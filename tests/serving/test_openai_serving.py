"""What a stream may send of a sample's text while it grows: never a character that may still change
(a U+FFFD standing for bytes still to come) nor the start of a stop string that may be cut away."""

import pytest

from paged_jax.serving.openai_serving import sendable


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
