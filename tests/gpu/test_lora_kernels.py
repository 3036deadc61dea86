"""The LoRA slot kernels (`mmserve.kernels.triton_lora`; on CPU in Triton's interpreter): every
row's adapter delta on its slices, base rows untouched; and the engine on the Triton backend
(LoRA by slot, decode steps through the graphs' buffers, uncaptured) gives `peft`'s merged
model's tokens for two adapters and the base in one batch."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels.triton_lora import lora_shrink_expand_

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, y, a, b, scales, offsets, sizes, token_slot):
    out = y.clone()
    for t in range(x.shape[0]):
        slot = int(token_slot[t])
        if slot < 0:
            continue
        for s, (off, size) in enumerate(zip(offsets.tolist(), sizes.tolist())):
            delta = (x[t].double() @ a[slot, s].double().T) @ b[slot, s, :size].double().T * float(scales[slot])
            out[t, off:off + size] = (y[t, off:off + size].double() + delta).to(y.dtype)
    return out


@pytest.mark.parametrize("rows,k,sizes", [(1, 64, (64, 32, 32)), (5, 200, (96,)), (7, 72, (48, 48))])
def test_each_row_gets_its_slot_s_delta_on_every_slice(rows, k, sizes):
    g = torch.Generator().manual_seed(rows)
    slots, rank = 3, 8
    x = torch.randn(rows, k, generator=g)
    y = torch.randn(rows, sum(sizes), generator=g)
    a = torch.randn(slots, len(sizes), rank, k, generator=g) * 0.1
    b = torch.zeros(slots, len(sizes), max(sizes), rank)
    for s, size in enumerate(sizes):
        b[:, s, :size] = torch.randn(slots, size, rank, generator=g) * 0.1
    a[1, :, 5:] = 0  # a rank-5 adapter padded to 8
    b[1, :, :, 5:] = 0
    scales = torch.tensor([0.5, 2.0, 1.25])
    offsets = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.int32)
    token_slot = torch.tensor([(t % 4) - 1 for t in range(rows)] + [2] * 3, dtype=torch.int32)  # longer than rows
    args = [t.to(DEVICE) for t in (x, y, a, b, scales, offsets, torch.tensor(sizes, dtype=torch.int32), token_slot)]
    want = reference(*[t.cpu() for t in args])
    got = args[1]
    lora_shrink_expand_(args[0], got, *args[2:], max(sizes))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    base = (token_slot[:rows] < 0).nonzero().flatten()
    assert torch.equal(got.cpu()[base], y[base])  # base rows untouched


def test_the_engine_by_slot_through_the_decode_graphs_equals_peft_merged(tiny_models, tmp_path):
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.engine.sequence import LoraRequest
    from llm_service.model.cuda_graphs import DecodeGraphs
    from llm_service.model.language_model import LanguageModel
    from mmserve.tiny.lora import build_tiny_adapter
    from tests.families.test_lora import ADAPTERS, PROMPTS, _request
    from tests.support.engine_support import Collector, run_until_done
    from tests.support.reference import reference_generate

    model_dir = tiny_models["qwen2_vl"]
    adapters = {name: LoraRequest(name, str(build_tiny_adapter(model_dir, tmp_path / name, **kw)))
                for name, kw in ADAPTERS.items()}
    engine = LLMEngine(LanguageModel(model_dir, dtype="float32", device=DEVICE), EngineConfig(
        attention_backend="triton", num_kv_blocks=64, max_num_seqs=4, max_graph_batch_size=4, max_loras=2,
        cuda_graphs=False))
    assert engine.runner.loras.kernels
    engine.runner.graphs = DecodeGraphs.capture(engine.runner, capture=False)
    replays = []
    original = engine.runner.graphs.replay
    engine.runner.graphs.replay = lambda p, b, i: replays.append(b) or original(p, b, i)
    collector = Collector()
    for lora in (None, *adapters.values()):  # three rows: padded to the graph of 4
        collector.add(engine, _request(model_dir, PROMPTS["text"], f"{lora and lora.name}", lora, max_tokens=6))
    run_until_done(engine, collector)
    assert replays and max(replays) == 3
    for lora in (None, *adapters.values()):
        expected = reference_generate(model_dir, PROMPTS["text"], 6, adapter=lora and lora.path)
        assert collector.tokens(f"{lora and lora.name}") == expected, lora
    assert bool((engine.runner.loras.token_slot == -1).all())  # every row back to the base model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decode_graphs_with_adapters_equal_eager_steps_and_peft_merged(tiny_models, tmp_path):
    """On the GPU: the decode graphs captured with the slot kernels in them (`LoraSet.capturing`)
    replay two adapters and the base in one batch: the tokens of the eager engine and of `peft`'s
    merged model (float32)."""
    from llm_service.config import EngineConfig
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.engine.sequence import LoraRequest
    from llm_service.model.language_model import LanguageModel
    from mmserve.tiny.lora import build_tiny_adapter
    from tests.families.test_lora import ADAPTERS, PROMPTS, _request
    from tests.support.engine_support import Collector, run_until_done
    from tests.support.reference import reference_generate

    model_dir = tiny_models["qwen2_vl"]
    adapters = {name: LoraRequest(name, str(build_tiny_adapter(model_dir, tmp_path / name, **kw)))
                for name, kw in ADAPTERS.items()}
    model = LanguageModel(model_dir, dtype="float32", device="cuda")
    results = []
    for graphs in (True, False):
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_graph_batch_size=4, max_loras=2,
                                               cuda_graphs=graphs))
        assert engine.runner.loras.kernels and (engine.runner.graphs is not None) is graphs
        collector = Collector()
        for lora in (None, *adapters.values()):
            collector.add(engine, _request(model_dir, PROMPTS["text"], f"{lora and lora.name}", lora, max_tokens=6))
        run_until_done(engine, collector)
        results.append({n: collector.tokens(n) for n in collector.events})
    assert results[0] == results[1]
    for lora in (None, *adapters.values()):
        assert results[0][f"{lora and lora.name}"] == reference_generate(model_dir, PROMPTS["text"], 6,
                                                                         adapter=lora and lora.path)
