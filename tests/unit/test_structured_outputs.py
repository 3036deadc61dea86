"""Structured outputs in the engine (`response_format`): greedy tokens equal `transformers`' generate
with the same library's mask applied step by step, with and without images and beside
unconstrained rows (whose tokens do not change); every output of bounded schemas (hypothesis) is
valid, greedy or sampled, after text, one image or two, steps overlapped or not; bad schemas are
refused by name; a resumed stream's matcher is rebuilt from the tokens it had sent. The tiny models
have random weights: only the grammar makes their output valid JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_service.grammar import GrammarCompiler, Matcher
from llm_service.sampling import Grammar
from mmserve.errors import InvalidRequest
from tests.support.cases import image, text, user
from tests.support.engine_support import Collector, make_engine, plan_request, run_until_done
from tests.support.reference import reference_constrained
from tests.support.schemas import BOUNDED, CHART, INVOICE

MAX_TOKENS = 400  # above what any bounded schema here can take (`schemas.FITS`): a valid output always fits

def _grammar(schema: dict | None) -> Grammar:
    return Grammar("json_object") if schema is None else Grammar("json_schema", json.dumps(schema))


def _run(model_dir, requests, overlap=False, on_engine=None, **config):
    """{name: (tokens, finish reason)} of [(name, messages, schema or None or "plain", sampling)]
    (`on_engine`: called with the engine before any request is added)."""
    engine = make_engine(model_dir, async_scheduling=overlap, **config)
    if on_engine is not None:
        on_engine(engine)
    collector = Collector()
    for name, messages, schema, sampling in requests:
        grammar = None if schema == "plain" else _grammar(schema)
        collector.add(engine, plan_request(model_dir, messages, name, sampling.pop("max_tokens", MAX_TOKENS),
                                           grammar=grammar, **sampling))
    run_until_done(engine, collector)
    return {n: (collector.tokens(n), collector.finish_reason(n)) for n in collector.events}, engine


def _decoded(model_dir, tokens) -> str:
    from tests.support.reference import load_processor

    return load_processor(model_dir).tokenizer.decode(tokens, skip_special_tokens=True)


def test_greedy_tokens_equal_transformers_with_the_same_mask_beside_plain_rows(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    cases = {
        "invoice_text": (user(text("Extract the invoice as JSON.")), INVOICE),
        "invoice_image": (user(image(56, 84, 3), text("Extract the invoice.")), INVOICE),
        "chart_two_images": (user(image(56, 56, 4), image(42, 70, 5), text("Read the chart.")), CHART),
        "any_object": (user(text("Answer in JSON.")), None),
    }
    plain = user(text("Tell me a story about a cat."))
    requests = [(n, m, s, {}) for n, (m, s) in cases.items()] + [("plain", plain, "plain", {"max_tokens": 12})]
    for overlap in (False, True):
        out, engine = _run(model_dir, [(n, m, s, dict(x)) for n, m, s, x in requests], overlap)
        assert engine.overlap is overlap
        for name, (messages, schema) in cases.items():
            tokens, reason = out[name]
            assert tokens == reference_constrained(model_dir, messages, MAX_TOKENS, schema), name
            assert reason == "stop", name
            value = json.loads(_decoded(model_dir, tokens))
            if schema is not None:
                jsonschema.validate(value, schema)
            else:
                assert isinstance(value, dict)
        alone, _ = _run(model_dir, [("plain", plain, "plain", {"max_tokens": 12})])
        assert out["plain"] == alone["plain"]  # a plain row beside constrained ones is unchanged


def _form_prompts() -> dict[str, list[dict]]:
    return {"text": user(text("Fill in the form.")),
            "one_image": user(image(56, 56, 31), text("Fill in the form.")),
            "two_images": user(image(56, 42, 32), image(42, 70, 33), text("Fill in the form from both."))}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schemas=st.lists(BOUNDED, min_size=3, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_every_output_of_bounded_schemas_is_valid_greedy_or_sampled(tiny_models, schemas, seed):
    """Each schema is decoded after a text prompt, one image and two images, greedy and sampled,
    in one batch: every output validates and ends with `stop`."""
    model_dir = tiny_models["qwen2_vl"]
    requests = []
    for i, schema in enumerate(schemas):
        for prompt, messages in _form_prompts().items():
            requests.append((f"{prompt}_greedy_{i}", messages, schema, {}))
            requests.append((f"{prompt}_sampled_{i}", messages, schema,
                             {"temperature": 1.0, "top_p": 0.95, "seed": seed + i}))
    out, engine = _run(model_dir, requests, overlap=bool(seed % 2))
    for name, _, schema, _ in requests:
        tokens, reason = out[name]
        assert reason == "stop", (name, schema, _decoded(model_dir, tokens))
        jsonschema.validate(json.loads(_decoded(model_dir, tokens)), schema)
    assert engine.grammar_compiler.stats.cache_hits >= 3 * 5  # each schema compiled once for its six rows


@pytest.mark.parametrize("schema, message", [
    ({"type": "objectx"}, "Invalid type: objectx"),
    ({"type": "string", "pattern": "(unclosed"}, "unclosed group"),
])
def test_a_bad_schema_is_an_invalid_request_naming_the_problem(tiny_models, schema, message):
    engine = make_engine(tiny_models["qwen2_vl"], grammar_compile_timeout_s=7.5)
    assert engine.grammars.timeout_s == 7.5  # the engine's deadline (`engine.grammar_compile_timeout_s`)
    with pytest.raises(InvalidRequest, match="response_format: the JSON schema cannot be compiled") as err:
        engine.grammars.compile(_grammar(schema))
    assert message in str(err.value)


def test_a_compile_that_ends_at_once_settles_without_a_deadlock(tiny_models):
    """A bad schema fails in microseconds, sometimes before `submit` has returned: with an executor
    that compiles inline (the extreme of that race) a bad schema is refused and a good one compiles,
    each within seconds, and nothing stays marked as compiling. (A done-callback added under the
    compiler's lock ran inline on a finished future and took the lock again: CI hung there.)"""
    import threading
    from concurrent.futures import Future

    from transformers import AutoTokenizer

    class Inline:
        def submit(self, fn, *args):
            fn(*args)
            return Future()

        def shutdown(self, **_):
            pass

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"]), 1000, [0])
    compiler._pool = Inline()
    outcome = {}

    def run():
        try:
            compiler.compile(_grammar({"type": "objectx"}))
        except InvalidRequest as e:
            outcome["bad"] = str(e)
        outcome["good"] = compiler.compile(_grammar(CHART))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the compiler deadlocked"
    assert "Invalid type: objectx" in outcome["bad"] and outcome["good"] is compiler.compile(_grammar(CHART))
    assert not compiler._compiling


def test_the_compiled_grammar_is_cached_by_schema_text_and_compiled_off_the_caller(tiny_models):
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"]), 1000, [0], cache_size=2)
    a, b, c = (_grammar({**CHART, "title": str(i)}) for i in range(3))
    first = compiler.submit(a)
    assert first.result(timeout=30) is compiler.compile(a)
    assert (compiler.stats.compiles, compiler.stats.cache_hits) == (1, 1)
    compiler.compile(b), compiler.compile(c)  # a is evicted (LRU of 2)
    compiler.compile(a)
    assert compiler.stats.compiles == 4
    compiler.timeout_s = 0.0
    with pytest.raises(InvalidRequest, match="took longer than 0 s to compile"):
        compiler.compile(_grammar({**INVOICE, "title": "new"}))
    compiler.shutdown()


def test_a_slow_compile_does_not_hold_up_another_schemas(tiny_models, monkeypatch):
    """A compile past its deadline runs on (a native compile cannot be interrupted): a request
    with another schema still gets its grammar in time."""
    import threading

    from transformers import AutoTokenizer

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"]), 1000, [0], timeout_s=5.0)
    slow, quick = _grammar({**CHART, "title": "slow"}), _grammar({**CHART, "title": "quick"})
    release, compile_ = threading.Event(), compiler._compile

    def held_compile(grammar):
        if grammar == slow:
            release.wait(30)
        return compile_(grammar)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    running = compiler.submit(slow)
    try:
        assert compiler.compile(quick) is not None  # one thread would wait here past the deadline
        assert not running.done()
    finally:
        release.set()
    assert running.result(timeout=30) is compiler.compile(slow) is not None  # then cached
    assert compiler.stats.compiles == 2
    compiler.shutdown()


def test_a_resumed_stream_rebuilds_its_matcher_from_the_tokens_it_sent(tiny_models):
    """Failover resubmits prompt + sent tokens with `grammar_prefix`: the rest equals the
    uninterrupted output, and a prefix the grammar refuses is an invalid request."""
    import dataclasses

    model_dir = tiny_models["qwen2_vl"]
    messages = user(image(56, 56, 7), text("Extract the invoice."))
    full, _ = _run(model_dir, [("full", messages, INVOICE, {})])
    tokens = full["full"][0]
    sent = tokens[:9]
    engine = make_engine(model_dir)
    request = plan_request(model_dir, messages, "resumed", MAX_TOKENS - len(sent), grammar=_grammar(INVOICE))
    request = dataclasses.replace(request, prompt_token_ids=request.prompt_token_ids + tuple(sent),
                                  grammar_prefix=len(sent))
    collector = Collector()
    collector.add(engine, request)
    run_until_done(engine, collector)
    assert sent + collector.tokens("resumed") == tokens
    with pytest.raises(InvalidRequest, match="do not follow the response_format grammar"):
        Matcher(engine.grammars.compile(_grammar(INVOICE)), tokens[1:5])


def test_a_row_whose_grammar_allows_no_sampled_token_ends_with_an_error(tiny_models):
    """The step's mask left nothing (a grammar this vocabulary cannot continue): the sampled token
    is refused by the matcher and the request ends with an error, not a hang."""
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir)
    collector = Collector()
    collector.add(engine, plan_request(model_dir, user(text("JSON please")), "r", 8, grammar=_grammar(CHART)))
    engine.step()  # prefill
    seq = engine._by_id["r"]
    engine._postprocess(seq, next(iter(engine.model.eos_token_ids)), None, None)  # EOS where "{" must come
    event = collector.events["r"][-1]
    assert event.finish_reason == "error" and "the grammar allows none" in str(event.error)


