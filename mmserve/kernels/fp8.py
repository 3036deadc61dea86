"""Dynamic per-token FP8 (e4m3) activation quantization, as DeepSeek-V3, vLLM and llm-compressor's
FP8-dynamic scheme define it: each token's row, or each `group` columns of it, gets the scale
`amax / 448` (448: e4m3's largest finite value, `amax` at least `MIN_AMAX`) and
`x_q = clamp(x / scale, -448, 448)` rounded to e4m3, so `x ~ x_q * scale`.

This is the definition in torch (the reference of the GPU tests, the fake quantization of their
reference model); `mmserve.kernels.triton_fp8.quantize_activations` computes the same bits in one
launch for the FP8 GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-10  # an all-zero group still gets a finite scale (its values quantize to 0)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `(M, K)` -> (`x_q` `(M, K)` e4m3, `scale` `(M, ceil(K / group))` float32): each token's
    columns in groups of `group` (a partial last one), `x ~ x_q * scale` group by group."""
    M, K = x.shape
    groups = -(-K // group)
    padded = F.pad(x, (0, groups * group - K)) if K % group else x
    blocks = padded.reshape(M, groups, group).float()
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(M, groups * group)
    return q[:, :K], scale.squeeze(-1)


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """`x` `(..., K)` through the quantization per token per `group` columns and back, in `x`'s
    dtype (computed in float32): what an FP8 GEMM sees of it."""
    lead, K = x.shape[:-1], x.shape[-1]
    q, scale = quantize_per_token_group(x.reshape(-1, K), group)
    groups = scale.shape[1]
    wide = F.pad(q.float(), (0, groups * group - K)).reshape(-1, groups, group) * scale[..., None]
    return wide.reshape(-1, groups * group)[:, :K].to(x.dtype).reshape(*lead, K)
