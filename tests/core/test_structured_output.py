"""Structured outputs in the engine: constraints checked and refused with where they went wrong, the
sampler's mask under every sampling mode, and constrained requests on a tiny random model (so every
token the model wants is one the grammar must stop) under preemption of both kinds, n > 1 and a
grammar still compiling. Outputs are checked with `jsonschema` and `re`, never with llguidance."""

import dataclasses
import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from paged_jax.core.sampling import sample
from paged_jax.core.sampling_tensors import make_sampling_tensors
from paged_jax.core.structured_output import Guide, allowed_tokens

# A finite language, so that even a random model's sampled output ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                  "required": ["name"], "additionalProperties": False},
    },
    "required": ["kind", "count", "flags", "owner"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=SCHEMA)


def make_engine(tiny_chat_model, **options) -> LLMEngine:
    m = tiny_chat_model
    return LLMEngine(m.model, m.config, m.tokenizer, EngineConfig(**{"block_size": 8, "num_blocks": 256} | options))


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(f"Describe pet number {i} of the {i * 7} pets at the shelter, as JSON.")
            for i in range(count)]


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def assert_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.blocks.reset_prefix_cache()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1


def assert_valid(outputs) -> None:
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            jsonschema.validate(json.loads(c.text), SCHEMA)


# --- Parameters and refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1]), "must be a JSON schema"),
    (dict(choice="ab"), "list of non-empty strings"),
    (dict(choice=["a", ""]), "list of non-empty strings"),
])
def test_structured_outputs_params_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_beam_search_refuses_a_constraint():
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(n=2, temperature=0, use_beam_search=True, structured_outputs=JSON)


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM.from_engine(make_engine(tiny_chat_model))


@pytest.mark.parametrize("schema, message", [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "string", "not": {"const": "x"}}}}}}},
     "unsupported JSON schema keyword 'not' at /properties/tags/items/properties/id/not"),
    ({"anyOf": [{"type": "string"}, {"type": "array", "uniqueItems": True}]},
     "unsupported JSON schema keyword 'uniqueItems' at /anyOf/1/uniqueItems"),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "someday"}}},
     "keyword 'format' at /properties/when/format: Unknown format: someday"),
    ({"type": "object", "properties": {"a": {"type": "strng"}}}, "keyword 'type' at /properties/a/type"),
    ({"type": "object", "properties": {"a/b": {"type": "string", "pattern": "[a-"}}},
     "keyword 'pattern' at /properties/a~1b/pattern"),
    ({"$defs": {}, "properties": {"a": {"$ref": "#/$defs/missing"}}}, "keyword '\\$ref' at /properties/a/\\$ref"),
])
def test_schema_errors_name_the_keyword_and_its_pointer(llm, schema, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert_all_free(llm.engine)


@pytest.mark.parametrize("fields, message", [
    (dict(regex="[0-9]{4}-("), r"structured_outputs.regex '\[0-9\]\{4\}-\(' does not compile: unclosed group$"),
    (dict(grammar='start: "a" /[0-9+/'), "(?s)structured_outputs.grammar does not compile: .*unclosed character class"),
    (dict(grammar='root ::= "a" [0-9'), "structured_outputs.grammar is not a Lark or GBNF grammar"),
])
def test_bad_regex_and_grammar_are_refused(llm, fields, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**fields)), use_tqdm=False)


# --- The sampler's mask ---------------------------------------------------------------------------

MODES = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=1.3, n=4, top_k=10, top_p=0.9, frequency_penalty=-1.0),
]


def test_the_mask_holds_in_every_sampling_mode():
    vocab, rows = 100, 64
    rng = np.random.default_rng(0)
    params = [MODES[i % len(MODES)] for i in range(rows)]
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[:, 0] = True  # at least one token per row
    # numpy's own bit packing: little-endian bits, 4 bytes to a word.
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 28))), axis=1, bitorder="little").view(np.int32)
    # Each row's favourite tokens are barred, so an unapplied mask would show at once.
    logits = np.where(allowed, 0.0, 5.0).astype(np.float32) + rng.normal(size=(rows, vocab)).astype(np.float32)
    outputs = [rng.integers(0, vocab, size=5).tolist() for _ in range(rows)]
    for seed in range(5):
        t = make_sampling_tensors(params, [seed * rows + i for i in range(rows)], [[1, 2]] * rows, outputs, [0],
                                  allowed=words, pad_rows_to=rows, vocab_size=vocab, history_width=16)
        tokens = np.asarray(sample(logits, t).tokens)
        assert allowed[np.arange(rows), tokens].all()
    greedy = [i for i, p in enumerate(params) if p.greedy and not p.uses_penalties]
    np.testing.assert_array_equal(tokens[greedy], np.where(allowed, logits, -np.inf)[greedy].argmax(-1))