def test_n_choices_interleave_and_a_stop_string_ends_only_its_choice(tiny_models):
    """`Generation` over the events of n = 2 choices as the LLM deployment interleaves them: each
    choice is detokenized on its own, a stop string in one ends that choice only, and the stream
    is cancelled once both have ended; a replica lost after tokens were sent resumes each
    unfinished choice from its own tokens (`failover.ChoiceStreams`)."""
    import asyncio

    from transformers import AutoTokenizer

    from deployments.core.generation import Generation
    from llm_service.sampling import SamplingParams
    from llm_service.engine.sequence import TokenEvent
    from tests.support.core_fakes import FakeStream

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])
    a = tokenizer.encode("red fish", add_special_tokens=False)
    b = tokenizer.encode("blue STOP cat", add_special_tokens=False)
    events = [TokenEvent(t, None, choice=0) for t in a[:1]] + [TokenEvent(t, None, choice=1) for t in b]
    events += [TokenEvent(b[0], "length", choice=1)]  # after the stop string: ignored
    events += [TokenEvent(t, None, choice=0) for t in a[1:]] + [TokenEvent(None, "stop", choice=0)]

    async def run():
        stream = FakeStream(iter(events[1:]))
        gen = Generation("r", None, SamplingParams(16), ("STOP",), stream, events[0], tokenizer, n=2)
        deltas = [d async for d in gen.deltas()]
        return deltas, stream

    deltas, stream = asyncio.run(run())
    text = {i: "".join(d.text for d in deltas if d.index == i) for i in (0, 1)}
    finish = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert text == {0: "red fish", 1: "blue "} and finish == {0: "stop", 1: "stop"}
    assert stream.cancelled

    async def lost_after_a_token():
        asked = []

        async def resume(error, sent):  # failover.Failover.resume's contract: each unfinished choice's tokens
            asked.append(sent)
            raise error

        stream = FakeStream(iter([TokenEvent(b[0], None, choice=1), RuntimeError("replica lost")]))
        gen = Generation("r", None, SamplingParams(16), (), stream, TokenEvent(a[0], None), tokenizer, resume, n=2)
        try:
            return [d async for d in gen.deltas()]
        finally:
            assert asked == [{0: (a[0],), 1: (b[0],)}]

    with pytest.raises(RuntimeError, match="replica lost"):
        asyncio.run(lost_after_a_token())


