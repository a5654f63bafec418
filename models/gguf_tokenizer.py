"""A GGUF file's tokenizer, built from its own metadata with the `tokenizers` library.

transformers can convert a GGUF's tokenizer too, but its GGUF integration imports torch, which is
not a runtime dependency. The metadata holds everything a byte-level BPE tokenizer needs (llama.cpp's
"gpt2" tokenizer model, used by SmolLM2, Llama 3, Qwen2 and Qwen3): the vocabulary, the merges, each
token's type, the special token ids and the chat template. Gemma's files hold a sentencepiece
vocabulary instead (tokenizer model "llama"), without merges: they are rebuilt from the vocabulary's
order. The pieces below are the ones transformers' conversion puts together, so the two encode and
decode alike (tests/models/test_gguf_tokenizer.py).
"""

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# How text is split before BPE, by tokenizer.ggml.pre, where it differs from GPT-2's split (the
# ByteLevel pre-tokenizer's own regex, used for every other name, as transformers does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the
    others are shifted past 255, so that every token is a string of visible characters."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in kept else chr(next(shifted)) for b in range(256)}


def _backend(meta: Mapping[str, Any], source: str) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError(f"{source}: the GGUF's byte-level BPE tokenizer lists no merges")
    spelling = _byte_spelling()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # Some files store a token as raw text; BPE's vocabulary is in the byte alphabet.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): i for i, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False, dropout=None))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tokenizer.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) are matched whole and skipped by
    # decode(skip_special_tokens=True); user-defined ones (<think>) are matched whole and kept. A
    # "control" token outside the byte alphabet is a mislabel by llama.cpp's converter: left out,
    # as transformers does.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab])
    return tokenizer


# Architectures whose "llama" (sentencepiece) vocabulary is Gemma's: BPE with byte fallback, spaces as ▁.
_GEMMA_SENTENCEPIECE = ("gemma3",)


def _gemma_backend(meta: Mapping[str, Any]) -> Tokenizer:
    """Gemma's sentencepiece BPE, as transformers' GemmaTokenizer builds it from a GGUF file.

    Two things the file leaves to the reader, as transformers' gemma_tokenizer does: a token of
    whitespace with a space in it is stored with real spaces where the vocabulary means ▁, and the
    merges are rebuilt from the vocabulary, best first in the file's order (Gemma's scores do not
    follow its merge order)."""
    # transformers' own merge reconstruction, which its GGUF conversion uses; this module does not
    # import torch.
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in meta["tokenizer.ggml.tokens"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = generate_merges(vocab, {token: -i for i, token in enumerate(tokens)})
    unk = tokens[meta.get("tokenizer.ggml.unknown_token_id", 3)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, dropout=None,
                                     byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                          for t, kind in zip(meta["tokenizer.ggml.tokens"], types) if kind == _USER_DEFINED and t in vocab])
    return tokenizer


def _post_processor(bos: str | None, eos: str | None, meta: Mapping[str, Any], vocab: Mapping[str, int]):
    """BOS/EOS around each encoded text as the file's add_bos_token/add_eos_token flags say."""
    first = [bos] if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False) else []
    last = [eos] if eos is not None and meta.get("tokenizer.ggml.add_eos_token", False) else []
    single = [f"{t}:0" for t in first] + ["$A:0"] + [f"{t}:0" for t in last]
    pair = single + [f"{t}:1" for t in first] + ["$B:1"] + [f"{t}:1" for t in last]
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=[(t, vocab[t]) for t in dict.fromkeys(first + last)])


def from_metadata(meta: Mapping[str, Any], *, source: str):
    """A transformers fast tokenizer from GGUF metadata (gguf_reader.metadata), with the file's
    special tokens and chat template.

    Raises ValueError, naming `source`, for a tokenizer model other than byte-level BPE ("gpt2") and
    Gemma's sentencepiece ("llama" in a gemma3 file).
    """
    # Imported here: transformers' tokenizer module takes a second to import, and only this needs it.
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama" and meta.get("general.architecture") in _GEMMA_SENTENCEPIECE:
        backend = _gemma_backend(meta)
    elif kind == "gpt2":
        backend = _backend(meta, source)
    else:
        raise ValueError(
            f"{source}: tokenizer model {kind!r} is not supported from GGUF metadata; only byte-level BPE "
            "('gpt2': SmolLM2, Llama 3, Qwen2, Qwen3) and Gemma 3's sentencepiece. Use the model's Hugging Face "
            "folder, whose tokenizer.json works."
        )
    tokens = meta["tokenizer.ggml.tokens"]
    special = {name: tokens[meta[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in meta else None
               for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                 ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    backend.post_processor = _post_processor(special["bos_token"], special["eos_token"], meta, backend.get_vocab())
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=meta.get("tokenizer.chat_template"),
                                   **{name: token for name, token in special.items() if token is not None})
