"""The engine on the Triton paged-attention backend (interpreted on CPU) equals the SDPA backend;
the backend is chosen and checked when the engine starts."""

import functools

import pytest
import torch

from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine
from llm_service.model import attention
from llm_service.model.language_model import LanguageModel
from tests.support.engine_support import (Collector, image_prompt, make_engine, mixed_cases, plan_request,
                                         run_until_done)

MAX_TOKENS = 5
CONFIG = dict(block_size=16, num_kv_blocks=48, max_num_batched_tokens=24, max_num_seqs=8, cuda_graphs=False)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel runs in Triton's interpreter


@functools.lru_cache(maxsize=2)
def fp32_model(model_dir: str) -> LanguageModel:
    return LanguageModel(model_dir, dtype="float32", device=DEVICE)


def _greedy_tokens(model: LanguageModel, model_dir: str, backend: str, windows=None):
    engine = LLMEngine(model, EngineConfig(attention_backend=backend, **CONFIG))
    if windows is not None:
        engine.runner.windows = windows
    counted = []
    if backend == "triton":
        import mmserve.kernels.triton_attention as kernel

        original = kernel.paged_attention

        def counting(*args, **kwargs):
            counted.append(1)
            return original(*args, **kwargs)

        kernel.paged_attention = counting
    try:
        tokens = {}
        # prompts longer than the token budget (chunked over steps) next to a short one, then the
        # same image prompt again: its second run starts from prefix-cached blocks
        waves = [[("image-a", image_prompt(4)),
                  ("text", mixed_cases()[12][1]), ("video", mixed_cases()[17][1])],
                 [("image-b", image_prompt(4, "Describe this picture in detail, please. Then count."))]]
        for wave in waves:
            collector = Collector()
            for name, messages in wave:
                collector.add(engine, plan_request(model_dir, messages, name, MAX_TOKENS))
            run_until_done(engine, collector)
            tokens.update({name: collector.tokens(name) for name, _ in wave})
    finally:
        if backend == "triton":
            kernel.paged_attention = original
    return tokens, engine, len(counted)


@pytest.mark.kernel
def test_triton_backend_equals_sdpa_with_chunked_prefill_and_prefix_hits(tiny_models):
    model_dir = tiny_models["qwen2_vl"]  # 4 query heads over 2 KV heads
    model = fp32_model(model_dir)
    expected, sdpa_engine, _ = _greedy_tokens(model, model_dir, "sdpa")
    got, engine, kernel_calls = _greedy_tokens(model, model_dir, "triton")
    assert engine.runner.backend == "triton" and sdpa_engine.runner.backend == "sdpa"
    assert kernel_calls == engine.num_forwards * engine.runner.num_layers  # every layer of every step
    prompt = plan_request(model_dir, image_prompt(4), "x", 1)
    assert len(prompt.prompt_token_ids) > CONFIG["max_num_batched_tokens"]  # its prefill ran in chunks
    assert engine.stats().num_cached_tokens >= 16  # the second image prompt reused blocks
    assert got == expected
    assert all(len(t) > 0 for t in got.values())


@pytest.mark.kernel
def test_split_k_decode_equals_sdpa(tiny_models, monkeypatch):
    """Decode steps over key slices (flash-decoding, forced on at these short contexts) give the
    SDPA backend's greedy tokens; prefill steps stay unsplit."""
    import mmserve.kernels.triton_attention as kernel

    model_dir = tiny_models["qwen2_vl"]
    model = fp32_model(model_dir)
    expected, _, _ = _greedy_tokens(model, model_dir, "sdpa")
    monkeypatch.setattr(kernel, "MIN_SPLIT_KEYS", 8)
    splits, original = [], kernel.paged_attention

    def recording(*args, **kwargs):
        splits.append((args[6], args[9] if len(args) > 9 else kwargs.get("splits", 1)))  # (max_query_len, splits)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernel, "paged_attention", recording)
    got, _, _ = _greedy_tokens(model, model_dir, "triton")
    assert got == expected
    assert any(n > 1 for q, n in splits if q == 1) and all(n == 1 for q, n in splits if q > 1)