def test_constrained_rows_survive_preemption_and_recompute(tiny_models):
    """On a pool too small for the batch, sequences are preempted and recomputed: their matchers
    stay where their tokens are, and the outputs equal those of a roomy pool."""
    model_dir = tiny_models["qwen2_vl"]
    requests = [(f"r{i}", user(text(f"Chart number {i}: " + "read it " * (2 + 2 * i))), CHART, {"max_tokens": 80})
                for i in range(6)]
    roomy, _ = _run(model_dir, [(n, m, s, dict(x)) for n, m, s, x in requests])
    for overlap in (False, True):
        tight, engine = _run(model_dir, [(n, m, s, dict(x)) for n, m, s, x in requests], overlap,
                             num_kv_blocks=20, block_size=8, max_num_batched_tokens=32)
        assert engine.scheduler.num_preemptions > 0
        assert tight == roomy


def _record_order(engine, events: list) -> None:
    """Log each forward launched (`("run",)`) and each step read (`("read", its _Launched)`) and
    launched (`("launched", its _Launched)`) into `events`, in the order they happen."""
    run, read, launch = engine.runner.run, engine._read, engine._launch

    def recording_run(step):
        events.append(("run",))
        return run(step)

    def recording_read(launched):
        events.append(("read", launched))
        return read(launched)

    def recording_launch(scheduled):
        launched = launch(scheduled)
        events.append(("launched", launched))
        return launched

    engine.runner.run, engine._read, engine._launch = recording_run, recording_read, recording_launch


