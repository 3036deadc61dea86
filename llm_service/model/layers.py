"""The engine's own decoder (Qwen2-VL, Qwen2.5-VL, dense Qwen3-VL text models): embeddings, layers, norm.

It computes what `transformers`' `Qwen2VLTextModel` (or `Qwen3VLTextModel`: q/k norms, DeepStack)
computes, rounding included, on the engine's packed step: hidden states `(T, hidden)` of every
scheduled sequence, one M-RoPE position per token and row, attention through the paged KV pool
(`llm_service.model.attention.paged`).

- Every projection is one `Linear` whose output is a concatenation of named slices: Q, K and V
  are one GEMM (`qkv_proj`, with Qwen2's biases), the MLP's gate and up another (`gate_up_proj`);
  `pack_checkpoint_tensors` builds them at load from the checkpoint's separate projections.
- The residual add and the RMSNorm after it are one step (`RMSNorm(x, residual)`).
- cos/sin of the rotary embedding are computed once per forward for all layers, by the family's
  own `transformers` rotary module (M-RoPE sections over the 3 position rows).

Parameter names are `transformers`' except the packed projections, so the checkpoint's keys map
as they are. On CUDA (`Decoder.use_kernels`) the add + norm, SiLU x up, and rotary + K/V write
run as Triton kernels (`llm_service.model.fused_ops`); elsewhere, and by default, plain torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llm_service.model import attention

# packed module -> the checkpoint's modules it concatenates, in output order
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the dimension a packed tensor concatenates its parts along: the output one (AWQ stores (in, out))
PACKED_DIM = {"qweight": 1, "qzeros": 1, "scales": 1}


class Linear(nn.Module):
    """`y = x W^T + b` whose output is the concatenation of slices `output_sizes` (one for a plain
    projection; q | k | v or gate | up for a packed one). Every projection of the decoder is one,
    so that other weight formats (block-scaled FP8, packed int4) and per-slice deltas (LoRA) have
    one place to go. Dense: `weight` `(sum(output_sizes), input_size)`."""

    def __init__(self, input_size: int, output_sizes: tuple[int, ...], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.input_size = input_size  # the whole model's (LoRA reads it: one rank only; AWQ holds no `weight`)
        self.output_sizes = tuple(output_sizes)  # this process's (a tensor-parallel rank's shard)
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False) if bias else None
        self.quantization = None  # another weight format's forward (`llm_service.model.quantized`)
        self.lora = None  # LoRA adapters' deltas on its slices (`llm_service.model.lora.LinearLoras`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) if self.quantization is None else self.quantization.forward(self, x)
        return y if self.lora is None else self.lora(x, y)

    def slices(self) -> tuple[slice, ...]:
        """Where each output slice lies along the output dimension."""
        ends = torch.tensor(self.output_sizes).cumsum(0).tolist()
        return tuple(slice(end - size, end) for size, end in zip(self.output_sizes, ends))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This linear's output `y` cut into its slices (views)."""
        return y.split(self.output_sizes, dim=-1)


class RMSNorm(nn.Module):
    """`transformers`' RMSNorm (float32 statistics, the normalised row cast back to the input dtype,
    then times the weight), taking the residual stream too: `norm(x, residual)` returns
    `(norm(residual + x), residual + x)`, the sum in the input dtype; `norm(x)` returns `(norm(x), x)`."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.variance_epsilon = eps
        self.kernel = False  # the Triton kernels (`Decoder.use_kernels`)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel:
            from llm_service.model.fused_ops import add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.variance_epsilon), x
            return add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is not None:
            x = residual + x
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype), x


def mrope_mix(per_row: torch.Tensor, section) -> torch.Tensor:
    """`(3, B, T, D)` cos or sin of each M-RoPE row (temporal, height, width) -> `(B, T, D)`: each
    row's part of the dimensions as `section` (over half of them, both halves alike) assigns them,
    as Qwen2-VL's `apply_multimodal_rotary_pos_emb` mixed them before its rotary module did."""
    parts = per_row.split(list(section) * 2, dim=-1)
    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `(T, heads, D)` rotated by `cos`/`sin` `(T, D)`, as `transformers`' `apply_rotary_pos_emb`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


@dataclass(frozen=True)
class AttentionSpec:
    """Where the families' attention layers differ."""

    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # an RMSNorm over each head's q and k before the rotary (Qwen3)


