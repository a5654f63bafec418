"""The traffic of bench_spec.py and compare_speculation.py: requests as (prompt ids, max_tokens).

(a) outputs that repeat their inputs, made from what Python itself ships (no hub):
- edit: a standard-library function (inspect.getsource) to be returned whole with one name changed;
- rewrite: a standard-library docstring to be written again with one word changed;
- quote: a long context (several modules' documentation) one paragraph of which is to be quoted;
(b) w1: W1's requests (../shared/workloads/w1.json), random prompts where nothing repeats.
Each is chat-templated for the model (w1 excepted: its prompts are token ids already).
"""

import ast
import inspect
import re

import bench_throughput
from paged_jax.core.llm import chat_prompt

KINDS = ("edit", "rewrite", "quote", "w1")
# Standard-library modules whose functions the edit workload rewrites: plain Python, a few dozen lines each.
EDIT_SOURCES = ("textwrap", "shlex", "fnmatch", "colorsys", "heapq", "bisect", "glob", "keyword", "posixpath",
                "genericpath", "base64", "difflib", "statistics")
# Modules whose docstrings (their own and their functions') the rewrite and quote workloads take.
DOC_SOURCES = ("json", "argparse", "heapq", "fnmatch", "subprocess", "textwrap", "shlex", "functools",
               "contextlib", "collections", "itertools", "string", "base64", "difflib", "statistics", "inspect",
               "shutil", "tarfile", "zipfile", "random", "os", "re", "pathlib", "locale")


def _ask(tokenizer, message: str) -> list[int]:
    return list(chat_prompt(tokenizer, [{"role": "user", "content": message}]))


def edit(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests: a stdlib function of 8 to 40 lines and a rename of its first argument within it."""
    out = []
    for name in EDIT_SOURCES:
        source = inspect.getsource(__import__(name))
        for node in ast.parse(source).body:
            if len(out) == n:
                return out
            if not isinstance(node, ast.FunctionDef) or not 8 <= node.end_lineno - node.lineno <= 40:
                continue
            code = ast.get_source_segment(source, node)
            args = [a.arg for a in node.args.args]
            old = args[0] if args else node.name
            message = (f"Rewrite this Python function with `{old}` renamed to `{old}_value`. Change nothing "
                       f"else and answer with the whole function only.\n\n```python\n{code}\n```")
            out.append((_ask(tokenizer, message), min(max_tokens, len(tokenizer.encode(code)) + 16)))
    return out


def _docs() -> list[str]:
    """Docstrings of 400 to 1500 characters: the DOC_SOURCES modules' and their public functions'."""
    out = []
    for name in DOC_SOURCES:
        module = __import__(name)
        objects = [module] + [getattr(module, a) for a in sorted(vars(module)) if not a.startswith("_")]
        for obj in objects:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isfunction(obj) else None
            if doc and 400 <= len(doc) <= 1500 and doc not in out:
                out.append(doc)
    return out


def rewrite(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests: a docstring to be written again with its most frequent long word in capitals."""
    out = []
    for doc in _docs()[:n]:
        words = re.findall(r"\b[a-z]{6,}\b", doc)
        word = max(sorted(set(words)), key=words.count)
        message = (f"Rewrite the text below exactly as it is, except that every `{word}` becomes "
                   f"`{word.upper()}`. Answer with the rewritten text only.\n\n{doc}")
        out.append((_ask(tokenizer, message), min(max_tokens, len(tokenizer.encode(doc)) + 8)))
    return out


def quote(tokenizer, n: int, max_tokens: int, context_tokens: int = 900) -> list[tuple[list[int], int]]:
    """n requests: about context_tokens of documentation, and one of its paragraphs to be quoted."""
    docs = _docs()
    out = []
    for i in range(n):
        parts, length = [], 0
        for doc in docs[i:] + docs[:i]:  # each request its own context, rotating through the docstrings
            if length + len(tokenizer.encode(doc)) > context_tokens and parts:
                break
            parts.append(doc)
            length += len(tokenizer.encode(doc))
        target = parts[len(parts) // 2]
        opening = " ".join(target.split("\n")[0].split(" ")[:6])  # as written: within its first line
        message = ("\n\n".join(parts) + f"\n\nQuote, word for word, the paragraph above that begins "
                   f"\"{opening}\", in full.")
        out.append((_ask(tokenizer, message), min(max_tokens, len(tokenizer.encode(target)) + 8)))
    return out


def w1(n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    workload = bench_throughput.load_workload(bench_throughput.DEFAULT_WORKLOAD)
    return [(r["prompt_token_ids"], min(max_tokens, r["max_new_tokens"])) for r in workload["requests"][:n]]


def make(kind: str, tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests of one KINDS workload, each at most max_tokens long."""
    if kind == "w1":
        return w1(n, max_tokens)
    return {"edit": edit, "rewrite": rewrite, "quote": quote}[kind](tokenizer, n, max_tokens)
