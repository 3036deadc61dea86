"""A grammar compiled once serves every sequence of every request with its schema: matchers are
copies of the compiled grammar's roots (counted compiles), made off the event loop under the
compile deadline; the grammar engine's faults are refused in sentences."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import pytest

from llm_service.grammar import GrammarCompiler, Matcher
from llm_service.sampling import Grammar
from mmserve.errors import InvalidRequest
from mmserve.request.tools import JSON_FORMAT
from tests.support.schemas import CHART, symbol_overflow_tools


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2_vl"])


def _grammar(schema: dict) -> Grammar:
    return Grammar("json_schema", json.dumps(schema))


@pytest.fixture
def built(monkeypatch):
    """How many llguidance matchers were built from a grammar's text (each one a whole compile)."""
    import llguidance

    real, count = llguidance.LLMatcher, [0]

    class Counting:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        validate_grammar = staticmethod(real.validate_grammar)

        def __new__(cls, *args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    return count


def test_sixteen_sequences_and_the_next_request_start_from_one_compile(tokenizer, built):
    """n = 16 took 28 s when every sequence compiled its schema anew on the LLM replica's loop. The
    copies each keep their own place, and mask as a fresh compile does."""
    import llguidance
    import torch
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_roots=1)
    grammar = _grammar(CHART)
    first = [Matcher(compiler.compile(grammar)) for _ in range(16)]
    again = [Matcher(compiler.compile(grammar)) for _ in range(16)]
    assert built[0] == 1 and compiler.stats.compiles == 1
    for token in tokenizer.encode('{"title":"ab', add_special_tokens=False):
        assert first[0].accept(token) and again[0].accept(token)
    reference = llguidance.LLMatcher(compiler.tokenizer, compiler.compile(grammar).text, log_level=0)
    masks = allocate_token_bitmask(2, len(tokenizer))
    first[1].fill(masks, 0)
    fill_next_token_bitmask(reference, masks, 1)
    assert torch.equal(masks[0], masks[1])  # the copies walked beside it did not move it
    compiler.shutdown()


def test_the_rows_of_one_grammar_get_independent_roots_up_to_max_roots(tokenizer):
    """Copies of one root fill their masks one at a time (a shared lexer lock): new rows get roots
    enough for them and the rows running to fill in parallel, up to `max_roots` (one compile
    each), before they are copied, and spread over them. Dropped copies are released."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_roots=3)
    grammar = _grammar(CHART)
    held = asyncio.run(compiler.matchers(grammar, 2))
    compiled = compiler.compile(grammar)
    assert compiled.num_roots == 2 and compiler.stats.compiles == 2
    assert [root.live for root in compiled._roots] == [1, 1]
    more = asyncio.run(compiler.matchers(grammar, 8))  # 10 rows: a third root, no more
    assert compiled.num_roots == 3 and compiler.stats.compiles == 3
    assert sorted(root.live for root in compiled._roots) == [3, 3, 4]
    one_by_one = [compiler.copies(compiled, 1)[0] for _ in range(2)]  # the engine's own requests
    assert compiler.stats.compiles == 3 and sum(root.live for root in compiled._roots) == 12
    del held, more, one_by_one
    gc.collect()  # the copier's finished futures held the lists
    assert [root.live for root in compiled._roots] == [0, 0, 0]
    compiler.shutdown()


def test_the_deadline_covers_the_compile_and_the_matchers_off_the_event_loop(tokenizer, monkeypatch):
    """A request waits for its grammar and its n matchers on the event loop, which keeps running
    (a 1 ms ticker ticks), and is refused at the compile deadline whichever of them is slow."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout_s=0.5)
    release = threading.Event()
    compile_, copies = compiler._compile, compiler._copy

    def held(run):
        def wait(*args):
            release.wait(30)
            return run(*args)
        return wait

    async def refused(grammar: Grammar) -> tuple[float, int]:
        ticks, start = 0, time.perf_counter()
        task = asyncio.ensure_future(compiler.matchers(grammar, 16))
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        with pytest.raises(InvalidRequest, match="took longer than 0.5 s to compile"):
            task.result()
        return time.perf_counter() - start, ticks

    try:
        monkeypatch.setattr(compiler, "_compile", held(compile_))
        seconds, ticks = asyncio.run(refused(_grammar({**CHART, "title": "slow compile"})))
        assert 0.4 < seconds < 5 and ticks > 50, (seconds, ticks)
        monkeypatch.setattr(compiler, "_compile", compile_)
        monkeypatch.setattr(compiler, "_copy", held(copies))
        seconds, ticks = asyncio.run(refused(_grammar({**CHART, "title": "slow matchers"})))
        assert 0.4 < seconds < 5 and ticks > 50, (seconds, ticks)
    finally:
        release.set()
    compiler.shutdown()


def test_a_grammar_overflowing_the_engines_symbol_table_is_refused_in_a_sentence(tokenizer):
    """llguidance panics past 65,535 grammar symbols: the request is refused saying so, without
    the panic's text or backtrace."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout_s=120)
    with pytest.raises(InvalidRequest) as refused:
        compiler.compile(Grammar("lark", JSON_FORMAT.grammar(symbol_overflow_tools())))
    message = str(refused.value)
    assert message.startswith("tools: the functions' JSON schemas cannot be compiled: it is too large for the "
                              "grammar engine (over 65,535 grammar symbols)"), message
    assert "panic" not in message and "backtrace" not in message and "u16" not in message
    compiler.shutdown()