def qwen2_spec(config) -> AttentionSpec:
    return AttentionSpec(config.hidden_size // config.num_attention_heads, qkv_bias=True, o_bias=False, qk_norm=False)


def qwen3_spec(config) -> AttentionSpec:
    return AttentionSpec(config.head_dim, config.attention_bias, config.attention_bias, qk_norm=True)


class Attention(nn.Module):
    """Packed QKV projection, rotary on Q and K, paged attention, output projection."""

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, spec: AttentionSpec):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = spec.head_dim
        self.scaling = self.head_dim ** -0.5
        q, kv = self.num_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, (q, kv, kv), bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = Linear(q, (config.hidden_size,), bias=spec.o_bias, dtype=dtype)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.kernel = False  # rotary and the K/V write in one Triton kernel (`Decoder.use_kernels`)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: attention.AttentionBatch) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = (s.view(t, -1, d) for s in self.qkv_proj.split(self.qkv_proj(x)))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        if self.kernel:
            from llm_service.model.fused_ops import rotary_kv_write

            q = rotary_kv_write(q, k, v, cos, sin, *attention.layer_cache(batch, self.layer_idx), batch.slot_mapping)
            out = attention.attend(self.layer_idx, q, batch, self.scaling)
        else:
            out = attention.paged(self.layer_idx, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, batch,
                                  self.scaling)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up as one GEMM."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        from transformers.activations import ACT2FN

        inter = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, (inter, inter), bias=False, dtype=dtype)
        self.down_proj = Linear(inter, (config.hidden_size,), bias=False, dtype=dtype)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act == "silu"
        self.kernel = False  # SiLU x up in one Triton kernel (`Decoder.use_kernels`; SiLU only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernel:
            from llm_service.model.fused_ops import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = self.gate_up_proj.split(gate_up)
        return self.down_proj(self.act_fn(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, spec: AttentionSpec):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype, spec)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: attention.AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp output, residual stream)`: the residual add of the MLP is left to the next norm."""
        x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, cos, sin, batch), residual)
        return self.mlp(x), residual


class DecoderOutput(NamedTuple):
    last_hidden_state: torch.Tensor  # (1, T, hidden)


class Decoder(nn.Module):
    """The text model: `embed_tokens`, `layers`, `norm`; `rotary_emb` is the family's `transformers`
    rotary module (`forward(x, position_ids)` -> `(cos, sin)` `(1, T, head_dim)`, in `x`'s dtype)."""

    def __init__(self, config, dtype: torch.dtype, rotary_emb: nn.Module, spec: AttentionSpec):
        super().__init__()
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, spec) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = rotary_emb
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        self.mrope_section = rope.get("mrope_section")

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, paged_batch: attention.AttentionBatch,
                use_cache: bool = False, visual_pos_masks: torch.Tensor | None = None,
                deepstack_visual_embeds: list[torch.Tensor] | None = None) -> DecoderOutput:
        """The model runner's call: `inputs_embeds` `(1, T, hidden)` of the packed step,
        `position_ids` `(3, 1, T)`; `use_cache` is `transformers`' (the KV pool is the cache).
        DeepStack (Qwen3-VL), as `Qwen3VLTextModel` takes it: feature `k` `(num_visual, hidden)`
        added after layer `k` to the rows `visual_pos_masks` `(1, T)` marks."""
        x = inputs_embeds[0]
        cos, sin = self.rotary_emb(x, position_ids)
        if cos.dim() == 4:  # transformers before ~5.1x: a (1, T, D) per M-RoPE row, mixed by its attention
            cos, sin = mrope_mix(cos, self.mrope_section), mrope_mix(sin, self.mrope_section)
        cos, sin = cos[0], sin[0]
        deepstack = deepstack_visual_embeds or []
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, paged_batch)
            if i < len(deepstack):  # the layer's output whole, then the features added to it
                x, residual, mask = residual + x, None, visual_pos_masks[0]
                x[mask] = x[mask] + deepstack[i].to(x.dtype)
        x, _ = self.norm(x, residual)
        return DecoderOutput(x.unsqueeze(0))

    def use_kernels(self) -> dict[str, int]:
        """Run the norms, the SiLU MLPs and each attention's rotary + K/V write as Triton kernels
        (CUDA; float32 and narrower: the kernels compute in float32); {class name: modules}."""
        if self.embed_tokens.weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return {}
        used = [m for m in self.modules() if isinstance(m, (RMSNorm, Attention)) or (isinstance(m, MLP) and m.silu)]
        for module in used:
            module.kernel = True
        return dict(Counter(type(m).__name__ for m in used))


def pack_checkpoint_tensors(waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed projections (`PACKED`) made from the checkpoint's separate ones among `waiting`
    (module keys, e.g. `...self_attn.q_proj.weight`), each once all its parts are read (they may
    lie in different shard files); the parts used are removed from `waiting`."""
    made = {}
    for key in list(waiting):
        module, _, param = key.rpartition(".")
        owner, _, name = module.rpartition(".")
        for packed, parts in PACKED.items():
            keys = [f"{owner}.{part}.{param}" for part in parts]
            if name in parts and all(k in waiting for k in keys):
                made[f"{owner}.{packed}.{param}"] = torch.cat([waiting.pop(k) for k in keys], PACKED_DIM.get(param, 0))
    return made
