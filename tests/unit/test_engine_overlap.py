"""Overlapped steps (`async_scheduling`): the host reads each step's sampled ids one step late and
the next step takes them from the device. The tokens equal those of steps run one after another
(and `transformers` generate, greedy float64) with every way a sequence ends (stop ids, EOS,
`max_tokens`, aborts) at every position, preemption, chunked prefill, prefix hits, penalties,
seeds, a hybrid (state-slot) model and the Triton kernel with the decode-graph buffers."""

import pytest
import torch

from llm_service.model.batch_state import BatchState
from llm_service.sampling import SamplingParams
from tests.support.engine_support import Collector, make_engine, mixed_cases, plan_request, reference_tokens, run_until_done
from tests.support.sampling import SampleInput, rows_from_lists

MAX_TOKENS = 8


def _run(model_dir, overlap: bool, prompts, **config):
    """{name: (tokens, finish reason)} of `prompts` [(name, messages, max_tokens, sampling)],
    submitted at once and stepped to the end; the engine is returned to check what it freed."""
    engine = make_engine(model_dir, async_scheduling=overlap, **config)
    assert engine.overlap is overlap
    collector = Collector()
    for name, messages, max_tokens, sampling in prompts:
        collector.add(engine, plan_request(model_dir, messages, name, max_tokens, **sampling))
    run_until_done(engine, collector)
    return {n: (collector.tokens(n), collector.finish_reason(n)) for n in collector.events}, engine


def _assert_freed(engine):
    """Nothing held once the step still in flight (a finished sequence's discarded token) is read."""
    if engine._launched is not None:
        engine.step()
    assert engine.scheduler.blocks.num_used_blocks == 0
    assert engine.runner.batch.num_free_rows == engine.runner.batch.num_rows
    assert engine._launched is None and not engine.scheduler.running and not engine.scheduler.waiting


def _both(model_dir, prompts, **config):
    out = []
    for overlap in (False, True):
        result, engine = _run(model_dir, overlap, prompts, **config)
        _assert_freed(engine)
        out.append(result)
    assert out[0] == out[1]
    return out[1]


def test_greedy_mixed_requests_with_chunked_prefill_and_prefix_hits_equal_monolithic(model_dir):
    """18 mixed requests (text, images, video, a long prompt) over a 64-token budget (chunked
    prefills beside decodes), then the same prompts again (their blocks come from the prefix cache)."""
    cases = list(enumerate(mixed_cases()))
    prompts = [(f"{i}-{n}", m, MAX_TOKENS - i % 3, {}) for i, (n, m) in cases]
    prompts += [(f"again-{i}-{n}", m, MAX_TOKENS - i % 3, {}) for i, (n, m) in cases[:6]]
    engine = make_engine(model_dir, async_scheduling=True, max_num_batched_tokens=64, max_num_seqs=32)
    collector = Collector()
    for name, messages, max_tokens, _ in prompts[:len(cases)]:
        collector.add(engine, plan_request(model_dir, messages, name, max_tokens))
    run_until_done(engine, collector)
    for name, messages, max_tokens, _ in prompts[len(cases):]:
        collector.add(engine, plan_request(model_dir, messages, name, max_tokens))
    run_until_done(engine, collector)
    assert engine.scheduler.blocks.num_cached_tokens > 0  # the second wave hit the prefix cache
    for i, (name, _) in cases:
        expected = reference_tokens(model_dir, i, MAX_TOKENS - i % 3)
        assert collector.tokens(f"{i}-{name}") == expected, name
        if i < 6:
            assert collector.tokens(f"again-{i}-{name}") == expected, name
    _assert_freed(engine)


def test_stop_ids_eos_and_max_tokens_at_every_position(tiny_models, monkeypatch):
    model_dir = tiny_models["qwen2_vl"]
    messages = mixed_cases()[7][1]
    full = reference_tokens(model_dir, 7, MAX_TOKENS)
    firsts = [k for k, t in enumerate(full) if t not in full[:k]]  # a stop id ends the stream where it first shows
    prompts = [(f"stop{k}", messages, MAX_TOKENS, {"stop_token_ids": frozenset({full[k]})}) for k in firsts]
    prompts += [(f"max{k}", messages, k, {}) for k in range(1, MAX_TOKENS + 1)]
    result = _both(model_dir, prompts)
    for k in firsts:
        assert result[f"stop{k}"] == (full[:k], "stop")
    for k in range(1, MAX_TOKENS + 1):
        assert result[f"max{k}"] == (full[:k], "length")
    for k in firsts:  # the model's own EOS, at each position
        engine_eos = {full[k]}
        outs = []
        for overlap in (False, True):
            engine = make_engine(model_dir, async_scheduling=overlap)
            monkeypatch.setattr(engine.model, "eos_token_ids", engine_eos)
            collector = Collector()
            collector.add(engine, plan_request(model_dir, messages, "eos", MAX_TOKENS))
            run_until_done(engine, collector)
            outs.append((collector.tokens("eos"), collector.finish_reason("eos")))
            _assert_freed(engine)
        assert outs[0] == outs[1] == (full[:k], "stop")


