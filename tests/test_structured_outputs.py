"""Structured outputs (llguidance): the bitmask in both samplers against sampling_ref, the engine on both backends
(schemas validate, regexes full-match, choices, structural tags, seeded draws identical across backends,
preemption, chunked prefill + prefix caching, abort, reasoning start), and the frontend's request fields and 400s.

The real HTTP server test lives in tests/test_structured_outputs_server.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from enginecore import sampling_ref as ref  # noqa: E402
from enginecore.sampling_batch import SamplingBatch, scatter_bitmask  # noqa: E402
from enginecore.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from enginecore.sampling_params import StructuredOutputsParams as SO  # noqa: E402
from enginecore.sampling_ref import seeded_uniform  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Berlin"]}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["Paris", "London", "Berlin", "Madrid"]


# ---- the bitmask: spec, jax, torch -------------------------------------------------------------------


def random_bitmask(rng, R, V, *, pad_bits: bool):
    """[R, ceil(V/32)] int32 with ~30% allowed; `pad_bits`: bits past V set (they must not matter)."""
    allowed = rng.random((R, V)) < 0.3
    allowed[:, 0] = True
    W = -(-V // 32)
    full = np.zeros((R, W * 32), bool)
    full[:, :V] = allowed
    if pad_bits:
        full[:, V:] = True
    words = (full.reshape(R, W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32), allowed


@pytest.mark.parametrize("V", [64, 300, 1000])
def test_bitmask_unpack_spec(V):
    rng = np.random.default_rng(V)
    bm, allowed = random_bitmask(rng, 3, V, pad_bits=True)
    assert np.array_equal(ref.unpack_bitmask(bm, V), allowed)
    x = rng.standard_normal(V).astype(np.float32)
    y = ref.apply_token_bitmask(x, bm[0])
    assert np.array_equal(np.isfinite(y), allowed[0]) and np.array_equal(y[allowed[0]], x[allowed[0]])


def test_scatter_bitmask_into_padded_rows():
    V = 100  # 4 words; a grammar vocabulary of 160 tokens gives 5 words: the extra one is cut
    bm = np.arange(10, dtype=np.int32).reshape(2, 5)
    out = scatter_bitmask(bm, ["b", "a"], ["a", "x", "b"], 4, V)
    assert out.shape == (4, 4)
    assert out[0].tolist() == [5, 6, 7, 8] and out[2].tolist() == [0, 1, 2, 3]
    assert (out[1] == -1).all() and (out[3] == -1).all()
    assert scatter_bitmask(bm, ["b", "a"], ["x"], 1, V) is None


def _batch(rng, R, V, temps, **extra):
    temps = np.asarray(temps, np.float32)
    return SamplingBatch(
        temperature=temps, top_k=np.asarray([0, 5, 0, 50, 0, 0][:R], np.int32),
        top_p=np.asarray([1.0, 1.0, 0.9, 1.0, 0.8, 1.0][:R], np.float32), min_p=np.zeros(R, np.float32),
        uniform=seeded_uniform(np.arange(R) + 11, 0, rng.integers(0, 1000, R)),
        all_greedy=bool((temps < ref.GREEDY_EPS).all()), needs_filtering=True, num_logprobs=-1, **extra)


def _ref_tokens(x, sb: SamplingBatch, bias=None):
    return [ref.sample_row(x[i], temperature=float(sb.temperature[i]), top_k=int(sb.top_k[i]),
                           top_p=float(sb.top_p[i]), min_p=float(sb.min_p[i]), u=float(sb.uniform[i]),
                           bias=None if bias is None else bias[i], token_bitmask=sb.token_bitmask[i])
            for i in range(len(x))]


@pytest.mark.parametrize("with_bias", [False, True])
def test_masked_sampling_jax_and_torch_match_spec(with_bias):
    import jax
    import torch

    from jaxengine import sampler as JS
    from torchengine.sampler import SamplingTensors, sample as torch_sample

    V, R = 300, 6
    rng = np.random.default_rng(7 + with_bias)
    x = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    x[:, 0] = 50.0  # the unconstrained argmax: disallowed below in rows 1..5
    bm, allowed = random_bitmask(rng, R, V, pad_bits=True)
    bm[0] = -1  # row 0 unconstrained
    for i in range(1, R):
        bm[i, 0] &= ~1
    bias = None
    if with_bias:
        bias = np.zeros((R, V), np.float32)
        bias[:, rng.integers(0, V, 30)] = 3.0
    sb = _batch(rng, R, V, [0.0, 0.0, 0.7, 1.0, 1.3, 0.9], token_bitmask=bm, bias=bias)
    want = _ref_tokens(x, sb, bias)
    assert want[0] == 0 and all(w != 0 for w in want[1:])
    assert all(bm[i, w // 32] >> (w % 32) & 1 for i, w in enumerate(want))
    # torch
    st = SamplingTensors.from_batch(sb, torch.device("cpu"))
    got_t = torch_sample(torch.from_numpy(x), st).sampled.tolist()
    # jax: "masked" without bias, "processed" with it
    mode = JS.sampler_mode(False, False, with_bias, True)
    assert mode == ("processed" if with_bias else "masked")
    processed = None
    if with_bias:
        processed = (bias, np.zeros((R, V), np.float32), np.zeros((R, V), bool), np.zeros(R, np.float32),
                     np.zeros(R, np.float32), np.ones(R, np.float32))
    f = jax.jit(JS.sample, static_argnames=("mode", "num_logprobs", "method"))
    got_j, _ = f(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.uniform, np.bool_(False), np.bool_(True),
                 np.bool_(False), processed, bm, mode=mode, num_logprobs=0, method="topk")
    assert got_t == want
    assert np.asarray(got_j).tolist() == want


# ---- the frontend's request fields ------------------------------------------------------------------


def _req(**kw):
    from frontend.protocol import ChatCompletionRequest

    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_request_fields_to_params(caplog):
    from frontend.structured_outputs import request_constraint

    assert request_constraint(_req()) is None
    assert request_constraint(_req(response_format={"type": "text"})) is None
    assert request_constraint(_req(response_format={"type": "json_object"})).json_object
    so = request_constraint(_req(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON, "strict": True}}))
    assert so.json == PERSON
    so = request_constraint(_req(structured_outputs={"regex": PHONE, "whitespace_pattern": " "}))
    assert so.regex == PHONE and so.whitespace_pattern == " "
    assert request_constraint(_req(structured_outputs={"choice": CHOICES})).choice == CHOICES
    with caplog.at_level("WARNING", logger="xlaserve.frontend"):
        assert request_constraint(_req(guided_json=json.dumps(PERSON))).json == json.dumps(PERSON)
    assert "deprecated" in caplog.text
    assert request_constraint(_req(guided_choice=["a", "b"])).choice == ["a", "b"]
    assert request_constraint(_req(guided_grammar='start: "a" | "b"')).grammar
    gbnf = 'root ::= "yes" | "no"'
    assert request_constraint(_req(structured_outputs={"grammar": gbnf})).grammar == gbnf
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=get>", "schema": {"type": "object"}, "end": "</f>"}]}
    assert request_constraint(_req(response_format=tag)).structural_tag
    # n > 1 and seeds pass through SamplingParams untouched
    sp = _req(n=2, seed=3, structured_outputs={"regex": PHONE}).sampling_params(None, None, {}, None)
    assert sp.structured_outputs.regex == PHONE and sp.n == 2


@pytest.mark.parametrize("kw,param,needle", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format", "objekt"),
    (dict(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "yaml"),
    (dict(structured_outputs={"regex": "[a-"}), "structured_outputs", "regex"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs", "JSON"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "structured_outputs", "jsn"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "choice"),
    (dict(structured_outputs={"grammar": "start: foo"}), "structured_outputs", "foo"),
    (dict(structured_outputs={"grammar": "root ::= foo"}), "structured_outputs", "grammar"),
    (dict(structured_outputs={"structural_tag": "{}"}), "structured_outputs", "structural_tag"),
    (dict(guided_regex="(", guided_json={"type": "object"}), "guided_json", "one of"),
    (dict(guided_regex="("), "guided_regex", "regex"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs",
     "not several"),
])
def test_invalid_constraints_are_400_naming_the_field(kw, param, needle):
    from types import SimpleNamespace

    from enginecore.config import StructuredOutputsConfig
    from enginecore.processor import InputProcessor
    from frontend.structured_outputs import request_constraint

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=64), model_config=SimpleNamespace(seed=0),
                             structured_outputs_config=StructuredOutputsConfig())

    def request_constraint_validated(req):  # the frontend builds it, the input processor compiles it
        so = request_constraint(req)
        InputProcessor(config, None, 100).validate_structured_outputs(so)

    with pytest.raises(SamplingParamsError) as e:
        request_constraint_validated(_req(**kw))
    assert e.value.param == param, e.value
    assert needle in str(e.value), e.value


def test_structured_outputs_config_flag():
    import argparse

    from enginecore.config import ConfigError, EngineArgs, StructuredOutputsConfig
    from frontend.args import parse_serve_args
    from frontend.cli import build_parser

    assert StructuredOutputsConfig.from_dict({"backend": "guidance"}).backend == "guidance"
    with pytest.raises(ConfigError, match="xgrammar"):
        StructuredOutputsConfig.from_dict({"backend": "xgrammar"})
    with pytest.raises(ConfigError, match="unknown key"):
        StructuredOutputsConfig.from_dict({"backnd": "auto"})
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    ns = parse_serve_args(sub.choices["serve"], ["--structured-outputs-config", '{"backend": "guidance"}',
                                                 "--structured-outputs-config.disable_any_whitespace", "true"])
    assert ns.structured_outputs_config == {"backend": "guidance", "disable_any_whitespace": True}
    cfg = EngineArgs(structured_outputs_config=ns.structured_outputs_config, platform="cpu").create_engine_config(512)
    assert cfg.structured_outputs_config.disable_any_whitespace


# ---- the engine, both backends -----------------------------------------------------------------------


def _llm(backend, **kw):
    from enginecore import LLM

    # few buckets: fewer jax programs to compile (padded rows cost little for this model)
    args = dict(backend=backend, platform="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                kv_cache_memory_bytes=32 << 20, seed=0, min_token_bucket=16, min_seq_bucket=8)
    args.update(kw)
    return LLM(None, **args)


@pytest.fixture(scope="module")
def llms():
    engines = {b: _llm(b) for b in ("jax", "torch")}
    yield engines
    for e in engines.values():
        e.llm_engine.core.shutdown()


def chat(llm, text):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def _cases(llm):
    """(prompt, params, check) for a mix of constraints, greedy and seeded, with plain requests among them."""
    p_person = chat(llm, "Describe a person as JSON with name, age and city.")
    p_phone = chat(llm, "Give me a phone number.")
    p_city = chat(llm, "What is the capital of France?")

    def person(text):
        jsonschema.validate(json.loads(text), PERSON)

    def phone(text):
        assert re.fullmatch(PHONE, text), text

    def city(text):
        assert text in CHOICES, text

    def any_object(text):
        assert isinstance(json.loads(text), dict)

    cases = []
    for seed in (None, 1, 2, 3):
        temp = 0.0 if seed is None else 0.9
        cases.append((p_person, SamplingParams(temperature=temp, seed=seed, max_tokens=80,
                                               structured_outputs=SO(json=PERSON)), person))
        cases.append((p_phone, SamplingParams(temperature=temp, seed=seed, max_tokens=20,
                                              structured_outputs=SO(regex=PHONE)), phone))
        cases.append((p_city, SamplingParams(temperature=temp, seed=seed, max_tokens=10,
                                             structured_outputs=SO(choice=CHOICES)), city))
    cases.append((p_person, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SO(
        json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        disable_any_whitespace=True)), any_object))
    def yes_no(text):
        assert text in ("The answer is yes.", "The answer is no."), text

    def answer(text):
        assert re.fullmatch(r"Answer: [0-9]{1,3}", text), text

    cases.append((p_city, SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=SO(
        grammar='root ::= "The answer is " ("yes" | "no") "."')), yes_no))  # GBNF
    cases.append((p_phone, SamplingParams(temperature=0.7, seed=5, max_tokens=20, structured_outputs=SO(
        grammar='start: "Answer: " NUM\nNUM: /[0-9]{1,3}/')), answer))  # Lark
    cases.append((p_city, SamplingParams(temperature=0.0, max_tokens=12), None))  # plain, in the same batch
    cases.append((p_phone, SamplingParams(temperature=0.8, seed=9, max_tokens=12), None))
    return cases


@pytest.fixture(scope="module")
def engine_outputs(llms):
    res = {}
    for backend, llm in llms.items():
        cases = _cases(llm)
        outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
        res[backend] = (cases, outs)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_engine_outputs_satisfy_constraints(engine_outputs, backend):
    cases, outs = engine_outputs[backend]
    for (_, sp, check), o in zip(cases, outs):
        c = o.outputs[0]
        if check is None:
            continue
        assert c.finish_reason == "stop", (c.text, sp.structured_outputs)
        check(c.text)


@pytest.mark.slow
def test_engine_outputs_identical_across_backends(engine_outputs):
    """Greedy outputs identical. Seeded ones identical, except where a draw's uniform lands within rounding
    of a boundary of the cumulative distribution (the two backends' logits differ in the last bits; the
    inverse CDF runs in vocabulary order over ~49k tokens): then the backends pick ids a few apart in
    vocabulary order and the continuations differ from there. At most one such flip among the cases."""
    (cases, jo), (_, to) = engine_outputs["jax"], engine_outputs["torch"]
    flips = []
    for (_, sp, _), a, b in zip(cases, jo, to):
        ja, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if sp.temperature == 0.0 or ja == tb:
            assert ja == tb, (a.outputs[0].text, b.outputs[0].text)
            continue
        i = next(i for i, (x, y) in enumerate(zip(ja, tb)) if x != y)
        assert abs(ja[i] - tb[i]) <= 32, (i, ja[i], tb[i], a.outputs[0].text, b.outputs[0].text)
        flips.append((sp.seed, i, ja[i], tb[i]))
    assert len(flips) <= 1, flips


@pytest.mark.slow
def test_plain_requests_unchanged_by_constrained_neighbours(llms, engine_outputs):
    llm = llms["jax"]
    cases, outs = engine_outputs["jax"]
    plain = [(c, o) for c, o in zip(cases, outs) if c[2] is None]
    alone = llm.generate([c[0] for c, _ in plain], [c[1] for c, _ in plain], use_tqdm=False)
    assert [o.outputs[0].token_ids for _, o in plain] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.slow
def test_n2_seeded_children_each_constrained(llms):
    llm = llms["torch"]
    sp = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10, structured_outputs=SO(choice=CHOICES))
    out = llm.generate([chat(llm, "Name a European capital.")], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(c.text in CHOICES and c.finish_reason == "stop" for c in out.outputs)


@pytest.mark.slow
def test_preemption_chunked_prefill_and_prefix_cache_give_the_same_outputs(llms, engine_outputs):
    """A tight KV cache (preemptions), small chunks and the prefix cache on: the same tokens as a roomy run."""
    cases, outs = engine_outputs["torch"]
    roomy = llms["torch"]
    long_prompts = [chat(roomy, f"Write a long sentence about the number {i}.") for i in range(4)]
    long_params = [SamplingParams(temperature=0.0 if i == 0 else 0.8, seed=i, max_tokens=120,
                                  structured_outputs=SO(regex=r"[a-z ]{200}")) for i in range(4)]
    want_long = roomy.generate(long_prompts, long_params, use_tqdm=False)
    tight = _llm("torch", num_gpu_blocks_override=12, block_size=16, max_num_batched_tokens=32,
                 long_prefill_token_threshold=24, enable_prefix_caching=True)
    try:
        got = tight.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs]
        assert tight.llm_engine.core.scheduler.kv.stats.hits > 0
        got_long = tight.generate(long_prompts, long_params, use_tqdm=False)
        assert tight.llm_engine.core.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in got_long] == [o.outputs[0].token_ids for o in want_long]
        assert all(re.fullmatch(r"[a-z ]{200}", o.outputs[0].text) for o in got_long)
        assert tight.llm_engine.core.scheduler._num_constrained == 0
    finally:
        tight.llm_engine.core.shutdown()


@pytest.mark.slow
def test_structural_tag_constrains_only_what_follows_its_trigger(llms):
    """vLLM's structural tag: free text, but after a trigger one of the structures (begin, a JSON schema, end).
    A few-shot prompt makes the model write tool calls; unconstrained it copies the examples' arguments, under
    the tag every call it starts carries the schema's instead, the same text on both backends."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}]}
    prompt = 'Tool calls:\n<f=add>{"a": 1}</f>\n<f=add>{"a": 2}</f>\n<f=add>{"a": 3}</f>\n'
    call = re.compile(r"<f=add>(.*?)</f>", re.S)
    free = llms["torch"].generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    first = call.search(free[0].outputs[0].text)
    assert first is not None and not jsonschema.Draft202012Validator(schema).is_valid(json.loads(first.group(1)))
    outs = {b: llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(
        structural_tag=json.dumps(tag))), use_tqdm=False)[0].outputs[0] for b, llm in llms.items()}
    assert outs["jax"].text == outs["torch"].text
    out = outs["torch"]
    starts = [m.start() for m in re.finditer("<f=", out.text)]
    assert starts and call.search(out.text), out.text
    for i, s in enumerate(starts):
        m = call.match(out.text, s)
        if m is None:  # only the last call may be cut short, by max_tokens
            assert i == len(starts) - 1 and out.finish_reason == "length", out.text
            continue
        jsonschema.validate(json.loads(m.group(1)), schema)


