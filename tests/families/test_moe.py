"""The engine's experts path (llm_service/model/experts.py) on the MoE families: each layer equals
`transformers`' per-expert loop for any routing, the served tokens equal `generate` with prefix
caching and through the decode graphs' step, and the load counters count every routed token."""

from __future__ import annotations

import copy

import pytest
import torch

from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine
from llm_service.model import experts
from tests.support.cases import LONG_TEXT, family_cases, image, text, user
from tests.support.engine_support import Collector, language_model, make_engine, plan_request, run_until_done
from tests.support.reference import reference_generate

MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "step3p7")
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # `kernel` tests: Triton's interpreter on CPU


def _qwen3_block(dtype: torch.dtype):
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    cfg = Qwen3VLMoeTextConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3)
    cfg._experts_implementation = "eager"
    return Qwen3VLMoeTextSparseMoeBlock(cfg).to(dtype)


def _step3_block(dtype: torch.dtype):
    """Step3's block with its routed experts' SwiGLU clamp (the published model's layers 43-44)."""
    from transformers import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7SparseMoeBlock

    cfg = Step3p7TextConfig(hidden_size=64, moe_intermediate_size=48, num_local_experts=8, num_experts_per_tok=3,
                            share_expert_dim=32, num_hidden_layers=1, swiglu_limits=[0.5])
    return Step3p7SparseMoeBlock(cfg, 0).to(dtype)


def _routings(num_tokens: int, num_experts: int, top_k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(num_tokens)
    random = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    crowded = random.clone()
    crowded[:, 0] = 5  # one expert holds every token (in its first slot)
    crowded[:, 1:] = torch.stack([torch.tensor([e for e in (0, 1, 2, 3) if e != 5][:top_k - 1])] * num_tokens)
    return {"random": random, "crowded, experts 2 3 4 6 7 empty": crowded}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["per-expert", "grouped_mm"])
