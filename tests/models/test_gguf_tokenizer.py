"""The tokenizer built from GGUF metadata encodes, decodes and templates exactly as transformers'
own GGUF conversion does (which needs torch; ours must not)."""

import gguf
import pytest
from transformers import AutoTokenizer

from models import gguf_reader
from models.gguf_tokenizer import from_metadata
from models.loader import resolve

TEXTS = (
    "Explain PagedAttention in one paragraph",
    "",
    " leading space, and trailing  ",
    "whitespace runs:    four, \t\ttabs,\n\n\nthree newlines, \r\n crlf",
    "naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, emoji 🚀🔥👍🏽, combining é",
    "\u200b zero-width \u00a0no-break \ufeff bom",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 0x1F\n",
    "numbers 1234567890 3.14159 1e-9 -42 1,000,000",
    "contractions: I'm, can't, we'll, they've, she'd, IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "specials glued<|im_end|>to text and <repo_name>x<file_sep>y",
    "almost special: <|im_start| <im_end|> <|endoftext",
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And  3 + 3 ?\n"},
]


def _pair(path):
    ours = from_metadata(gguf_reader.metadata(gguf.GGUFReader(path)), source=str(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


def _assert_same(ours, theirs, texts):
    for text in texts:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_tokens"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.get_vocab() == theirs.get_vocab()


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    return _pair(resolve("smollm2-135m"))


def test_smollm2_encodes_and_decodes_as_transformers(smollm2_tokenizers):
    _assert_same(*smollm2_tokenizers, TEXTS)


def test_smollm2_decodes_every_token_as_transformers(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    ids = list(range(len(theirs)))
    # Byte fragments decode to replacement characters the same way on both sides.
    assert ours.batch_decode([[i] for i in ids]) == theirs.batch_decode([[i] for i in ids])


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_as_transformers(smollm2_tokenizers, generation_prompt):
    ours, theirs = smollm2_tokenizers
    for conversation in (CONVERSATION, CONVERSATION[1:2]):  # with and without a system message
        kwargs = dict(add_generation_prompt=generation_prompt)
        text = theirs.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert ours.apply_chat_template(conversation, tokenize=False, **kwargs) == text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)


def _byte_level_gguf(path, *, pre: str, add_bos: bool):
    """A GGUF holding only a small byte-level BPE tokenizer: the 256 byte symbols, a few merges,
    control tokens, a user-defined one, and one stored as raw text.

    Its EOS is GPT-2's <|endoftext|>: transformers' conversion adds that token past the end of any
    vocabulary that lacks it (a token id the model has no row for); ours keeps the file's vocabulary.
    """
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in (*range(161, 173), *range(174, 256))]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]  # the shifted stand-ins (Ġ is space)
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "i n", "Ġ in"]
    tokens = ["<s>", "<|endoftext|>", "<think>", *alphabet, *(m.replace(" ", "") for m in merges), " raw text"]
    types = [3, 3, 4] + [1] * (len(tokens) - 3)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}<|endoftext|>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre,add_bos", [("llama-bpe", True), ("qwen2", False), ("some-other-pre", False)])
def test_small_byte_level_gguf_as_transformers(tmp_path, pre, add_bos):
    ours, theirs = _pair(_byte_level_gguf(tmp_path / "tok.gguf", pre=pre, add_bos=add_bos))
    _assert_same(ours, theirs, ("the 12345 in the inn", "<think>the</think> <s>x<|endoftext|>", "  the\n\n12 1234", "é ∑"))
    assert ours.encode("the")[:1] == ([0] if add_bos else ours.encode("the", add_special_tokens=False)[:1])


def test_other_tokenizer_models_are_refused():
    with pytest.raises(ValueError, match=r"m\.gguf: tokenizer model 'llama' is not supported from GGUF metadata"):
        from_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>"]}, source="m.gguf")
