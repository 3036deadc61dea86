"""The engine on hybrid language models (Gated-DeltaNet linear attention + full attention, state
slots beside the paged KV): greedy tokens == `transformers` generate (float64) under concurrent
mixed requests, chunked prefill, prefill mixed with decode in one step, preemption; slots freed at
once; startup sizing and settings.

Two models: MiniCPM-V 4.6's tiny checkpoint (`qwen3_5_text` LM, 4 layers 3:1) and a deeper
`qwen3_5_text` LM of other head shapes (8 layers 6:2, 3 value heads per key head, conv kernel 3),
built here deterministically in the MiniCPM-V shell (the engine loads LMs of registered families).
"""

import logging
import os

import pytest
import torch

from tests.support.engine_support import Collector, make_engine, mixed_cases, plan_request, reference_tokens, run_until_done
from tests.support.reference import load_reference, reference_generate

DEEP_TEXT = dict(num_hidden_layers=8, hidden_size=48, intermediate_size=96, linear_num_key_heads=2,
                 linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=3,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=12)


def _build_deep(out: str) -> str:
    """MiniCPM-V 4.6's tiny checkpoint with the deeper `qwen3_5_text` LM (same tokenizer, seed)."""
    from transformers import AutoModelForImageTextToText, GenerationConfig, MiniCPMV4_6Config

    from mmserve.tiny import minicpmv4_6 as tiny

    config, processor, eos_ids, init_seed = tiny.build("minicpmv4_6", 0)
    text = {**config.text_config.to_dict(), **DEEP_TEXT, "layer_types": None}
    config = MiniCPMV4_6Config(text_config=text, vision_config=config.vision_config.to_dict(),
                               insert_layer_id=config.insert_layer_id, image_token_id=config.image_token_id,
                               video_token_id=config.video_token_id)
    torch.manual_seed(init_seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=config.text_config.pad_token_id,
                                               do_sample=False)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def deep_dir(models_root) -> str:
    out = os.path.join(models_root, "qwen3_5_text_deep")
    return out if os.path.exists(os.path.join(out, "model.safetensors")) else _build_deep(out)


def _tell_me(i: int, growth: int = 11) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Tell me " * (3 + growth * i) + f"about {i}."}]}]


def _max_tokens(i: int) -> int:
    return 8 - (i % 3) * 2  # requests finish at different steps


def _run(engine, model_dir, prompts):
    """Submit every prompt at once and step to the end; returns the collector and, per step,
    (prefill chunks, decode tokens) scheduled."""
    collector, mix = Collector(), []
    for name, messages, max_tokens in prompts:
        collector.add(engine, plan_request(model_dir, messages, name, max_tokens))
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        mix.append((sum(s.seq.num_computed < s.seq.num_prompt_tokens for s in out.scheduled),
                    sum(s.seq.num_computed >= s.seq.num_prompt_tokens for s in out.scheduled)))
        return out

    engine.scheduler.schedule = spy
    run_until_done(engine, collector)
    return collector, mix


def _assert_all_freed(engine):
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks
    assert engine.scheduler.slots.num_free_slots == engine.scheduler.slots.num_slots


def test_deep_lm_concurrent_chunked_requests_equal_monolithic(deep_dir):
    _, model = load_reference(deep_dir)
    assert model.config.text_config.layer_types.count("full_attention") == 2  # 6 linear : 2 full
    prompts = [(f"t{i}", _tell_me(i), _max_tokens(i)) for i in range(8)]
    engine = make_engine(deep_dir, max_num_batched_tokens=40, max_num_seqs=16)
    collector, mix = _run(engine, deep_dir, prompts)
    assert any(prefills and decodes for prefills, decodes in mix)  # prefill chunks beside decode tokens
    for name, messages, max_tokens in prompts:
        assert collector.tokens(name) == reference_generate(deep_dir, messages, max_tokens), name
    _assert_all_freed(engine)


def test_deep_lm_preempted_by_a_tiny_pool_equals_monolithic(deep_dir):
    prompts = [(f"t{i}", _tell_me(i, growth=4), 10) for i in range(6)]  # 23 .. 83 prompt tokens
    engine = make_engine(deep_dir, num_kv_blocks=12, block_size=8, num_state_slots=4, max_num_batched_tokens=32)
    collector, _ = _run(engine, deep_dir, prompts)
    assert engine.scheduler.num_preemptions > 0
    for name, messages, max_tokens in prompts:
        assert collector.tokens(name) == reference_generate(deep_dir, messages, max_tokens), name
    _assert_all_freed(engine)


def test_minicpmv_concurrent_mixed_requests_equal_monolithic(minicpmv_dir):
    """17 concurrent requests (text, images with slices, videos; the 3.5k-token prompt is in the
    runtime tests), chunked prefill forced by a budget of 48 tokens."""
    cases = [(i, n, m) for i, (n, m) in enumerate(mixed_cases()) if n != "long_prompt"]
    engine = make_engine(minicpmv_dir, max_num_batched_tokens=48, max_num_seqs=32)
    collector, mix = _run(engine, minicpmv_dir, [(f"{i}-{n}", m, _max_tokens(i)) for i, n, m in cases])
    assert max(p + d for p, d in mix) >= 8 and any(p and d for p, d in mix)
    for i, name, _ in cases:
        assert collector.tokens(f"{i}-{name}") == reference_tokens(minicpmv_dir, i, _max_tokens(i)), name
    _assert_all_freed(engine)