@pytest.mark.parametrize("make", [_qwen3_block, _step3_block], ids=["qwen3_vl_moe", "step3p7"])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_experts_path_equals_the_transformers_loop(make, dtype, num_tokens):
    torch.manual_seed(0)
    block = make(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    ours = copy.deepcopy(block)
    [module] = experts.install(ours)
    hidden = torch.randn(num_tokens, 64, dtype=dtype)
    tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for name, index in _routings(num_tokens, 8, 3).items():
            weights = torch.rand(num_tokens, 3, dtype=dtype)
            got = module(hidden, index, weights)
            torch.testing.assert_close(got, block.experts(hidden, index, weights), **tolerance, msg=name)
        torch.testing.assert_close(ours(hidden[None]), block(hidden[None]), **tolerance)  # router + shared expert
    assert module.load.sum() == 3 * num_tokens * 3  # every (token, slot) pair of the three calls


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_moe_layer_runs_the_engines_path_and_counts_its_tokens(tiny_checkpoint, family):
    model_dir = tiny_checkpoint(family)
    engine = make_engine(model_dir)
    text_config = engine.model.text_config
    moe_layers = [m for m in engine.model.modules.decoder.modules() if experts.is_experts(m)]
    assert moe_layers and engine.runner.expert_load.modules == moe_layers
    assert all(m.forward.__func__ is experts.experts_forward for m in moe_layers)
    collector = Collector()
    request = plan_request(model_dir, family_cases(family)["one_image"], "r", 4)
    collector.add(engine, request)
    run_until_done(engine, collector)
    engine.runner.expert_load.collect(engine.runner.num_forwards, force=True)
    counts, forwards = engine.runner.expert_load.drain()
    assert counts.shape == (len(moe_layers), moe_layers[0].gate_up_proj.shape[0]) and forwards >= 4
    routed = (len(request.prompt_token_ids) + 3) * text_config.num_experts_per_tok  # prompt + 3 decode steps
    assert counts.sum(dim=1).tolist() == [routed] * len(moe_layers)
    assert engine.runner.expert_load.drain() is None
    assert experts.imbalance(counts) >= 1.0


def test_the_published_transposed_experts_load_and_serve_the_same_tokens(tiny_checkpoint, tmp_path):
    """Qwen3-VL-MoE's published checkpoints store the experts transposed against transformers'
    modules; the LM face reads either."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tiny_checkpoint("qwen3_vl_moe")
    published = tmp_path / "published"
    shutil.copytree(model_dir, published)
    tensors = load_file(published / "model.safetensors")
    moved = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert moved
    save_file({k: t.transpose(1, 2).contiguous() if k in moved else t for k, t in tensors.items()},
              published / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = language_model(model_dir).modules, language_model(str(published)).modules
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name


def test_experts_stored_one_projection_per_expert_load_the_same(tiny_checkpoint, tmp_path):
    """The quantized releases' layout (`mlp.experts.<j>.gate_proj.weight`, ...), dense here:
    each tensor is written into its slice of the stacked ones (`experts.PerExpertLoader`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mmserve.tiny.quantized import per_expert

    model_dir = tiny_checkpoint("qwen3_vl_moe")
    split = tmp_path / "per_expert"
    shutil.copytree(model_dir, split)
    tensors = {k: t for key, tensor in load_file(split / "model.safetensors").items()
               for k, t in per_expert(key, tensor).items()}
    assert "model.language_model.layers.0.mlp.experts.15.up_proj.weight" in tensors
    save_file(tensors, split / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = language_model(model_dir).modules, language_model(str(split)).modules
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name


def test_a_repeated_long_prompt_reuses_its_blocks_with_the_moe_layers(tiny_checkpoint):
    model_dir = tiny_checkpoint("qwen3_vl_moe")
    engine = make_engine(model_dir, block_size=8)
    messages = user(image(64, 64, 8), text(LONG_TEXT))
    expected = reference_generate(model_dir, messages, 6)
    for n in range(2):
        collector = Collector()
        collector.add(engine, plan_request(model_dir, messages, f"r{n}", 6))
        run_until_done(engine, collector)
        assert collector.tokens(f"r{n}") == expected
        if n == 0:
            cached = engine.stats().num_cached_tokens
    prompt = len(plan_request(model_dir, messages, "x", 1).prompt_token_ids)
    assert engine.stats().num_cached_tokens - cached == (prompt - 1) // 8 * 8


@pytest.mark.kernel
def test_decode_graph_steps_with_moe_layers_equal_monolithic(tiny_checkpoint):
    """The decode graphs' step (the capture ladder's padded sizes, run uncaptured; on CPU through the
    Triton interpreter): the experts path sees padded batches and the tokens stay exact."""
    from llm_service.model.cuda_graphs import DecodeGraphs
    from llm_service.model.language_model import LanguageModel

    model_dir = tiny_checkpoint("qwen3_vl_moe")
    engine = LLMEngine(LanguageModel(model_dir, dtype="float32", device=KERNEL_DEVICE), EngineConfig(
        attention_backend="triton", num_kv_blocks=48, max_num_seqs=4, max_graph_batch_size=4, cuda_graphs=False))
    engine.runner.graphs = DecodeGraphs.capture(engine.runner, capture=False)
    cases = family_cases("qwen3_vl_moe")
    collector = Collector()
    names = ("text_only", "one_image", "three_images")  # three rows: padded to the graph of 4
    for name in names:
        collector.add(engine, plan_request(model_dir, cases[name], name, 5))
    run_until_done(engine, collector)
    for name in names:
        assert collector.tokens(name) == reference_generate(model_dir, cases[name], 5), name


@pytest.mark.kernel
@pytest.mark.parametrize("make", [_qwen3_block, _step3_block], ids=["qwen3_vl_moe", "step3p7"])
def test_the_fused_kernel_path_equals_the_transformers_loop(make):
    """What a CUDA replica runs (`install(..., triton=True)`); on CPU in Triton's interpreter."""
    torch.manual_seed(1)
    block = make(torch.float32).to(KERNEL_DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    ours = copy.deepcopy(block)
    [module] = experts.install(ours)
    module.use_triton = True  # on CUDA only, outside tests
    hidden = torch.randn(1, 9, 64).to(KERNEL_DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(ours(hidden), block(hidden), rtol=1e-5, atol=1e-5)
    assert module.load.sum() == 9 * 3