def test_eos_is_allowed_only_where_the_grammar_accepts(llm):
    engine, tokenizer = llm.engine, llm.tokenizer
    vocab, eos = engine.model_config.vocab_size, tokenizer.eos_token_id
    guide = Guide(engine.gate.compiler.submit(StructuredOutputsParams(regex="[0-9]{2,3}")).result().deep_copy())

    def allowed() -> set[int]:
        bits = np.unpackbits(allowed_tokens([guide], 1, vocab).view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[:vocab]).tolist())

    first = allowed()
    assert eos not in first and first
    assert all(re.fullmatch("[0-9]{1,3}", tokenizer.decode([t])) for t in first)
    for digit in "12":
        assert guide.accept(tokenizer.convert_tokens_to_ids(digit))
    assert eos in allowed() and not guide.finished  # "12" may end, or take one digit more
    assert guide.accept(tokenizer.convert_tokens_to_ids("3"))
    assert allowed() == {eos} and guide.finished


# --- Constrained requests on a tiny random model ---------------------------------------------------


def test_sampled_json_validates_with_n_samples(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=96, structured_outputs=JSON)
    outputs = LLM.from_engine(engine).generate(prompts(engine.tokenizer, 4), params, use_tqdm=False)
    assert_valid(outputs)
    assert len(set(texts(outputs))) > 1  # sampled, not one answer
    assert_all_free(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_constraints(tiny_chat_model, mode):
    many = prompts(tiny_chat_model.tokenizer, 8)
    greedy = SamplingParams(temperature=0, max_tokens=96, structured_outputs=JSON)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=96, structured_outputs=JSON)
    roomy = LLM.from_engine(make_engine(tiny_chat_model)).generate(many, greedy, use_tqdm=False)
    engine = make_engine(tiny_chat_model, num_blocks=28, max_num_batched_tokens=64, preemption_mode=mode)
    tight = LLM.from_engine(engine).generate(many + many[:4], [greedy] * 8 + [sampled] * 4, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert_valid(tight)
    assert texts(tight[:8]) == texts(roomy)
    assert_all_free(engine)


def test_regex_choice_and_grammar(llm):
    date = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=16,
                          structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    choice = SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green", "dark blue"]))
    grammar = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(grammar='start: "(" num ("," num)* ")"\n'
                                                                                'num: /[1-9][0-9]?/'))
    out = llm.generate(["The date:", "The colour:", "A tuple:"], [date, choice, grammar], use_tqdm=False)
    assert all(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", c.text) for c in out[0].outputs)
    assert all(c.text in ("red", "green", "dark blue") for c in out[1].outputs)
    for c in out[2].outputs:
        assert c.finish_reason == "length" or re.fullmatch(r"\((?:[1-9][0-9]?)(?:,[1-9][0-9]?)*\)", c.text)


def test_unsatisfiable_within_max_tokens_ends_with_a_valid_prefix(llm):
    answer = "a sentence far longer than three tokens could ever hold"
    params = SamplingParams(temperature=0, max_tokens=3,
                            structured_outputs=StructuredOutputsParams(choice=[answer]))
    [out] = llm.generate("Say it:", params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert c.text and answer.startswith(c.text)


def test_a_compiling_grammar_does_not_hold_up_other_requests(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    release = threading.Event()
    compile_ = engine.gate.compiler._compile
    engine.gate.compiler._compile = lambda so: release.wait(30) and compile_(so)
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=8, structured_outputs=JSON), "slow")
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "free")
    finished = {}
    for _ in range(12):
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert "free" in finished and "slow" not in finished
    assert engine.gate.request_ids == {"slow"}
    release.set()
    for _ in range(200):
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        if "slow" in finished:
            break
    assert finished["slow"].outputs[0].token_ids
    assert_all_free(engine)


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    bad = StructuredOutputsParams(regex="(")
    engine.add_request("Hello", SamplingParams(max_tokens=8, structured_outputs=bad), "bad")
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "good")
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "structured_outputs.regex '(' does not compile: unclosed group" in finished["bad"].error
    assert len(finished["good"].outputs[0].token_ids) == 8
    assert_all_free(engine)


def test_aborting_a_request_that_awaits_its_grammar(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    engine.add_request("Hello", SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["never compiled before"])), "r")
    engine.abort_request("r")
    assert not engine.has_unfinished_requests()
    assert engine.step() == [] and not engine.scheduler.has_unfinished()


def test_chat_shows_tools_to_the_template(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    tokenizer = engine.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                               "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        llm = LLM.from_engine(engine)
        prompt = llm.chat_prompt([{"role": "user", "content": "hi"}], tools=tools)
        assert tokenizer.decode(prompt) == "[tool get_weather]user: hi\n"
        [out] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, temperature=0), tools=tools,
                         use_tqdm=False)
        assert out.prompt_token_ids == prompt
    finally:
        tokenizer.chat_template = original


def test_a_constrained_row_leaves_the_others_alone(tiny_chat_model):
    """A batch that mixes them: the unconstrained rows get the tokens they get alone."""
    engine = make_engine(tiny_chat_model)
    many = prompts(engine.tokenizer, 3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(many, greedy, use_tqdm=False)]
    mixed = LLM.from_engine(engine).generate(many + many[:1], [greedy] * 3 + [dataclasses.replace(
        greedy, structured_outputs=JSON, ignore_eos=False, max_tokens=96)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert_valid(mixed[3:])