@pytest.mark.slow
def test_reasoning_start_token_defers_the_constraint(llms):
    llm = llms["torch"]
    prompt = chat(llm, "What is the capital of France?")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    start = free.token_ids[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=20,
                        structured_outputs=SO(choice=CHOICES, start_after_token_ids=start))
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == start
    tail = llm.get_tokenizer().decode(out.token_ids[2:])
    assert tail in CHOICES and out.finish_reason == "stop"


@pytest.mark.slow
def test_abort_and_engine_side_grammar_failure_free_the_state(llms):
    from enginecore.request import Request

    llm = llms["torch"]
    eng = llm.llm_engine
    sched = eng.core.scheduler
    eng.add_request("abort-me", chat(llm, "Give JSON"), SamplingParams(
        temperature=0.0, max_tokens=200, structured_outputs=SO(json_object=True)))
    for _ in range(3):
        eng.step()
    assert sched._num_constrained == 1
    eng.abort_request("abort-me")
    eng.step()
    assert sched._num_constrained == 0 and not sched.has_unfinished_requests()
    # a grammar that fails in the engine (the API side's check skipped): that request alone ends, "error"
    bad = SamplingParams(max_tokens=5, structured_outputs=SO(regex="("))
    eng.core.add_request(Request("bad-0", [1, 2, 3], bad, eos_token_ids=(2,), max_tokens=5))
    outs = []
    for _ in range(200):
        outs += eng.core.step()
        if any(o.request_id == "bad-0" and o.finish_reason for o in outs):
            break
    (o,) = [o for o in outs if o.request_id == "bad-0"]
    assert o.finish_reason == "error" and "grammar" in o.stop_reason
    assert sched._num_constrained == 0 and not sched.has_unfinished_requests()
    stats = eng.core.get_stats()
    assert stats.num_structured_requests >= 2 and stats.num_grammar_compiles >= 1


@pytest.mark.slow
def test_offline_validation_is_a_sampling_params_error(llms):
    llm = llms["torch"]
    with pytest.raises(SamplingParamsError) as e:
        llm.generate(["hi"], SamplingParams(structured_outputs=SO(regex="[a-")), use_tqdm=False)
    assert e.value.param == "structured_outputs"