def _read_before_the_next_forward(events: list) -> int:
    """How many steps were read before the forward of the step after them was launched (a step
    followed by no other forward, or never read, is not counted)."""
    late = 0
    for i, (kind, *what) in enumerate(events):
        if kind != "launched" or what[0] is None:
            continue
        next_run = next((j for j in range(i + 1, len(events)) if events[j][0] == "run"), None)
        read_at = next((j for j in range(i + 1, len(events)) if events[j][0] == "read" and events[j][1] is what[0]),
                       None)  # None: the requests ended before it was read (its ids are all discarded)
        late += None not in (next_run, read_at) and read_at < next_run
    return late


SHORT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}  # complete after a few tokens, while the other rows go on


@pytest.mark.parametrize("case", ["mixed", "alone"])
def test_overlapped_steps_with_constrained_rows_launch_the_next_forward_before_reading(tiny_models, case):
    """With overlap on, a step with constrained rows still launches step N+1's forward before it
    reads step N's sampled ids (then fills the masks and samples): in a batch of constrained rows
    (one whose grammar completes early, two sampled choices of one prompt) beside plain rows, and
    a constrained row alone. The tokens equal sequential steps'."""
    model_dir = tiny_models["qwen2_vl"]
    invoice = user(text("Extract the invoice as JSON."))
    if case == "alone":
        requests = [("invoice", invoice, INVOICE, {})]
    else:
        requests = [("invoice", invoice, INVOICE, {}), ("short", user(text("Is it ok?")), SHORT, {}),
                    ("plain", user(text("Tell me a story about a cat.")), "plain", {"max_tokens": 40}),
                    ("sampled_plain", user(text("Say anything.")), "plain",
                     {"max_tokens": 30, "temperature": 1.0, "seed": 3})]
        requests += [(f"choice_{i}", user(text("Read the chart.")), CHART, {"temperature": 1.0, "seed": 7 + i})
                     for i in range(2)]
    events: list = []
    out, _ = _run(model_dir, [(n, m, s, dict(x)) for n, m, s, x in requests], True,
                  lambda e: _record_order(e, events))
    sequential, _ = _run(model_dir, [(n, m, s, dict(x)) for n, m, s, x in requests], False)
    assert out == sequential
    steps = sum(kind == "launched" and what[0] is not None for kind, *what in events)
    assert steps > 20
    assert _read_before_the_next_forward(events) == 0
    for name, messages, schema, _ in requests:
        tokens, reason = out[name]
        if schema != "plain":
            assert reason == "stop", name
            jsonschema.validate(json.loads(_decoded(model_dir, tokens)), schema)
    if case == "mixed":
        assert len(out["short"][0]) < len(out["plain"][0]) - 10  # it completed while the others went on


