"""The Triton fused experts (mmserve/kernels/triton_moe.py) against a per-expert float64 loop and
against the engine's grouped PyTorch path on a real `transformers` MoE block; the alignment of the
pairs to blocks; a CUDA graph replayed with new routing, and the compile for a Hopper GPU.

On CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest before
Triton is imported); on CUDA it is compiled. bfloat16 `tl.dot` is wrong in the interpreter, so the
16-bit dtypes run on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.kernels.triton_moe import align, blocks_for, fused_experts, padded_length

pytestmark = pytest.mark.kernel
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def clamp_gate(limit: float):
    """Step3's gate: SiLU(gate) capped at `limit`, up clamped to [-limit, limit]."""
    def apply(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)
    return apply


def reference(x, gate_up_proj, down_proj, top_k_index, top_k_weights, apply_gate) -> torch.Tensor:
    """Each expert alone over its tokens, in float64 (on the CPU)."""
    x, gate_up_proj, down_proj, weights = (t.cpu().double() for t in (x, gate_up_proj, down_proj, top_k_weights))
    top_k_index = top_k_index.cpu()
    out = torch.zeros_like(x)
    for expert in range(gate_up_proj.shape[0]):
        tokens, slots = torch.where(top_k_index == expert)
        rows = apply_gate(x[tokens] @ gate_up_proj[expert].T) @ down_proj[expert].T
        out.index_add_(0, tokens, rows * weights[tokens, slots, None])
    return out


def random_case(seed, tokens, top_k, hidden, inter, experts, dtype, allowed=None):
    """Weights (of unit-variance outputs), input and a routing of `tokens` x `top_k` distinct
    experts drawn from `allowed`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up_proj = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down_proj = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    allowed = torch.tensor(allowed if allowed is not None else range(experts))
    choice = torch.rand(tokens, len(allowed), generator=gen).argsort(dim=1)[:, :top_k]
    top_k_index = allowed[choice]
    top_k_weights = torch.rand(tokens, top_k, generator=gen).softmax(dim=-1)
    return (x.to(DEVICE, dtype), gate_up_proj.to(DEVICE, dtype), down_proj.to(DEVICE, dtype), top_k_index.to(DEVICE),
            top_k_weights.to(DEVICE))


ROUTINGS = {  # tokens, top_k, hidden, intermediate, experts, allowed experts
    "random": (13, 2, 64, 32, 8, None),
    "experts_without_tokens": (9, 2, 64, 32, 8, [1, 6]),
    "one_expert_for_all": (11, 1, 64, 32, 8, [5]),
    "one_token": (1, 2, 64, 32, 8, None),
    "top_1": (7, 1, 64, 32, 8, None),
    "dims_off_the_blocks": (6, 3, 40, 24, 5, None),
    "64_row_blocks": (40, 2, 48, 16, 4, None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROUTINGS)
def test_fused_experts_is_the_per_expert_loop(case, dtype):
    tokens, top_k, hidden, inter, experts, allowed = ROUTINGS[case]
    args = random_case(len(case), tokens, top_k, hidden, inter, experts, dtype, allowed)
    out = fused_experts(*args, silu_gate)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference(*args, silu_gate), **TOLERANCE[dtype])


def test_the_64_row_case_uses_64_row_blocks():
    tokens, top_k, _, _, experts, _ = ROUTINGS["64_row_blocks"]
    assert blocks_for(torch.float32, tokens * top_k, experts).m == 64
    assert blocks_for(torch.float32, 13 * 2, 8).m == 16


def test_weights_of_another_dtype_and_a_non_contiguous_input():
    x, gate_up_proj, down_proj, top_k_index, top_k_weights = random_case(3, 10, 2, 64, 32, 8, torch.float32)
    wide = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along the hidden dimension
    out = fused_experts(wide, gate_up_proj, down_proj, top_k_index, top_k_weights.double(), silu_gate)
    expected = reference(wide, gate_up_proj, down_proj, top_k_index, top_k_weights, silu_gate)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[torch.float32])


def test_step3_clamped_gate():
    args = random_case(4, 12, 2, 64, 32, 8, torch.float32)
    gate = clamp_gate(0.3)
    expected = reference(*args, gate)
    assert not torch.allclose(expected, reference(*args, silu_gate))  # the clamp bites
    torch.testing.assert_close(fused_experts(*args, gate).cpu().double(), expected, **TOLERANCE[torch.float32])


def test_fused_experts_is_the_engine_grouped_path_on_a_qwen3_vl_moe_block():
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    from llm_service.model.experts import gate, install

    cfg = Qwen3VLMoeTextConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    block = block.to(DEVICE)
    (experts,) = install(block)  # the grouped PyTorch path: no `triton` flag
    hidden = torch.randn(17, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.inference_mode():
        _, top_k_weights, top_k_index = block.gate(hidden)
        grouped = experts(hidden, top_k_index, top_k_weights)
        fused = fused_experts(hidden, experts.gate_up_proj, experts.down_proj, top_k_index, top_k_weights,
                              lambda gate_up: gate(experts, gate_up))
    torch.testing.assert_close(fused, grouped, **TOLERANCE[torch.float32])


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 40), top_k=st.integers(1, 4), experts=st.integers(4, 16), block_m=st.sampled_from([4, 16]),
       seed=st.integers(0, 2**16))
def test_align_puts_each_pair_once_in_blocks_of_its_expert(tokens, top_k, experts, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k_index = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k] % (1 + seed % experts)
    sorted_pairs, block_experts = align(top_k_index, experts, block_m)
    num_pairs = tokens * top_k
    assert sorted_pairs.numel() == padded_length(num_pairs, experts, block_m) == block_experts.numel() * block_m
    real = sorted_pairs[sorted_pairs < num_pairs].long()
    assert sorted(real.tolist()) == list(range(num_pairs))  # each pair once, the rest is the sentinel
    flat = top_k_index.reshape(-1)
    rows = sorted_pairs.view(-1, block_m)
    for block, expert in zip(rows, block_experts.tolist()):
        pairs = block[block < num_pairs].long()
        if expert == experts:  # past the last run: padding only
            assert pairs.numel() == 0
        else:  # a block of one expert that has pairs, in token order
            assert pairs.numel() > 0 and (flat[pairs] == expert).all() and (pairs.diff() > 0).all()
    assert block_experts.diff().ge(0).all()  # each expert's blocks are one run


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_a_captured_graph_replays_new_routings():
    x, gate_up_proj, down_proj, top_k_index, top_k_weights = random_case(5, 24, 2, 64, 32, 8, torch.bfloat16)
    static = [x.clone(), top_k_index.clone(), top_k_weights.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels and warms the allocator outside the capture
        fused_experts(static[0], gate_up_proj, down_proj, static[1], static[2], silu_gate)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(static[0], gate_up_proj, down_proj, static[1], static[2], silu_gate)
    for seed, allowed in ((6, None), (7, [2, 5]), (8, [0, 7])):
        new = random_case(seed, 24, 2, 64, 32, 8, torch.bfloat16, allowed)
        for buffer, value in zip(static, (new[0], new[3], new[4])):
            buffer.copy_(value)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(new[0], gate_up_proj, down_proj, new[3], new[4], silu_gate),
                                   rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("tokens", [16, 300])  # 16-row blocks (decode), 64-row blocks (prefill)
def test_real_dims_in_bf16(tokens):
    """Qwen3-VL-30B-A3B's experts: H 2048, I 768, E 128, k 8."""
    args = random_case(9, tokens, 8, 2048, 768, 128, torch.bfloat16)
    expected = reference(*args, silu_gate)
    torch.testing.assert_close(fused_experts(*args, silu_gate).cpu().double(), expected, rtol=5e-2, atol=5e-2)


