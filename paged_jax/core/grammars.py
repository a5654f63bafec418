"""The llguidance grammar of a StructuredOutputsParams, and errors that say what was wrong and where.

llguidance reports a schema's fault by keyword ("Unimplemented keys: ["uniqueItems"]", "Unknown
format: x") without saying where in the schema it is; `explain` finds the first subschema it is about
and names its JSON pointer, e.g. /properties/tags/uniqueItems.
"""

import json
import re
from collections.abc import Iterator, Mapping

from llguidance import LLMatcher, grammar_from

from paged_jax.core.errors import RequestError
from paged_jax.core.sampling_params import StructuredOutputsParams

# JSON written as json.dumps writes it: small models given free whitespace tend to write newlines
# until max_tokens.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is a subschema, a list of them, or a map from names to them (JSON Schema 2020-12).
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class GrammarError(RequestError):
    """A constraint that cannot be compiled: a bad schema, regex or grammar, or one llguidance lacks."""

    def __init__(self, message: str):
        super().__init__(message, "structured_outputs")


def cache_key(so: StructuredOutputsParams) -> str:
    """One text per distinct constraint (a schema's key order does not matter)."""
    if so.json is not None:
        spec = ["json", json.dumps(_schema(so), sort_keys=True)]
    elif so.json_object:
        spec = ["json_object"]
    elif so.regex is not None:
        spec = ["regex", so.regex]
    elif so.choice is not None:
        spec = ["choice", *so.choice]
    else:
        spec = ["grammar", so.grammar]
    return json.dumps([*spec, so.whitespace_pattern])


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for the constraint (its validity is checked when a matcher is built)."""
    if so.json is not None or so.json_object:
        schema = {"type": "object"} if so.json_object else _schema(so)
        options = _COMPACT_JSON if so.whitespace_pattern is None else {"whitespace_pattern": so.whitespace_pattern}
        try:
            return LLMatcher.grammar_from_json_schema(dict(schema), defaults=options)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"structured_outputs.json is not a JSON schema: {e}") from None
    if so.regex is not None:
        return LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return grammar_from("choice", list(so.choice))
    try:
        return grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise GrammarError(f"structured_outputs.grammar is not a Lark or GBNF grammar: {e}") from None


def explain(so: StructuredOutputsParams, error: str) -> str:
    """A message for llguidance's `error` about the constraint so, naming the field and, for a schema,
    the JSON pointer of the keyword at fault where it can be found."""
    error = error.strip()
    if so.regex is not None:
        # The last line names the fault; the rest shows it inside the grammar the regex was put into.
        reason = re.findall(r"^error: (.*)$", error, re.MULTILINE)
        return f"structured_outputs.regex {so.regex!r} does not compile: {reason[-1] if reason else error}"
    if so.choice is not None:
        return f"structured_outputs.choice does not compile: {error}"
    if so.grammar is not None:
        return f"structured_outputs.grammar does not compile: {error}"
    pointer, keyword = _culprit({} if so.json_object else _schema(so), error)
    if pointer is None:
        return f"the JSON schema cannot be compiled: {error}"
    if error.startswith("Unimplemented keys"):
        return f"unsupported JSON schema keyword {keyword!r} at {pointer}"
    return f"invalid JSON schema keyword {keyword!r} at {pointer}: {error}"


def _schema(so: StructuredOutputsParams) -> Mapping:
    return json.loads(so.json) if isinstance(so.json, str) else so.json


def _culprit(schema: Mapping, error: str) -> tuple[str | None, str | None]:
    """(JSON pointer, keyword) of the first subschema that llguidance's error is about, or (None, None)."""
    if m := re.search(r"Unimplemented keys: (\[.*?\])", error):
        keys = json.loads(m[1])
        at = lambda node: next((k for k in keys if k in node), None)
    elif m := re.search(r"Unknown format: (.+)", error):
        at = lambda node: "format" if node.get("format") == m[1].strip() else None
    elif m := re.search(r"Invalid type: (.+)", error):
        at = lambda node: "type" if m[1].strip() in _as_list(node.get("type")) else None
    elif m := re.search(r"Pointer '(.*?)' does not exist", error):
        at = lambda node: "$ref" if isinstance(node.get("$ref"), str) and node["$ref"].endswith(m[1]) else None
    elif "regex parse error" in error:
        at = lambda node: "pattern" if isinstance(node.get("pattern"), str) and node["pattern"] in error else None
    else:
        return None, None
    for pointer, node in _subschemas(schema, ""):
        if (keyword := at(node)) is not None:
            return f"{pointer}/{_escape(keyword)}", keyword
    return None, None


def _subschemas(node, pointer: str) -> Iterator[tuple[str, Mapping]]:
    """(JSON pointer, subschema) for node and every schema within it, depth first."""
    if not isinstance(node, Mapping):
        return
    yield pointer, node
    for key, value in node.items():
        here = f"{pointer}/{_escape(key)}"
        if key in _SUBSCHEMA:
            yield from _subschemas(value, here)
        if key in _SUBSCHEMA_LIST and isinstance(value, list):
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{here}/{i}")
        if key in _SUBSCHEMA_MAP and isinstance(value, Mapping):
            for name, item in value.items():
                yield from _subschemas(item, f"{here}/{_escape(name)}")


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _escape(token: str) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return str(token).replace("~", "~0").replace("/", "~1")
