"""Packed ViT attention on CUDA, one layer: one SDPA call per segment vs the Triton varlen kernel
(as shipped, and other tiles) vs torch's `varlen_attn` (flash). Needs a GPU.

    python bench/vit_attention.py      # Qwen2-VL-7B's vision heads (16 x 80), bf16

Shapes: 16 segments of 1024 tokens (448^2 images) and 8 of 5476 (1024^2). Prints ms, TFLOP/s and
the max error against the per-segment SDPA; the last line is one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from mmserve.kernels import triton_attention as kernel

TILES = ((64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2))


def timed(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def triton_tile(q, k, v, cu, seg, scale, bm, bn, warps, stages):
    """The shipped kernel at another tile / warp / stage choice (the shipped one is 64x64, 4, 2)."""
    import triton

    out = torch.empty_like(q)
    lens = (cu[1:] - cu[:-1]).contiguous()
    grid = (cu.numel() - 1, k.shape[-2], triton.cdiv(seg, bm))
    kernel._attention_kernel[grid](
        q, k, v, out, cu, lens, cu, cu[:-1].contiguous(), out, out,  # no split-K: Part, Lse unused
        q.stride(0), q.stride(1), k.stride(-3), k.stride(-2),
        v.stride(-3), v.stride(-2), out.stride(0), out.stride(1), 0, 0, 0, 0, 0, float(scale), 0,
        GROUP=1, HEAD_DIM=q.shape[-1], BLOCK_D=max(16, triton.next_power_of_2(q.shape[-1])), BLOCK_M=bm, BLOCK_N=bn,
        PAGE_SIZE=1, PAGED=False, CAUSAL=False, SLIDING=False, PRECISION="ieee", SPLITS=1, num_warps=warps,
        num_stages=stages)
    return out


def main() -> int:
    import argparse

    argparse.ArgumentParser(description=__doc__.strip().splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    heads, dim, result = 16, 80, {}
    for seg, count in ((1024, 16), (5476, 8)):
        total = seg * count
        q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.arange(0, total + 1, seg, device="cuda", dtype=torch.int32)
        scale = dim ** -0.5
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

        def per_segment():
            return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                             scale=scale).transpose(0, 1) for a, b in bounds])

        variants = {"sdpa per segment": per_segment,
                    "triton (shipped)": lambda: kernel.varlen_attention(q, k, v, cu, seg, scale)}
        for tile in TILES[1:]:
            variants["triton %dx%d w%d s%d" % tile] = lambda tile=tile: triton_tile(q, k, v, cu, seg, scale, *tile)
        try:
            from torch.nn.attention.varlen import varlen_attn

            variants["torch varlen_attn"] = lambda: varlen_attn(q, k, v, cu, cu, seg, seg, scale=scale)
        except ImportError as e:
            print(f"torch varlen_attn unavailable: {e}")
        reference = per_segment().float()
        flops = 4 * count * seg * seg * heads * dim
        base = None
        print(f"\n{count} segments of {seg} tokens, {heads} heads x {dim}, bf16")
        print(f"{'variant':24s} {'ms':>8s} {'TFLOP/s':>8s} {'vs sdpa':>8s} {'max err':>8s}")
        for name, fn in variants.items():
            err = (fn().float() - reference).abs().max().item()
            ms = timed(fn)
            base = base or ms
            print(f"{name:24s} {ms:8.3f} {flops / ms / 1e9:8.1f} {base / ms:7.1f}x {err:8.2g}")
            result[f"{seg}x{count} {name}"] = round(ms, 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