def compile_for_sm90() -> list[str]:
    """The grouped GEMM at the real dims (H 2048, I 768, E 128, k 8) compiled to Hopper cubins for
    each tile shape `blocks_for` picks, specialized as a launch with contiguous, 16-byte aligned
    tensors specializes it (ptxas ships with Triton; no GPU needed)."""
    import triton.language as tl

    from mmserve.kernels.triton_moe import _expert_gemm_kernel
    from tests.support.sm90 import compile_sm90

    aligned = ("A", "B", "C", "Weights", "sorted_pairs", "block_experts", "stride_am", "stride_be", "stride_bn",
               "stride_cm", "N", "K", "num_pairs")
    compiled = []
    for dtype, torch_dtype, pairs in (("bf16", torch.bfloat16, 64 * 8), ("bf16", torch.bfloat16, 4096 * 8),
                                      ("fp32", torch.float32, 4096 * 8), ("fp64", torch.float64, 64 * 8)):
        blocks = blocks_for(torch_dtype, pairs, 128)
        acc = "fp64" if dtype == "fp64" else "fp32"
        for gemm, rows_per_a, weighted, k in (("gate_up", 8, False, 2048), ("down", 1, True, 768)):
            constants = dict(NUM_EXPERTS=128, ROWS_PER_A=rows_per_a, WEIGHTED=weighted,
                             ACC=tl.float64 if dtype == "fp64" else tl.float32,
                             PRECISION="tf32" if dtype == "bf16" else "ieee", BLOCK_M=blocks.m, BLOCK_N=blocks.n,
                             BLOCK_K=blocks.k, EVEN_K=k % blocks.k == 0, stride_ak=1, stride_bk=1, stride_cn=1)
            pointers = {"sorted_pairs": "*i32", "block_experts": "*i32", "A": f"*{dtype}", "B": f"*{dtype}",
                        "C": f"*{acc}" if weighted else f"*{dtype}", "Weights": "*fp32"}
            size = compile_sm90(_expert_gemm_kernel, constants, pointers, num_warps=blocks.num_warps,
                                num_stages=blocks.num_stages, aligned=aligned)
            compiled.append(f"{dtype} {gemm} BLOCK_M={blocks.m}: {size} bytes")
    return compiled


@pytest.mark.skipif(DEVICE == "cuda", reason="compiled and run for real on CUDA")
def test_kernel_compiles_for_hopper_without_a_gpu():
    """The interpreter does not type-check like the compiler: compile the real thing too."""
    from tests.support.sm90 import run_without_interpreter

    assert run_without_interpreter("tests.gpu.test_triton_moe", "compile_for_sm90").count("bytes") == 8
