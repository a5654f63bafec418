"""Which part of an engine step (step_profile.PARTS) each op of its compiled program is, read from the
program's HLO text: instruction names, opcodes, and op_name metadata carrying the model's named scopes
("attention", "kv_write", "matmul": models/llama.py). A dot, or a fusion around one, is a matmul too."""

import collections
import re


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?\s([\w\-]+)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def classify_hlo(text: str) -> dict[str, str]:
    """Instruction name -> part, for every instruction of a compiled module's HLO text."""
    calls, metadata, opcode, has_dot = {}, {}, {}, collections.defaultdict(bool)
    computation = None
    for line in text.splitlines():
        if (m := _INSTRUCTION.match(line)) is None:
            if (c := _COMPUTATION.match(line)) is not None:
                computation = c.group(1)
            continue
        name = m.group(1)
        opcode[name] = m.group(2)
        metadata[name] = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        calls[name] = re.findall(r"(?:calls|body|condition|to_apply)=%?([\w.\-]+)", line)
        if m.group(2) in ("dot", "convolution"):
            has_dot[computation] = True

    def part(name: str) -> str:
        scope = metadata[name]
        if "attention" in scope:
            return "attention"
        if "kv_write" in scope:
            return "kv_write"
        if "matmul" in scope or opcode[name] in ("dot", "convolution") or (
                opcode[name] == "fusion" and any(has_dot[c] for c in calls[name])):
            return "matmul"
        return "other"

    return {name: part(name) for name in opcode}


def compiled_text(program, abstract, *, scoped: bool) -> str:
    """The optimized HLO of one of the step's jitted programs (step_programs.step, sample_step) for
    `abstract` = (graph, arrays as jax.ShapeDtypeStruct, keywords): what a traced run's op names point
    into. scoped: the program holds the model's named scopes, checked to be there."""
    graph, arrays, keywords = abstract
    text = program.lower(graph, *arrays, **keywords).compile().as_text()
    if scoped and ("kv_write" not in text or "attention" not in text):
        # The persistent compilation cache's key leaves out op metadata: a program cached before the
        # model's named scopes were added comes back without them.
        raise RuntimeError("the compiled step lacks the model's named scopes 'attention' and 'kv_write': the "
                           "persistent compilation cache holds it from older code; profile with a fresh one "
                           "(JAX_COMPILATION_CACHE_DIR=/some/new/folder) or clear it")
    return text