def test_a_grammar_refused_in_overlapped_steps_ends_only_its_row(tiny_models):
    """Overlap on: a row whose matcher refuses its token at step N ends with an error; it was in
    step N+1 already (its token there is discarded, with no mask), and the rows beside it, sampled
    and greedy, constrained and plain, go on to valid ends."""
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir, async_scheduling=True)
    collector = Collector()
    for name, schema, sampling in (("refused", INVOICE, {}), ("chart", CHART, {"temperature": 1.0, "seed": 1}),
                                   ("plain", "plain", {"temperature": 1.0, "seed": 2})):
        grammar = None if schema == "plain" else _grammar(schema)
        collector.add(engine, plan_request(model_dir, user(text(f"{name}, as JSON")), name, 60 if grammar is None
                                           else MAX_TOKENS, grammar=grammar, **sampling))
    refused = next(s for s in engine._new if s.request_id == "refused")
    accepted = []

    def accept(token, real=refused.matcher.accept):
        accepted.append(token)
        return len(accepted) < 6 and real(token)

    refused.matcher.accept = accept
    run_until_done(engine, collector)
    event = collector.events["refused"][-1]
    assert event.finish_reason == "error" and "the grammar allows none" in str(event.error)
    assert len(collector.tokens("refused")) == 5 and len(accepted) == 6  # the token of step N+1 never reached it
    assert collector.finish_reason("chart") == "stop" and collector.finish_reason("plain") == "length"
    jsonschema.validate(json.loads(_decoded(model_dir, collector.tokens("chart"))), CHART)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_with_penalties_top_k_and_logprobs(tiny_models, overlap):
    """A grammar composes with `repetition_penalty`, `top_k` and `logprobs`, greedy and sampled:
    the output is valid, and every token comes with its (finite) logprob and its top ones."""
    import math

    model_dir = tiny_models["qwen2_vl"]
    settings = {"greedy": {"repetition_penalty": 1.3, "logprobs": 3},
                "sampled": {"temperature": 1.0, "top_k": 5, "repetition_penalty": 1.3, "logprobs": 3, "seed": 11}}
    engine = make_engine(model_dir, async_scheduling=overlap)
    collector = Collector()
    for name, sampling in settings.items():
        collector.add(engine, plan_request(model_dir, user(text("Read the chart.")), name, MAX_TOKENS,
                                           grammar=_grammar(CHART), **sampling))
    run_until_done(engine, collector)
    for name in settings:
        assert collector.finish_reason(name) == "stop", name
        jsonschema.validate(json.loads(_decoded(model_dir, collector.tokens(name))), CHART)
        sent = [e for e in collector.events[name] if e.token_id is not None]
        assert sent and all(e.logprob is not None and math.isfinite(e.logprob) and len(e.top_logprobs) == 3
                            for e in sent), [(e.logprob, e.top_logprobs) for e in sent][:3]


def test_a_token_the_grammar_forbids_has_a_json_logprob_over_http():
    """Under a grammar the logprobs come from the masked logits: the top ones may hold tokens the
    mask forbids (-inf), which the OpenAI answer reports as -9999 (as vLLM), valid JSON."""
    from types import SimpleNamespace

    from deployments.api.openai_api import _logprob_entry
    from deployments.core.generation import Delta

    gen = SimpleNamespace(token_text=lambda t: f"t{t}")
    entry = _logprob_entry(gen, Delta("t1", 1, None, 0.0, ((1, 0.0), (0, float("-inf")))))
    assert json.loads(json.dumps(entry, allow_nan=False))["top_logprobs"][1]["logprob"] == -9999.0


