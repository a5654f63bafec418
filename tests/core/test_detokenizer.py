"""The incremental detokenizer against the tokenizer's own full decode, on random ids added one or a few
at a time: SmolLM2's real
byte-level BPE (characters split over tokens, invalid bytes, control tokens that
skip_special_tokens drops) and a tiny SentencePiece-style tokenizer with byte fallback (a leading
space stripped at the start, "<0xE2>" tokens whose group decodes only whole)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from models.loader import load_tokenizer
from paged_jax.core.detokenizer import IncrementalDetokenizer

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("smollm2-135m")


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2's decoding pipeline over a vocabulary of its kinds of token."""
    pieces = ["▁", "▁a", "b", "▁hello", "é", "東京", "▁▁", "."]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab |= {piece: len(vocab) + i for i, piece in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TINY = byte_fallback_tokenizer()


def check_every_prefix(tokenizer, ids: list[int], sizes: list[int]) -> None:
    """Add ids in runs of the given sizes (cycled; a multi-step dispatch's tokens come several at a
    time), checking the text after each."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    confirmed, k = "", 0
    while k < len(ids):
        run = ids[k : k + sizes[k % len(sizes)]]
        confirmed += detokenizer.extend(run) if len(run) > 1 else detokenizer.add(run[0])
        k += len(run)
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert confirmed + detokenizer.pending == detokenizer.text == full, (ids[:k], confirmed, detokenizer.pending)
        assert detokenizer.num_confirmed_chars == len(confirmed) and not confirmed.endswith("\ufffd")


RUNS = st.lists(st.integers(1, 1), min_size=1, max_size=1) | st.lists(st.integers(1, 6), min_size=1, max_size=8)


def smollm2_ids(tokenizer):
    """Any id, weighted towards the ones that split characters and the ones decoding skips."""
    vocab = len(tokenizer)
    split = tokenizer.encode("é東京🙂👩‍👩‍👧 naïve \ufffd", add_special_tokens=False)
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    return st.lists(st.integers(0, vocab - 1) | st.sampled_from(split) | st.sampled_from(special) | st.integers(0, 300),
                    max_size=40)


def test_smollm2_matches_the_full_decode(smollm2_tokenizer):
    @SETTINGS
    @given(smollm2_ids(smollm2_tokenizer), RUNS)
    def run(ids, sizes):
        check_every_prefix(smollm2_tokenizer, ids, sizes)

    run()


@SETTINGS
@given(st.lists(st.integers(0, len(TINY) - 1) | st.sampled_from(TINY.encode("é東 🙂", add_special_tokens=False)),
                max_size=40), RUNS)
def test_byte_fallback_matches_the_full_decode(ids, sizes):
    check_every_prefix(TINY, ids, sizes)


def test_held_text_is_confirmed_once_whole(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("a🙂b", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer)
    pieces = [detokenizer.add(t) for t in ids]
    assert "".join(pieces) == "a🙂b" and "🙂" in pieces and "\ufffd" not in "".join(pieces)
    assert len(ids) > 3  # the emoji really came in several tokens


def test_a_model_without_a_tokenizer_has_no_text():
    detokenizer = IncrementalDetokenizer(None)
    assert detokenizer.add(5) == "" and detokenizer.text == ""
