"""The traffic of bench_spec.py and compare_speculation.py: requests as (prompt ids, max_tokens).

(a) outputs that repeat their inputs, made from what Python itself ships (no hub):
- edit: a standard-library function (inspect.getsource) to be returned whole with one name changed;
- rewrite: a standard-library docstring to be copied with one word changed;
- quote: document QA over a long context to be quoted: a document of five docstrings (850 to 1,100
  tokens) and requests that each ask for one of its passages whole, the answer a quote of 90 to 290
  tokens; a document's requests come one after another and share it as their prompts' prefix;
(b) w1: W1's requests (../shared/workloads/w1.json), random prompts where nothing repeats.
Each is chat-templated for the model (w1 excepted: its prompts are token ids already).
"""

import ast
import inspect
import itertools
import re

import bench_throughput
from paged_jax.core.llm import chat_prompt

KINDS = ("edit", "rewrite", "quote", "w1")
# Each workload's cap on an output, unless the caller gives one: quote's answers are whole passages.
MAX_TOKENS = {"edit": 64, "rewrite": 64, "quote": 300, "w1": 64}
# Standard-library modules whose functions the edit workload rewrites: plain Python, a few dozen lines each.
EDIT_SOURCES = ("textwrap", "shlex", "fnmatch", "colorsys", "heapq", "bisect", "glob", "keyword", "posixpath",
                "genericpath", "base64", "difflib", "statistics")
# Modules whose docstrings (their own and their functions') the rewrite and quote workloads take.
DOC_SOURCES = ("json", "argparse", "heapq", "fnmatch", "subprocess", "textwrap", "shlex", "functools",
               "contextlib", "collections", "itertools", "string", "base64", "difflib", "statistics", "inspect",
               "shutil", "tarfile", "zipfile", "random", "os", "re", "pathlib", "locale")


def _ask(tokenizer, message: str, example: tuple[str, str] | None = None) -> list[int]:
    """The chat-templated prompt of a user's message, after one example exchange (question, answer) if given."""
    shot = [{"role": "user", "content": example[0]}, {"role": "assistant", "content": example[1]}] if example else []
    return list(chat_prompt(tokenizer, [*shot, {"role": "user", "content": message}]))


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


def _docs(max_chars: int = 1500) -> list[str]:
    """Docstrings of 400 to max_chars characters: the DOC_SOURCES modules' and their public functions'."""
    out = []
    for name in DOC_SOURCES:
        module = __import__(name)
        objects = [module] + [getattr(module, a) for a in sorted(vars(module)) if not a.startswith("_")]
        for obj in objects:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isfunction(obj) else None
            if doc and 400 <= len(doc) <= max_chars and doc not in out:
                out.append(doc)
    return out


def _copy_with_capitals(doc: str) -> tuple[str, str]:
    """(the request to copy doc with its most frequent long word in capitals, the copy asked for)."""
    words = re.findall(r"\b[a-z]{6,}\b", doc)
    word = max(sorted(set(words)), key=words.count)
    message = (f"Copy the text between the ``` lines exactly, except that every `{word}` becomes "
               f"`{word.upper()}`. Answer with the copied text in ``` lines.\n\n```\n{doc}\n```")
    return message, "```\n" + re.sub(rf"\b{word}\b", word.upper(), doc) + "\n```"


def _quote(passages: list[str], target: str) -> tuple[str, str]:
    """(the request to copy, of the passages each in ``` lines, the one that is target, the copy)."""
    words = target.split("\n")[0].split(" ")  # as written: within its first line
    others = [p for p in passages if p != target]
    # Its first six words, or as many more as tell it from every other passage's beginning.
    opening = next((" ".join(words[:n]) for n in range(6, len(words) + 1)
                    if not any(p.startswith(" ".join(words[:n])) for p in others)), " ".join(words))
    context = "\n\n".join(f"```\n{p}\n```" for p in passages)
    return (f"{context}\n\nCopy the ``` block above that begins \"{opening}\" exactly. Answer with it in "
            "``` lines."), f"```\n{target}\n```"