@pytest.mark.kernel
def test_triton_backend_equals_sdpa_with_a_sliding_window_layer(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    model = fp32_model(model_dir)
    windows = (7, None)  # layer 0 slides over 7 tokens, layer 1 attends fully
    expected, _, _ = _greedy_tokens(model, model_dir, "sdpa", windows)
    got, _, _ = _greedy_tokens(model, model_dir, "triton", windows)
    full, _, _ = _greedy_tokens(model, model_dir, "sdpa")
    assert got == expected
    assert got != full  # the window changed the outputs: it really was applied


def test_unrunnable_backend_fails_at_startup_with_a_reason(tiny_models):
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        make_engine(tiny_models["qwen2_vl"], attention_backend="triton")  # float64 model


def test_auto_never_falls_back_to_dense_on_cuda():
    with pytest.raises(ValueError, match="attention_backend='sdpa'"):
        attention.choose_backend("auto", torch.device("cuda"), torch.float64, 64)
    assert attention.choose_backend("auto", torch.device("cpu"), torch.float64, 64) == "sdpa"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention.choose_backend("triton", torch.device("cpu"), torch.float32, 64)


def test_unknown_backend_is_rejected_by_the_config():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_layer_windows_follow_layer_types():
    from transformers import Qwen2VLTextConfig

    text = Qwen2VLTextConfig(num_hidden_layers=3, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert attention.layer_windows(text, 3) == (None, 64, 64)


def test_failed_graph_capture_disables_graphs_and_says_why(tiny_models, monkeypatch, caplog):
    from llm_service.model import cuda_graphs
    from llm_service.model.cuda_graphs import DecodeGraphs, graph_batch_sizes

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    engine = make_engine(tiny_models["qwen2_vl"], num_kv_blocks=32)

    def broken(sizes, step_of, device, warmups=1):
        raise RuntimeError("capture not permitted")

    monkeypatch.setattr(cuda_graphs, "capture_ladder", broken)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # CPU-only box
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with caplog.at_level("WARNING"):
        assert DecodeGraphs.capture(engine.runner) is None
    assert "CUDA graph capture failed" in caplog.text and "capture not permitted" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_engine_runs_the_triton_kernel_and_decode_graphs(tiny_models, monkeypatch):
    import mmserve.kernels.triton_attention as kernel
    from llm_service.model.cuda_graphs import DecodeGraphs

    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(LanguageModel(model_dir, dtype="bfloat16", device="cuda"),
                       EngineConfig(num_kv_blocks=256, max_graph_batch_size=8))
    assert engine.runner.backend == "triton"
    assert engine.runner.graphs is not None and sorted(engine.runner.graphs._graphs) == [1, 2, 4, 8]
    kernel_calls, replays = [], []
    original_kernel, original_replay = kernel.paged_attention, DecodeGraphs.replay
    monkeypatch.setattr(kernel, "paged_attention", lambda *a, **k: kernel_calls.append(1) or original_kernel(*a, **k))
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, p, b, i: replays.append(b) or original_replay(self, p, b, i))
    collector = Collector()
    for i in range(6):
        name, messages = mixed_cases()[i]
        collector.add(engine, plan_request(model_dir, messages, name, 8))
    run_until_done(engine, collector)
    assert kernel_calls and replays  # eager prefills ran the kernel; decodes replayed graphs
    assert all(collector.finish_reason(n) in ("stop", "length") for n in collector.events)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_eager_decode_in_float32(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    model = LanguageModel(model_dir, dtype="float32", device="cuda")
    results = []
    for graphs in (True, False):
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, max_graph_batch_size=8, cuda_graphs=graphs))
        assert (engine.runner.graphs is not None) == graphs
        collector = Collector()
        for i in range(6):
            name, messages = mixed_cases()[i]
            collector.add(engine, plan_request(model_dir, messages, name, 8))
        run_until_done(engine, collector)
        results.append({n: collector.tokens(n) for n in collector.events})
    assert results[0] == results[1]