def test_the_finer_token_slices_give_the_default_slices_masks(tiny_models):
    """`SLICES` only speeds the fill: along a document of the invoice schema (strings near their
    `maxLength` included) each mask equals the one llguidance's default slices give."""
    import llguidance.hf
    import torch
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from transformers import AutoTokenizer

    from mmserve.loadgen.grammar import SCHEMA, dumps, instance

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = compiler.compile(_grammar(SCHEMA))
    default = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])
    ours, theirs = Matcher(compiled), llguidance.LLMatcher(default, compiled.text, log_level=0)
    a, b = allocate_token_bitmask(1, len(tokenizer)), allocate_token_bitmask(1, len(tokenizer))
    ids = tokenizer.encode(dumps(instance(1)), add_special_tokens=False)
    for token in ids:
        ours.fill(a, 0)
        fill_next_token_bitmask(theirs, b, 0)
        assert torch.equal(a, b)
        assert ours.accept(token) and theirs.consume_token(token)
    assert ours.complete and len(ids) > 100
    compiler.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_masks_added_as_values_forbid_exactly_the_bitmasks_zero_bits(dtype, monkeypatch):
    """On the CPU a mask is added (0 or -inf per token, from a byte table): each row equals the
    logits with `masked_fill` of the bitmask's zero bits, whole batches and some rows alike."""
    import torch

    from llm_service.grammar import StepMasks

    class Bits:  # a matcher whose next tokens are fixed random bits
        def __init__(self, words):
            self.words = words

        def fill(self, bitmask, row):
            bitmask[row] = self.words

    vocab, gen = 1000, torch.Generator().manual_seed(0)  # 1000: the last word is part padding
    words = [torch.randint(-2**31, 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=gen)
             for _ in range(3)]
    logits = torch.randn(4, vocab, generator=gen).to(getattr(torch, dtype))
    masks = StepMasks(vocab)
    monkeypatch.setattr(Matcher, "fill_all",
                        staticmethod(lambda _, ms, bitmask: [m.fill(bitmask, j) for j, m in enumerate(ms)]))
    for rows in ([2], [0, 1, 2, 3], [1, 3]):
        got = logits.clone()
        masks.apply(got, [(i, Bits(words[k % 3])) for k, i in enumerate(rows)])
        want = logits.clone()
        for k, i in enumerate(rows):
            word = [int(w) for w in words[k % 3]]
            allowed = torch.tensor([(word[t // 32] >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
            want[i] = want[i].masked_fill(~allowed, float("-inf"))
        assert torch.equal(got, want), rows


def test_a_free_matcher_takes_exactly_the_tokens_its_mask_allows(tiny_models):
    """`Matcher.takes` (the check that spares a greedy CPU row its mask) agrees with the filled mask
    on every token wherever the matcher is `free`, at every step of documents of the invoice
    schema; where it is not (bytes forced, or a stop token allowed), the two differ somewhere."""
    import torch
    from llguidance.torch import allocate_token_bitmask
    from transformers import AutoTokenizer

    from mmserve.loadgen.grammar import SCHEMA, dumps, instance

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    compiled = compiler.compile(_grammar(SCHEMA))
    mask = allocate_token_bitmask(1, vocab)
    free = wide = differ = 0
    for seed in (2, 3):
        matcher = Matcher(compiled)
        for token in tokenizer.encode(dumps(instance(seed)), add_special_tokens=False) + [tokenizer.eos_token_id]:
            matcher.fill(mask, 0)
            bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].tolist()
            says = [int(matcher.takes(t)) for t in range(vocab)]
            if matcher.free:
                assert says == bits
                free += 1
                wide += sum(bits) > vocab // 2  # inside a string
            else:
                differ += says != bits
            assert matcher.accept(token)
    assert free > 10 and wide > 10 and differ > 10
    compiler.shutdown()


def test_greedy_cpu_rows_corrected_after_sampling_equal_the_masked_argmax(monkeypatch):
    """`StepMasks.correct` gives each row the masked argmax (the first highest allowed logit), and
    fills a mask only where the matcher alone cannot say which that is: a sampled token the grammar
    takes stays; a free row whose first allowed logit is among its highest gets it; a row with
    bytes forced, no allowed token among its highest, or equals beyond them is masked, whether it
    allows a few words of tokens or many; a row allowing nothing keeps its token."""
    import torch

    import llm_service.grammar as grammar
    from llm_service.grammar import StepMasks

    filled = []

    class Bits:  # a matcher whose next tokens are fixed bits
        def __init__(self, words, free=True):
            self.words, self.free = words, free

        def takes(self, token):
            return bool((int(self.words[token // 32]) >> (token % 32)) & 1)

        def fill(self, bitmask, row):
            filled.append(self)
            bitmask[row] = self.words

    def bit(words, token):
        return bool((int(words[token // 32]) >> (token % 32)) & 1)

    monkeypatch.setattr(Matcher, "fill_all",
                        staticmethod(lambda _, ms, bitmask: [m.fill(bitmask, j) for j, m in enumerate(ms)]))
    monkeypatch.setattr(grammar, "SPARSE_WORDS", 4)
    monkeypatch.setattr(grammar, "CANDIDATES", 4)
    vocab, gen = 1000, torch.Generator().manual_seed(0)  # 1000: the last word is part padding
    words = (vocab + 31) // 32
    logits = torch.randn(9, vocab, generator=gen).round(decimals=1)  # ties within rows
    logits[3, [500, 200, 300]] = 50.0  # row 3: equal highest logits, 200 forbidden: 300 wins, whatever topk's order
    logits[8, [700, 500, 900, 300, 200, 10]] = 50.0  # row 8: more equals than candidates, 10 forbidden: 200 wins
    dense = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    sparse = torch.zeros(words, dtype=torch.int32)
    # bit 8 of word 31: id 1000, padding
    sparse[[3, 17, 31]] = torch.tensor([0x00F0, -2**31, 0x01F1], dtype=torch.int32)
    logits[2, 30 * 32:] = 9.0  # row 2: ties at its highest allowed logits (992, 996-999), the first wins
    def forbid(words, ids):
        words = words.clone()
        for t in ids:
            words[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 2**31 - 1
        return words

    rows = {0: Bits(forbid(dense, [int(logits[0].argmax())])), 1: Bits(sparse), 2: Bits(sparse),
            4: Bits(torch.zeros(words, dtype=torch.int32)),
            5: Bits(dense), 6: Bits(dense, free=False),
            7: Bits(forbid(dense, logits[7].topk(4).indices.tolist())),  # row 7: its four highest forbidden
            3: Bits(forbid(torch.full((words,), -1, dtype=torch.int32), [200])),
            8: Bits(forbid(torch.full((words,), -1, dtype=torch.int32), [10]))}
    tokens = logits.argmax(-1)
    keep = next(t for t in range(vocab) if bit(dense, t))
    logits[5, keep] = 99.0  # row 5's own argmax is allowed
    tokens[5] = keep
    want = tokens.clone()
    for i, m in rows.items():
        allowed = ((m.words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()
        if allowed.any():
            want[i] = logits[i].masked_fill(~allowed, float("-inf")).argmax()
    assert want[0] != tokens[0] and int(want[0]) in logits[0].topk(4).indices
    assert want[5] == keep and want[2] == 992 and want[7] != tokens[7] and want[3] == 300 and want[8] == 200
    got = tokens.clone()
    StepMasks(vocab).correct(logits.clone(), got, list(rows.items()))
    assert torch.equal(got, want)
    assert filled == [rows[i] for i in (1, 2, 4, 6, 7, 8)]  # not rows 0, 3 and 5


def test_the_engine_fills_masks_on_the_threads_it_is_told(tiny_models):
    """`engine.grammar_threads`: the mask fill's threads and the compiler's roots per schema (one
    grammar's rows fill in parallel up to it); unset, the replica's torch threads. The tokens are
    the same either way, as the rows' masks are."""
    import torch

    requests = [(f"r{i}", user(text(f"Chart number {i}")), CHART, {"max_tokens": 10}) for i in range(3)]
    told, engine = _run(tiny_models["qwen2_vl"], [(n, m, s, dict(x)) for n, m, s, x in requests], grammar_threads=3)
    assert engine.masks.threads == 3 and engine.grammars.max_roots == 3
    # (on CPU a greedy row is filled only where its sampled token is refused)
    assert engine.masks.fill_rows > 0 and engine.masks.fill_s > 0
    default, engine = _run(tiny_models["qwen2_vl"], [(n, m, s, dict(x)) for n, m, s, x in requests])
    assert engine.masks.threads == torch.get_num_threads()
    assert told == default
