"""scripts/eval_precision.py on a tiny random model that speaks SmolLM2's vocabulary: perplexity of the
Python documentation text under float32 and a bfloat16 KV cache, and greedy agreement between them."""

import hashlib
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import eval_precision  # noqa: E402


def test_perplexity_and_greedy_agreement_of_each_precision(tiny_chat_folder, tmp_path):
    out = tmp_path / "precision.json"
    figures = eval_precision.main(["--model", str(tiny_chat_folder), "--max-text-tokens", "300", "--context", "128",
                                   "--chunk", "64", "--steps", "8", "--num-prompts", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == figures
    text = eval_precision.reference_text()
    assert figures["text"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()[:16] and len(text) > 100_000
    assert figures["text"]["tokens"] == 300 and figures["machine"]["cores"] >= 1
    full, half = figures["rows"]["float32"], figures["rows"]["kv-bf16"]
    assert (full["kv_cache_dtype"], half["kv_cache_dtype"]) == ("float32", "bfloat16")
    assert full["tokens_scored"] == half["tokens_scored"] == 300 - 3
    assert math.isfinite(full["perplexity"]) and full["perplexity"] > 1
    assert abs(half["perplexity_change_pct"]) < 2
    greedy = half["greedy"]
    assert greedy["of"] == 2 and len(greedy["matching_prefix"]) == 2
    assert len(greedy["logprob_gap_where_parted"]) == 2 - greedy["identical"]