def test_an_abort_after_any_step_sends_no_token_after_it(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    full = reference_tokens(model_dir, 6, MAX_TOKENS)
    for overlap in (False, True):
        for k in range(1, 6):
            engine = make_engine(model_dir, async_scheduling=overlap)
            collector = Collector()
            collector.add(engine, plan_request(model_dir, mixed_cases()[6][1], "a", MAX_TOKENS))
            collector.add(engine, plan_request(model_dir, mixed_cases()[8][1], "b", 4))
            for _ in range(k):
                engine.step()
            sent = len(collector.tokens("a"))
            engine.abort("a")
            run_until_done(engine, collector)
            assert collector.finish_reason("a") == "abort"
            assert collector.tokens("a") == full[:sent]  # nothing after the abort, the in-flight token dropped
            assert collector.tokens("b") == reference_tokens(model_dir, 8, 4)
            _assert_freed(engine)


def test_preemption_on_a_tiny_pool(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    picks = [1, 2, 3, 4, 6, 7, 12, 16]  # prompts of 27 .. 71 tokens, a pool of 96
    prompts = [(mixed_cases()[i][0], mixed_cases()[i][1], 12, {}) for i in picks]
    preemptions = []
    for overlap in (False, True):
        result, engine = _run(model_dir, overlap, prompts, num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)
        preemptions.append(engine.scheduler.num_preemptions)
        _assert_freed(engine)
        for i in picks:
            name = mixed_cases()[i][0]
            assert result[name][0] == reference_tokens(model_dir, i, 12), (overlap, name)
    assert min(preemptions) > 0


def test_penalties_and_seeds_give_the_same_tokens(tiny_models):
    """Greedy with repetition, frequency and presence penalties (counts kept on the device), and
    seeded sampling, run twice: the tokens do not depend on overlap or on the run."""
    model_dir = tiny_models["qwen2_vl"]
    penalties = {"repetition_penalty": 1.4, "frequency_penalty": 0.7, "presence_penalty": 0.5}
    seeded = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": 11, "ignore_eos": True}
    prompts = [(f"pen{i}", mixed_cases()[6 + i][1], 16, penalties) for i in range(3)]
    prompts += [(f"seed{i}", mixed_cases()[6 + i][1], 16, seeded) for i in range(3)]
    prompts += [("plain", mixed_cases()[9][1], 16, {})]
    first = _both(model_dir, prompts)
    assert _both(model_dir, prompts) == first
    plain = _both(model_dir, [(n, m, t, {}) for n, m, t, _ in prompts[:3]])
    assert any(first[n][0] != plain[n][0] for n in plain)  # the penalties changed something


def test_repetition_penalty_equals_transformers_generate(tiny_models):
    from tests.support.reference import reference_generate

    model_dir = tiny_models["qwen2_vl"]
    messages = mixed_cases()[10][1]
    result = _both(model_dir, [("r", messages, 12, {"repetition_penalty": 1.5})])
    assert result["r"][0] == reference_generate(model_dir, messages, 12, repetition_penalty=1.5)


def test_device_counts_equal_the_lists_they_replace():
    """`BatchState` penalty tensors after admissions and recorded tokens == counts of the lists."""
    from llm_service.engine.sequence import LLMRequest, Sequence

    state = BatchState(4, 30, torch.device("cpu"))
    params = SamplingParams(max_tokens=9, repetition_penalty=1.2, frequency_penalty=0.3)
    seqs = []
    for i, (prompt, generated) in enumerate([((1, 2, 3), (4,)), ((5, 5), ()), ((7,), (7, 8, 8))]):
        seq = Sequence(LLMRequest(f"s{i}", prompt, params), lambda e: None, i)
        seq.tokens += list(generated)
        state.admit(seq)
        seqs.append(seq)
    index = state.index(seqs)
    for step in ([9, 9, 1], [9, 2, 8]):
        state.record(index, torch.tensor(step))
        for seq, t in zip(seqs, step):
            seq.tokens.append(t)
    logits = torch.zeros(3, 30, dtype=torch.float64)
    got = state.sampling_rows(seqs, index, torch.float64)
    want = rows_from_lists(logits, [SampleInput(params, None, s.request.prompt_token_ids, s.generated) for s in seqs])
    assert torch.equal(got.output_counts, want.output_counts) and torch.equal(got.seen, want.seen)
    assert state.last_token[index].tolist() == [9, 2, 8]


def test_hybrid_state_slots_with_overlap_equal_monolithic(minicpmv_dir):
    picks = [0, 1, 6, 7, 12, 16]
    prompts = [(mixed_cases()[i][0], mixed_cases()[i][1], 10, {}) for i in picks]
    result, engine = _run(minicpmv_dir, True, prompts, max_num_batched_tokens=48, num_state_slots=4)
    for i in picks:
        name = mixed_cases()[i][0]
        assert result[name][0] == reference_tokens(minicpmv_dir, i, 10), name
    _assert_freed(engine)
    assert engine.scheduler.slots.num_free_slots == engine.scheduler.slots.num_slots


@pytest.mark.kernel
def test_triton_kernel_and_decode_graph_buffers_with_overlap(tiny_models, monkeypatch):
    """The Triton backend (interpreted) with the decode graphs' buffers run uncaptured: decode
    steps read their inputs from the rows' state on the device, the host reading ids a step late."""
    from llm_service.config import EngineConfig
    from llm_service.model.cuda_graphs import DecodeGraphs
    from llm_service.engine.llm_engine import LLMEngine
    from tests.gpu.test_engine_triton import fp32_model

    model_dir = tiny_models["qwen2_vl"]
    replays = []
    original = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, p, b, i: replays.append(b) or original(self, p, b, i))
    results = []
    # SDPA (every step packed on the host), then the kernel with decodes from the rows' device
    # state, eager and through the graphs' buffer, overlapped
    for backend, overlap, graphs in (("sdpa", False, False), ("triton", False, False), ("triton", True, True)):
        engine = LLMEngine(fp32_model(model_dir), EngineConfig(
            attention_backend=backend, num_kv_blocks=48, max_num_seqs=8, max_graph_batch_size=8,
            cuda_graphs=False, async_scheduling=overlap))
        if graphs:
            engine.runner.graphs = DecodeGraphs.capture(engine.runner, capture=False)
        collector = Collector()
        for i in (6, 7, 8):
            collector.add(engine, plan_request(model_dir, mixed_cases()[i][1], f"r{i}", 6))
        run_until_done(engine, collector)
        results.append({n: collector.tokens(n) for n in collector.events})
        _assert_freed(engine)
    assert replays  # decodes went through the graph buffers
    assert results[0] == results[1] == results[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlap_with_captured_graphs_equals_sequential_steps_in_float32(tiny_models):
    """On the GPU: overlapped steps with decode graphs captured give the tokens of sequential
    steps, greedy, with penalties and seeded sampling (float32, the Triton kernel)."""
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel

    model_dir = tiny_models["qwen2_vl"]
    model = LanguageModel(model_dir, dtype="float32", device="cuda")
    sampling = [{}, {"repetition_penalty": 1.3, "presence_penalty": 0.4},
                {"temperature": 0.8, "top_p": 0.9, "seed": 5, "ignore_eos": True}]
    results = []
    for overlap in (False, True):
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, max_graph_batch_size=8, async_scheduling=overlap))
        assert engine.runner.graphs is not None and engine.overlap is overlap
        collector = Collector()
        for i in range(9):
            name, messages = mixed_cases()[i if i != 5 else 12]
            collector.add(engine, plan_request(model_dir, messages, f"{name}-{i}", 12, **sampling[i % 3]))
        run_until_done(engine, collector)
        results.append({n: (collector.tokens(n), collector.finish_reason(n)) for n in collector.events})
        _assert_freed(engine)
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlapped_steps_launch_without_waiting_for_the_device(tiny_models, monkeypatch):
    """Steady decode with overlap on (graphs, greedy, penalties, seeded sampling): scheduling,
    staging, the graph replay, sampling and the copies never synchronise with the device (CUDA's
    sync debug mode raises if they do); only the read of the step before waits, by its event."""
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel

    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(LanguageModel(model_dir, dtype="float32", device="cuda"),
                       EngineConfig(num_kv_blocks=256, max_graph_batch_size=8, async_scheduling=True))
    sampling = [{}, {"repetition_penalty": 1.3}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}]
    collector = Collector()
    for i in range(3):
        collector.add(engine, plan_request(model_dir, mixed_cases()[6 + i][1], f"r{i}", 40, ignore_eos=True,
                                           **sampling[i]))
    while not all(s.num_computed >= s.num_prompt_tokens for s in engine.scheduler.running) or \
            len(engine.scheduler.running) < 3:
        engine.step()
    read = engine._read

    def read_allowed_to_wait(launched):  # the one wait a step makes; the mode it found is put back
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(launched)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(engine, "_read", read_allowed_to_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    run_until_done(engine, collector)
    assert all(len(collector.tokens(f"r{i}")) == 40 for i in range(3))