# SmolLM2-135M asked plainly writes about a text instead of returning it: under the first prompts
# (the text after the request, unfenced; no example), a quarter of its output tokens for rewrite and
# a twentieth for quote lay in runs of 8 tokens that the text holds (spec_replay.py --show). Fenced in
# ``` lines, after one worked exchange of the same kind (on docstrings kept out of the requests), and
# short (at most 900 characters), the texts come back: 78% for rewrite and 69% for quote (8 requests each).
# The worked exchanges take the shortest docstrings (a shared prefix, but prefilled all the same):
# three, never a request's text.
TEXTS_MAX_CHARS = 900


def _texts() -> tuple[list[str], list[str]]:
    """(the docstrings of at most TEXTS_MAX_CHARS for requests, the three shortest for the examples)."""
    docs = _docs(TEXTS_MAX_CHARS)
    shown = sorted(docs, key=len)[:3]
    return [d for d in docs if d not in shown], shown


def rewrite(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests: a docstring to be copied with its most frequent long word in capitals."""
    docs, shown = _texts()
    example = _copy_with_capitals(shown[0])
    return [(_ask(tokenizer, _copy_with_capitals(doc)[0], example), min(max_tokens, len(tokenizer.encode(doc)) + 8))
            for doc in docs[:n]]


# Quote is document QA: a long document (QUOTE_PASSAGES docstrings of at most TEXTS_MAX_CHARS, each in ```
# lines, 850 to 1,100 tokens; prompts of 1,150 to 1,420 with the worked exchange) and a request to copy
# one of its passages whole, the document's next requests asking for its other passages. The answer is the
# long quote itself, 90 to 290 tokens (max_tokens: its length and 8 more, at most MAX_TOKENS):
# under the first design (each request its own context, capped at 64 output tokens) the prefill, which
# speculation does not shorten, was most of a request's time, and an answer of 64 tokens quotes a
# sentence, not a passage. Requests on one document share it as their prompts' prefix, as questions on one
# document do, so the prefix cache holds it for the next ones: every engine gets the same traffic and the
# same cache (blocks are named when scheduled, so a request admitted beside another shares its prefill
# too). On 10 requests (`spec_replay.py --workloads quote --requests 10 --max-tokens 256 --show 10`) the
# greedy outputs overlap their prompt by 74%, 7 of 10 by 89 to 96% (a passage of the document copied, the
# one asked for or a neighbour); longer passages (up to 1,500 characters, 350 tokens) drifted off after a
# sentence or two (32%).
QUOTE_PASSAGES = 5


def quote(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests: documents of QUOTE_PASSAGES docstrings, each passage of one document quoted in turn
    (the document's requests one after another), documents going through the docstrings in order,
    then again in a new grouping (rotated by one passage) when n asks for more."""
    passages, shown = _texts()
    example = _quote(shown, shown[1])
    out = []
    for d in itertools.count():
        first = d * QUOTE_PASSAGES + d * QUOTE_PASSAGES // len(passages)  # a pass done: shifted by one
        document = [passages[(first + j) % len(passages)] for j in range(QUOTE_PASSAGES)]
        for target in document:
            if len(out) == n:
                return out
            out.append((_ask(tokenizer, _quote(document, target)[0], example),
                        min(max_tokens, len(tokenizer.encode(target)) + 8)))


def w1(n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    workload = bench_throughput.load_workload(bench_throughput.DEFAULT_WORKLOAD)
    return [(r["prompt_token_ids"], min(max_tokens, r["max_new_tokens"])) for r in workload["requests"][:n]]


def make(kind: str, tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """n requests of one KINDS workload, each at most max_tokens long."""
    if kind == "w1":
        return w1(n, max_tokens)
    return {"edit": edit, "rewrite": rewrite, "quote": quote}[kind](tokenizer, n, max_tokens)
