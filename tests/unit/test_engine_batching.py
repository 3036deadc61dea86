"""The continuous-batching engine: concurrency equivalence, one forward per step, paged KV, preemption, abort."""

import pytest
import torch

from mmserve.errors import InvalidRequest
from tests.support.engine_support import (
    Collector, make_engine, mixed_cases, plan_request, reference_tokens, run_until_done,
)

MAX_TOKENS = 8


def _max_tokens(i: int) -> int:
    return MAX_TOKENS - (i % 3) * 2  # different output lengths: requests finish at different steps


def _submit_mixed(engine, model_dir, collector):
    for i, (name, messages) in enumerate(mixed_cases()):
        collector.add(engine, plan_request(model_dir, messages, f"{i}-{name}", _max_tokens(i)))


def test_concurrent_mixed_requests_equal_monolithic(model_dir):
    """18 concurrent requests (text, images, video, long prompt), chunked prefills mixed with decodes:
    each gets exactly the greedy tokens of transformers' generate run alone."""
    engine = make_engine(model_dir, max_num_batched_tokens=512, max_num_seqs=32)
    collector = Collector()
    _submit_mixed(engine, model_dir, collector)
    assert len(collector.events) >= 16
    max_batch = 0
    while not collector.all_done():
        out_running = len(engine.scheduler.running)
        engine.step()
        max_batch = max(max_batch, out_running)
    assert max_batch >= 8  # they really ran together
    for i, (name, _) in enumerate(mixed_cases()):
        expected = reference_tokens(model_dir, i, _max_tokens(i))
        assert collector.tokens(f"{i}-{name}") == expected, name
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_each_step_is_one_forward_over_all_scheduled_tokens(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir, max_num_batched_tokens=64)
    calls = []
    hook = engine.model.modules.decoder.register_forward_hook(lambda m, a, kw, out: calls.append(kw["inputs_embeds"].shape[1]), with_kwargs=True)
    try:
        collector = Collector()
        for i in range(6):
            name, messages = mixed_cases()[i]
            collector.add(engine, plan_request(model_dir, messages, name, 4))
        multi = 0
        while not collector.all_done():
            engine._admit()
            before = len(calls)
            scheduled = []
            original = engine.scheduler.schedule

            def spy():
                out = original()
                scheduled.append(out)
                return out

            engine.scheduler.schedule = spy
            engine.step()
            engine.scheduler.schedule = original
            if scheduled and scheduled[0].scheduled:
                assert len(calls) == before + 1  # exactly one decoder forward per step
                assert calls[-1] == scheduled[0].num_tokens  # packed: every scheduled token, no padding
                assert scheduled[0].num_tokens <= 64
                multi += len(scheduled[0].scheduled) > 1
        assert multi > 0
        assert engine.num_forwards == engine.num_steps
    finally:
        hook.remove()


def test_kv_is_read_from_the_block_pool(tiny_models):
    """Overwriting one request's blocks in the pool changes its next tokens and no one else's."""
    model_dir = tiny_models["qwen2_vl"]
    msgs = [mixed_cases()[1][1], mixed_cases()[6][1]]  # one image, one text

    def run(corrupt: bool):
        engine = make_engine(model_dir)
        collector = Collector()
        for i, m in enumerate(msgs):
            collector.add(engine, plan_request(model_dir, m, f"r{i}", 10, ignore_eos=True))
        engine.step()  # both prefilled, one token each
        table = list(engine.scheduler.running[0].block_table)
        pool = engine.runner.kv_pool
        assert pool[:, :, table].abs().sum() > 0  # its K/V were written into its blocks
        if corrupt:
            pool[:, :, table] = torch.randn_like(pool[:, :, table])
        run_until_done(engine, collector)
        return collector.tokens("r0"), collector.tokens("r1")

    clean, corrupted = run(False), run(True)
    assert clean[0] != corrupted[0]
    assert clean[1] == corrupted[1]


def test_kv_exhaustion_preempts_and_completes(tiny_models):
    model_dir = tiny_models["qwen2_5_vl"]
    # 12 blocks of 16 tokens: the long prompt alone takes most of it
    engine = make_engine(model_dir, num_kv_blocks=12, block_size=16, max_num_batched_tokens=128)
    collector = Collector()
    picks = [0, 1, 3, 6, 7, 8, 9, 10, 11, 12]
    for i in picks:
        name, messages = mixed_cases()[i]
        collector.add(engine, plan_request(model_dir, messages, name, 12))
    run_until_done(engine, collector)
    assert engine.scheduler.num_preemptions > 0
    for i in picks:
        name, _ = mixed_cases()[i]
        assert collector.tokens(name) == reference_tokens(model_dir, i, 12), name
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks


def test_abort_frees_every_block(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir, max_num_batched_tokens=256)
    collector = Collector()
    for i in range(8):
        name, messages = mixed_cases()[i]
        collector.add(engine, plan_request(model_dir, messages, name, 50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.blocks.num_used_blocks > 0
    for name in collector.events:
        engine.abort(name)
    engine.step()
    assert all(collector.finish_reason(n) == "abort" for n in collector.events)
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_prompt_larger_than_pool_is_an_error_not_a_crash(tiny_models):
    engine = make_engine(tiny_models["qwen2_vl"], num_kv_blocks=2, block_size=16)
    collector = Collector()
    collector.add(engine, plan_request(tiny_models["qwen2_vl"], mixed_cases()[5][1], "long", 4))
    collector.add(engine, plan_request(tiny_models["qwen2_vl"], mixed_cases()[6][1], "short", 4))
    run_until_done(engine, collector)
    rejected = collector.events["long"][-1].error
    assert collector.finish_reason("long") == "error" and isinstance(rejected, InvalidRequest)
    assert "KV cache capacity" in str(rejected)
    assert collector.finish_reason("short") in ("stop", "length")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu_greedy(tiny_models):
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel

    model_dir = tiny_models["qwen2_vl"]
    gpu = LLMEngine(LanguageModel(model_dir, dtype="float32", device="cuda"), EngineConfig(num_kv_blocks=256))
    cpu = LLMEngine(LanguageModel(model_dir, dtype="float32"), EngineConfig(num_kv_blocks=256))
    results = []
    for engine in (gpu, cpu):
        collector = Collector()
        for i in range(8):
            name, messages = mixed_cases()[i]
            collector.add(engine, plan_request(model_dir, messages, name, 8))
        run_until_done(engine, collector)
        results.append({n: collector.tokens(n) for n in collector.events})
    assert results[0] == results[1]
