"""The decoder's elementwise work in fewer kernels, on the Triton backend (docs/attention.md#limits):
RMSNorm in one kernel (`rms_norm`), a residual add and its norm (`add_rms_norm`), rotary on Q and K
with the K/V write (`rotary_kv_write`), SiLU(gate) x up (`silu_mul`), each rounded as `transformers`
rounds it. Only `RMS_NORMS` and `SILU_MLPS` classes are fused (`fuse_decoder`), each checked against
its own forward first. On CPU the kernels run only in Triton's interpreter (tests).
"""

from __future__ import annotations

import logging
import types

import torch
import triton
import triton.language as tl

from mmserve.kernels.triton_splitk import unit_stride_rows

logger = logging.getLogger(__name__)

RMS_NORMS = ("Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "LlamaRMSNorm", "Qwen3VLTextRMSNorm")
SILU_MLPS = ("Qwen2MLP", "Qwen2_5_VLMLP", "LlamaMLP", "Qwen3VLTextMLP")


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    normed = normed.to(X.dtype.element_ty)  # as transformers: back to the input dtype, then the weight
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Y + row * stride_y + offs, out.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(X, R, W, Y, S, stride_x, stride_r, stride_y, stride_s, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    total = (x + r).to(X.dtype.element_ty)  # the residual sum in the input dtype, as torch's `residual + x`
    tl.store(S + row * stride_s + offs, total, mask=mask)
    total = total.to(tl.float32)
    normed = (total * tl.rsqrt(tl.sum(total * total, 0) / N + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(Y + row * stride_y + offs, out.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(X, COS, SIN, OUT, offs, mask, HALF: tl.constexpr):
    """`x * cos + rotate_half(x) * sin` over one head, each product and the sum rounded to the
    input dtype as torch rounds them (`transformers`' `apply_rotary_pos_emb`)."""
    dt = X.dtype.element_ty
    x1 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(COS + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    first = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    second = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(OUT + offs, first.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + HALF + offs, second.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kv_kernel(Q, K, V, COS, SIN, QO, KC, VC, SLOTS, stride_qt, stride_qh, stride_kt, stride_kh,
                      stride_vt, stride_vh, stride_ct, stride_qot, stride_qoh, stride_cs, stride_ch,
                      HQ: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # a query head, then the KV heads
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    cos, sin = COS + t * stride_ct, SIN + t * stride_ct
    if h < HQ:
        _rotate(Q + t * stride_qt + h * stride_qh, cos, sin, QO + t * stride_qot + h * stride_qoh, offs, mask, HALF)
    else:
        kv = h - HQ
        slot = tl.load(SLOTS + t).to(tl.int64)
        _rotate(K + t * stride_kt + kv * stride_kh, cos, sin, KC + slot * stride_cs + kv * stride_ch, offs, mask, HALF)
        both = tl.arange(0, 2 * BLOCK)
        value = tl.load(V + t * stride_vt + kv * stride_vh + both, mask=both < 2 * HALF, other=0.0)
        tl.store(VC + slot * stride_cs + kv * stride_ch + both, value, mask=both < 2 * HALF)


@triton.jit
def _silu_mul_kernel(GU, Y, stride_gu, stride_y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + N + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(GU.dtype.element_ty)  # SiLU, rounded as torch's
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(Y + row * stride_y + offs, out.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x / rms(x)).to(x.dtype)` over the last dimension, in one kernel."""
    n = x.shape[-1]
    rows = unit_stride_rows(x, n)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, float(eps),
                                           BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(*x.shape[:-1], n)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)` over the last dimension, in one kernel (the sum
    rounded to the input dtype first, as `transformers`' `hidden = residual + out` is)."""
    n = x.shape[-1]
    rows, res = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    total = torch.empty_like(rows)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, total, rows.stride(0), res.stride(0),
                                               out.stride(0), total.stride(0), n, float(eps),
                                               BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out.view(*x.shape[:-1], n), total.view(*x.shape[:-1], n)


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Rotary on `q` `(T, H, D)` and `k` `(T, Hkv, D)` by `cos`/`sin` `(T, D)`, the rotated keys and
    the values `v` written into the pool (`k_cache`/`v_cache` `(blocks, block_size, Hkv, D)`) at
    `slot_mapping`, in one kernel; returns the rotated queries."""
    t, hq, d = q.shape
    if min(x.stride(-1) for x in (q, k, v, cos, sin)) != 1 or cos.stride() != sin.stride():
        q, k, v, cos, sin = (x.contiguous() for x in (q, k, v, cos, sin))
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    kc, vc = k_cache.view(-1, *k_cache.shape[-2:]), v_cache.view(-1, *v_cache.shape[-2:])
    if t:
        _rotary_kv_kernel[(t, hq + k.shape[1])](
            q, k, v, cos, sin, out, kc, vc, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos.stride(0), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1),
            HQ=hq, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), num_warps=1,
            enable_fp_fusion=False)  # no FMA: each product rounded, as torch computes it
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up` = [gate | up] over the last dimension, in one kernel."""
    n = gate_up.shape[-1] // 2
    rows = unit_stride_rows(gate_up, 2 * n)
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n,
                                                                BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


def _fused_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(torch.nn.functional.linear(x, self.gate_up_weight)))


def _fused_mlp_check(self, x: torch.Tensor) -> torch.Tensor:
    """The fused MLP's math before its weights are stacked (what `_agrees` checks)."""
    stacked = torch.cat([self.gate_proj.weight, self.up_proj.weight])
    return self.down_proj(silu_mul(torch.nn.functional.linear(x, stacked)))


def _is_silu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (type(module).__name__ in SILU_MLPS and all(
        isinstance(getattr(module, name, None), torch.nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))
        and module.gate_proj.bias is None and module.up_proj.bias is None
        and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def _agrees(module: torch.nn.Module, fused, width: int) -> str | None:
    """Why `fused` is not `module`'s own forward on random rows (None: it is, within rounding)."""
    param = next(module.parameters())
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(param.device, param.dtype)
    try:
        with torch.inference_mode():
            want, got = module.forward(x), fused(module, x)
    except Exception as e:  # noqa: BLE001 (a kernel that does not compile here: the module stays unfused)
        return f"{type(e).__name__}: {e}"
    tolerance = 1e-2 if param.dtype in (torch.float16, torch.bfloat16) else 1e-4
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()
    return None if error <= tolerance else f"differs from its own forward by {error:.2e} (relative)"


def fuse_decoder(decoder: torch.nn.Module) -> dict[str, int]:
    """Fuse the RMSNorms and SiLU MLPs of `decoder` in place (once: fused modules are left as
    they are); {class name: modules fused}."""
    if next(decoder.parameters()).dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return {}  # the kernels compute in float32: a float64 model (CPU tests) stays as written
    norms = [m for m in decoder.modules() if type(m).__name__ in RMS_NORMS and not getattr(m, "fused", False)
             and isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon")]
    mlps = [m for m in decoder.modules() if _is_silu_mlp(m)]
    fused: dict[str, int] = {}
    refused: set[str] = set()
    for module in norms + mlps:
        name, is_mlp = type(module).__name__, hasattr(module, "gate_proj")
        if name in refused:
            continue
        if name not in fused:  # the first of its class: checked against its own forward
            check, width = ((_fused_mlp_check, module.gate_proj.in_features) if is_mlp else
                            (_fused_norm_forward, module.weight.shape[-1]))
            if why := _agrees(module, check, width):
                logger.warning("not fusing %s: %s", name, why)
                refused.add(name)
                continue
        if is_mlp:  # the stacked weight replaces the two (no second copy of them kept)
            stacked = torch.cat([module.gate_proj.weight, module.up_proj.weight])
            module.register_parameter("gate_up_weight", torch.nn.Parameter(stacked, requires_grad=False))
            del module.gate_proj, module.up_proj
        module.forward = types.MethodType(_fused_mlp_forward if is_mlp else _fused_norm_forward, module)
        module.fused = True
        fused[name] = fused.get(name, 0) + 1
    if fused:
        logger.info("fused decoder ops: %s", ", ".join(f"{n} x{k}" for n, k in sorted(fused.items())))
    return fused