@pytest.mark.kernel
def test_a_decode_graph_step_reads_only_long_lived_tensors_and_gives_the_packed_logits(tiny_models):
    """What a captured graph computes, run eagerly on CPU: the decode of the rows' device state
    (padding rows included) gives the logits of the same step packed from the host, and every
    tensor it reads that it did not make is long-lived (the static index, the rows' state, the
    pool, the weights): a temporary made outside the captured region would be freed after
    capture and its memory reused, and replays would read garbage."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from llm_service.model.cuda_graphs import DecodeGraphs

    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(fp32_model(model_dir), EngineConfig(attention_backend="triton", max_graph_batch_size=8,
                                                           **CONFIG))
    runner = engine.runner
    collector = Collector()
    for i in range(3):
        collector.add(engine, plan_request(model_dir, mixed_cases()[12 + i][1], f"r{i}", 20))
    while not all(s.num_computed >= s.num_prompt_tokens for s in engine.scheduler.running) or \
            len(engine.scheduler.running) < 3:
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert len(scheduled) == 3 and all(s.num_tokens == 1 for s in scheduled)
    graphs = DecodeGraphs.capture(runner, capture=False)
    index = runner.batch.stage_decode([s.seq for s in scheduled], graphs.padded_size(3))
    assert index.tolist()[3:] == [runner.batch.pad_row]  # padded to the graph size 4
    graphs.index[:4].copy_(index)
    step = graphs._graphs[4][1]

    long_lived = {t.untyped_storage().data_ptr() for t in (
        graphs.index, runner.kv_pool, runner.arange, *(v for v in vars(runner.batch).values() if isinstance(v, torch.Tensor)),
        *runner.model.modules.parameters(), *runner.model.modules.buffers())}
    made, foreign = set(), []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.numel() and (p := t.untyped_storage().data_ptr()) not in made \
                        and p not in long_lived:
                    foreign.append(func)
            out = func(*args, **(kwargs or {}))
            made.update(t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out)
                        if isinstance(t, torch.Tensor))
            return out

    kv_before = runner.kv_pool.clone()
    with torch.inference_mode(), Reads():
        staged = step()[:3]
    assert not foreign, foreign
    runner.kv_pool.copy_(kv_before)  # the packed step writes the same K/V again
    ids, positions, batch, rows, media, extra = runner._on_device(runner._pack_host(scheduled, [0, 1, 2]))
    with torch.inference_mode():
        eager = runner.forward(runner.model.modules.decoder.embed_tokens(ids), positions, batch, rows, **extra)
    torch.testing.assert_close(staged, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_greedy_equals_transformers_generate_or_splits_at_a_near_tie(tiny_models):
    """bf16 on the GPU: the engine (Triton kernel + decode graphs) against `generate` in bf16 on the
    same weights. Rounding may flip a token only where the reference's logit of our token nearly
    ties its best one (the tiny model's random logits are flat, so near-ties are common)."""
    from tests.support.reference import NearTieTally, greedy_reference

    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(LanguageModel(model_dir, dtype="bfloat16", device="cuda"),
                       EngineConfig(num_kv_blocks=256, max_graph_batch_size=8))
    assert engine.runner.backend == "triton" and engine.runner.graphs is not None
    cases = [c for c in mixed_cases() if c[0].startswith("text_")]
    collector = Collector()
    for name, messages in cases:
        collector.add(engine, plan_request(model_dir, messages, name, 16))
    run_until_done(engine, collector)
    tally = NearTieTally()
    for name, messages in cases:
        ref = greedy_reference(model_dir, messages, 16, torch.bfloat16, "cuda", key=name)
        tally.check(name, collector.tokens(name), collector.finish_reason(name) == "stop", ref)
    print(f"bf16 vs generate: {tally.summary(len(cases))}")
    assert tally.exact >= len(cases) // 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_decode_step_s_launch_never_waits_for_the_device(tiny_models):
    """Issue 63 item 3: a decode step's launch (prepare, the graph replay, sampling; overlap on) makes
    no host sync: under `torch.cuda.set_sync_debug_mode("error")` any would raise."""
    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(LanguageModel(model_dir, dtype="bfloat16", device="cuda"),
                       EngineConfig(num_kv_blocks=256, max_graph_batch_size=8, async_scheduling=True))
    assert engine.runner.graphs is not None and engine.overlap
    launch, checked = engine._launch, []

    def strict_launch(scheduled):
        decode = all(n == 1 and s.num_computed >= s.num_prompt_tokens for s, n in scheduled)
        if not decode:
            return launch(scheduled)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(scheduled)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(scheduled))

    engine._launch = strict_launch
    collector = Collector()
    for i in range(4):
        name, messages = mixed_cases()[i]
        collector.add(engine, plan_request(model_dir, messages, name, 8))
    run_until_done(engine, collector)
    assert checked and all(collector.tokens(n) for n in collector.events)
