"""An OpenAI request's constraint: `response_format`, vLLM's `structured_outputs` and older `guided_*`
fields, and `tools` with `tool_choice`, turned into the StructuredOutputsParams the engine enforces and
the parser that reads tool calls out of the reply.

tool_choice "required" and a named function are enforced by a schema built from the tools'
parameters, so they work with any model: "required" makes the model write a JSON array of
{"name", "parameters"} objects (one only without parallel_tool_calls), a named function its arguments
object. "auto" leaves the model free and reads its calls with the server's --tool-call-parser.
"""

import asyncio
import dataclasses

from paged_jax.core.errors import RequestError
from paged_jax.core.grammars import GrammarError
from paged_jax.core.sampling_params import StructuredOutputsParams
from paged_jax.core.structured_output import GrammarCompiler
from paged_jax.serving import tool_parsers
from paged_jax.serving.structured_protocol import NamedToolChoice

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class ConstraintError(RequestError):
    """A request whose constraint cannot be: a 400 naming the field at fault."""


@dataclasses.dataclass(frozen=True)
class RequestConstraint:
    structured_outputs: StructuredOutputsParams | None = None
    parser: tool_parsers.ToolParser | None = None  # None: the reply is plain content
    # (request field, constraint) to compile before the request runs, so that each error names its
    # field: the tools' parameters one by one, then structured_outputs itself.
    checks: tuple[tuple[str, StructuredOutputsParams], ...] = ()
    single_call: bool = False  # parallel_tool_calls false: the first call only


def request_constraint(request, *, auto_tool_parser: str | None) -> RequestConstraint:
    """request: a completion or chat completion request. auto_tool_parser: the parser tool_choice
    "auto" reads calls with (None: the server does not enable auto tool choice)."""
    given = _given_constraints(request)
    if len(given) > 1:
        raise ConstraintError(f"give one constraint, not {len(given)}: {', '.join(name for name, _ in given)}",
                              given[1][0])
    tools = getattr(request, "tools", None) or []
    choice = getattr(request, "tool_choice", None) or ("auto" if tools else "none")
    single = getattr(request, "parallel_tool_calls", None) is False
    if choice == "none":
        return _plain(given)
    if not tools:
        raise ConstraintError("tool_choice needs tools to choose from", "tool_choice")
    if choice == "auto":
        if auto_tool_parser is None:
            raise ConstraintError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                                  "--tool-call-parser", "tool_choice")
        return dataclasses.replace(_plain(given), parser=tool_parsers.PARSERS[auto_tool_parser](),
                                   single_call=single)
    if given:
        raise ConstraintError(f"{given[0][0]} cannot be combined with tool_choice {_describe(choice)}, which "
                              "constrains the reply itself", given[0][0])
    names = [t.function.name for t in tools]
    checks = tuple((f"tools[{i}].function.parameters", StructuredOutputsParams(json=_parameters(t)))
                   for i, t in enumerate(tools) if t.function.parameters)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ConstraintError(f"tool_choice names the function {name!r}, which is not among the tools "
                                  f"({', '.join(names)})", "tool_choice")
        tool = tools[names.index(name)]
        so = StructuredOutputsParams(json=_parameters(tool))
        return RequestConstraint(so, tool_parsers.NamedParser(name), (*checks, ("tool_choice", so)), single)
    so = StructuredOutputsParams(json=_calls_schema(tools, single))
    return RequestConstraint(so, tool_parsers.RequiredParser(), (*checks, ("tool_choice", so)), single)


async def compiled(grammars: GrammarCompiler | None, so: StructuredOutputsParams, param: str) -> None:
    """Wait for the constraint to compile (on the compiler's thread; the engine then finds it cached);
    a ConstraintError naming `param` if it cannot. grammars: None for a model without a tokenizer."""
    if grammars is None:
        raise ConstraintError("this model has no tokenizer, which constraints need", param)
    try:
        await asyncio.wrap_future(grammars.submit(so))
    except GrammarError as e:
        raise ConstraintError(f"{param}: {e}", param) from e


def _given_constraints(request) -> list[tuple[str, StructuredOutputsParams]]:
    """(field, constraint) for each field of the request that asks for one."""
    given = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type == "json_object":
        given.append(("response_format", _params("response_format", json_object=True)))
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ConstraintError('response_format of type "json_schema" needs json_schema.schema', "response_format")
        given.append(("response_format", _params("response_format", json=spec.json_schema)))
    if request.structured_outputs is not None:
        given.append(("structured_outputs", _params("structured_outputs", **request.structured_outputs.model_dump(
            exclude_none=True, by_alias=True))))
    for field, kind in _GUIDED.items():
        value = getattr(request, field)
        if value is not None:
            given.append((field, _params(field, **{kind: value},
                                         whitespace_pattern=getattr(request, "guided_whitespace_pattern", None))))
    return given


def _params(field: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise ConstraintError(f"{field}: {e}", field) from e


def _plain(given: list[tuple[str, StructuredOutputsParams]]) -> RequestConstraint:
    if not given:
        return RequestConstraint()
    return RequestConstraint(given[0][1], checks=(given[0],))


def _describe(choice) -> str:
    return f"naming {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)


def _parameters(tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _calls_schema(tools, single: bool) -> dict:
    """The JSON array of calls that tool_choice "required" constrains the reply to."""
    call = lambda t: {"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": _parameters(t)},
                      "required": ["name", "parameters"], "additionalProperties": False}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call(t) for t in tools]}}
    return schema | {"maxItems": 1} if single else schema
