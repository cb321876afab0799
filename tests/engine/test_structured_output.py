"""Structured outputs (issue 16) through the offline engine, on a tiny random
Qwen3 with Qwen3's real tokenizer (whose vocabulary is smaller than the
model's): whatever the weights, every constrained output parses and follows
its schema, regex, choice or grammar, in batches mixed with free requests,
with n > 1, async scheduling on and off, after preemptions and with stop
strings; a spec xgrammar cannot compile is a ValueError naming the problem,
and the engine serves on."""

import asyncio
import json
import re

import jsonschema
import pytest
from checkpoints import qwen3_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "vaccinated": {"type": "boolean"}},
            "required": ["kind", "vaccinated"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe so", "naïve ☃"]
GRAMMAR = 'root ::= "(" digit ("+" digit){0,3} ")"\ndigit ::= [0-9]'
GRAMMAR_AS_REGEX = r"\([0-9](\+[0-9]){0,3}\)"
MAX_TOKENS = 120


def constrained(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec, disable_any_whitespace=True)


def check_json(text):
    jsonschema.validate(json.loads(text), SCHEMA)


def check_object(text):
    assert isinstance(json.loads(text), dict)


# kind -> (StructuredOutputsParams, check of the text)
KINDS = {
    "json": (constrained(json=SCHEMA), check_json),
    "json_text": (constrained(json=json.dumps(SCHEMA)), check_json),
    "regex": (constrained(regex=REGEX), lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    "choice": (constrained(choice=CHOICES), lambda text: text in CHOICES or pytest.fail(text)),
    "grammar": (constrained(grammar=GRAMMAR), lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) or pytest.fail(text)),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen3_checkpoint(str(tmp_path_factory.mktemp("qwen3-real-tokenizer")))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, dtype="float32", kv_cache_space=0.1)


def brace_id(llm) -> int:
    return llm.get_tokenizer().convert_tokens_to_ids("}")


def assert_follows(kind, completion):
    assert completion.finish_reason == "stop", (kind, completion.text)
    KINDS[kind][1](completion.text)


def mixed_batch(seed=0, n=1):
    """Each kind twice (sampled, seeded) and free requests between them."""
    prompts, params, kinds = [], [], []
    for i, (kind, (spec, _)) in enumerate(list(KINDS.items()) * 2):
        prompts.append(f"Answer {kind} number {i}:")
        params.append(SamplingParams(max_tokens=MAX_TOKENS, seed=seed + i, n=n, structured_outputs=spec))
        kinds.append(kind)
        prompts.append(f"free text {i}")
        params.append(SamplingParams(max_tokens=10, seed=seed + i, ignore_eos=True))
        kinds.append(None)
    return prompts, params, kinds


def run_mixed(llm, seed=0, n=1):
    prompts, params, kinds = mixed_batch(seed, n)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for kind, output in zip(kinds, outputs):
        for completion in output.outputs:
            if kind is None:
                assert completion.finish_reason == "length" and len(completion.token_ids) == 10
            else:
                assert_follows(kind, completion)
    return outputs


def texts(outputs):
    return [[c.text for c in o.outputs] for o in outputs]


def test_every_kind_follows_its_spec_in_a_mixed_batch(llm):
    for seed in (0, 100):
        run_mixed(llm, seed)


def test_greedy_and_json_object(llm):
    # The bias makes "}" the model's favourite: only the grammar keeps it from
    # coming first, and then it closes the object at once.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={brace_id(llm): 50.0},
                            structured_outputs=constrained(json_object=True))
    free = llm.generate(["{ now"], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={brace_id(llm): 50.0}),
                        use_tqdm=False)[0].outputs[0]
    assert free.text.startswith("}")
    completion = llm.generate(["{ now"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    check_object(completion.text)
    for kind, (spec, _) in KINDS.items():
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)
        assert_follows(kind, llm.generate(["Answer:"], greedy, use_tqdm=False)[0].outputs[0])


def test_n_samples_each_follow_the_spec(llm):
    outputs = run_mixed(llm, seed=7, n=3)
    json_texts = [c.text for c in outputs[0].outputs]
    assert len(json_texts) == 3 and len(set(json_texts)) > 1, json_texts


def test_async_scheduling_changes_no_output(folder, llm):
    assert not llm.llm_engine.async_scheduling  # the CPU's default
    overlapped = LLM(folder, dtype="float32", kv_cache_space=0.1, async_scheduling=True)
    assert texts(run_mixed(overlapped, seed=3)) == texts(run_mixed(llm, seed=3))


def test_preemption_changes_no_output(folder, llm):
    want = texts(run_mixed(llm, seed=5))
    small = LLM(folder, dtype="float32", block_size=4, num_gpu_blocks_override=40, max_num_seqs=8)
    assert texts(run_mixed(small, seed=5)) == want
    assert small.llm_engine.scheduler.num_preemptions > 0


def test_stop_strings_cut_constrained_text(llm):
    params = SamplingParams(max_tokens=MAX_TOKENS, seed=1, stop=["-"], structured_outputs=constrained(regex=REGEX))
    completion = llm.generate(["code:"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "-"
    assert re.fullmatch(r"[a-c]{2,4}", completion.text), completion.text


@pytest.mark.parametrize("spec, problem", [
    (dict(json={"type": "objekt"}), r"structured_outputs\.json: .*objekt"),
    (dict(regex="a(b"), r"structured_outputs\.regex: .*parenthesis"),
    (dict(grammar='root ::= "a" | '), r"structured_outputs\.grammar: .*EBNF"),
])
def test_a_spec_that_cannot_compile_is_refused_and_the_engine_serves_on(llm, spec, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    completion = llm.generate(["x"], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=KINDS["choice"][0]),
                              use_tqdm=False)[0].outputs[0]
    assert_follows("choice", completion)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(), "exactly one of json, regex, choice, grammar, json_object, got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=3), "structured_outputs.json must be a JSON schema"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
])
def test_bad_params_name_the_field(kwargs, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_an_engine_core_process_compiles_with_its_own_tokenizer(folder):
    from pagoda.engine.async_llm import AsyncLLM

    async def run(engine):
        params = SamplingParams(max_tokens=MAX_TOKENS, seed=0, n=2, structured_outputs=KINDS["json"][0])
        async for output in engine.generate("Answer:", params, "r0"):
            final = output
        return final

    engine = AsyncLLM(folder, multiprocess=True, dtype="float32", kv_cache_space=0.1, disable_log_stats=True)
    try:
        output = asyncio.run(run(engine))
    finally:
        engine.shutdown()
    for completion in output.outputs:
        assert_follows("json", completion)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_masks_the_constrained_rows_only(temperature):
    import torch

    from pagoda.model_executor.layers.sampler import Sampler, SamplingMetadata

    logits = torch.randn(3, 100)
    logits[:, 7] = 100.0  # every row's favourite
    allowed = {0: [3, 50], 2: [99]}
    bitmask = torch.full((3, 4), -1, dtype=torch.int32)  # xgrammar's packing: bit t % 32 of word t // 32
    for row, ids in allowed.items():
        bitmask[row] = 0
        for t in ids:
            bitmask[row, t // 32] |= 1 << (t % 32)
    md = SamplingMetadata.from_requests([SamplingParams(temperature=temperature)] * 3, [[]] * 3)
    md.grammar_bitmask, md.grammar_rows = bitmask, list(allowed)
    for _ in range(5):
        sampled = Sampler()(logits, md).sampled_token_ids
        assert sampled[0] in allowed[0] and sampled[1] == 7 and sampled[2] == 99, sampled


def test_length_bounded_json_strings_refuse_control_characters():
    """xgrammar writes a string with maxLength as repeats of a class that
    lets a raw tab in (not JSON); the grammar Pagoda compiles must not."""
    import xgrammar as xgr

    from pagoda.engine.structured_output import _parse

    vocab = ['{"city": "', "a", "\t", '"}']
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab)).compile_grammar(
        _parse(("json", json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                    "required": ["city"]})), False))
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(0)
    assert matcher.accept_token(1)
    assert not matcher.accept_token(2)
    assert matcher.accept_token(3)