def test_minicpmv_preemption_on_a_tiny_pool_equals_monolithic(minicpmv_dir):
    picks = [0, 1, 2, 3, 4, 8, 9, 12, 16]
    engine = make_engine(minicpmv_dir, num_kv_blocks=10, block_size=16, num_state_slots=3, max_num_batched_tokens=64)
    collector, _ = _run(engine, minicpmv_dir, [(mixed_cases()[i][0], mixed_cases()[i][1], 12) for i in picks])
    assert engine.scheduler.num_preemptions > 0
    for i in picks:
        name = mixed_cases()[i][0]
        assert collector.tokens(name) == reference_tokens(minicpmv_dir, i, 12), name
    _assert_all_freed(engine)


def test_abort_frees_slots_and_blocks_at_once(minicpmv_dir):
    engine = make_engine(minicpmv_dir, max_num_batched_tokens=32, num_state_slots=4)
    collector = Collector()
    for i in range(6):
        collector.add(engine, plan_request(minicpmv_dir, _tell_me(i), f"a{i}", 50, ignore_eos=True))
    while len(engine.scheduler.running) < 4:
        engine.step()
    engine.step()
    assert engine.scheduler.slots.num_used_slots == 4 and len(engine.scheduler.waiting) == 2  # slots bound admission
    assert sorted(s.state_slot for s in engine.scheduler.running) == [0, 1, 2, 3]
    first = engine.scheduler.running[0]
    slot = first.state_slot
    engine.abort(first.request_id)
    engine.step()
    assert collector.finish_reason(first.request_id) == "abort" and first.state_slot is None
    while len(engine.scheduler.waiting) == 2:
        engine.step()
    assert engine.scheduler.running[-1].state_slot == slot  # the next request in line took it
    for name in collector.events:
        engine.abort(name)
    engine.step()
    _assert_all_freed(engine)


def test_startup_sizes_slots_and_snapshots_from_the_budget(minicpmv_dir, caplog):
    from llm_service.hybrid.state_cache import slot_bytes

    budget = 4 * 2**20
    with caplog.at_level(logging.INFO):
        engine = make_engine(minicpmv_dir, kv_cache_bytes=budget, max_num_seqs=1000, max_model_len=2048)
    runner = engine.runner
    per_slot = slot_bytes(runner.state_specs, runner.model.dtype)
    assert [s.layer_idx for s in runner.state_specs] == [0, 1, 2]
    assert runner.num_slots == budget // 2 // per_slot < 1000  # at most half the budget
    assert runner.num_snapshots == int(budget * engine.config.state_snapshot_share) // per_slot > 0
    kv = runner.kv_pool
    assert kv.shape[0] == 1  # K/V of the one full-attention layer only
    block_bytes = kv[0, :, 0].numel() * kv.element_size()
    used = (runner.num_slots + runner.num_snapshots) * per_slot + runner.num_blocks * block_bytes
    assert budget - block_bytes < used <= budget
    assert runner.states.conv[0].shape[0] == runner.num_slots + runner.num_snapshots
    assert engine.config.enable_prefix_caching and not engine.config.cuda_graphs
    assert engine.scheduler.snapshots.num_snapshots == runner.num_snapshots and engine.scheduler.slots.num_slots == runner.num_slots
    log = caplog.text
    assert f"{runner.num_slots} sequences run at once" in log and "CUDA decode graphs are off" in log
    assert f"prefix caching with state snapshots: {runner.num_snapshots} snapshots" in log
    assert "prefix caching is off" not in log


def test_no_snapshot_budget_turns_prefix_caching_off(minicpmv_dir, caplog):
    with caplog.at_level(logging.INFO):
        engine = make_engine(minicpmv_dir, kv_cache_bytes=4 * 2**20, state_snapshot_share=0.0, max_model_len=2048)
    assert not engine.config.enable_prefix_caching and engine.scheduler.snapshots is None
    assert engine.runner.num_snapshots == 0 and "prefix caching is off" in caplog.text


def test_pure_attention_models_get_no_slots(tiny_models):
    engine = make_engine(tiny_models["qwen2_vl"], num_kv_blocks=8)
    assert engine.scheduler.slots is None and engine.runner.states is None and engine.config.enable_prefix_caching


@pytest.mark.kernel
def test_triton_backend_reads_the_attention_layers_kv_and_equals_sdpa(minicpmv_dir):
    """The CUDA default backend (Triton paged kernel, interpreted on CPU) on a hybrid model: one
    kernel call per full-attention layer per step (no graphs: each call is counted), same greedy
    tokens as SDPA (float32)."""
    import mmserve.kernels.triton_attention as kernel
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel

    model = LanguageModel(minicpmv_dir, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
    picks = [1, 7, 16]  # image, text, video
    results = {}
    for backend in ("sdpa", "triton"):
        engine = LLMEngine(model, EngineConfig(attention_backend=backend, num_kv_blocks=32, max_num_batched_tokens=24,
                                               cuda_graphs=False))
        calls, original = [], kernel.paged_attention
        kernel.paged_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        try:
            collector, _ = _run(engine, minicpmv_dir, [(mixed_cases()[i][0], mixed_cases()[i][1], 5) for i in picks])
        finally:
            kernel.paged_attention = original
        results[backend] = {n: collector.tokens(n) for n in collector.events}
        if backend == "triton":
            assert len(calls) == engine.num_forwards * 1  # the one full-attention layer
    assert results["triton"] == results["sdpa"] and all(results["sdpa"].values())
