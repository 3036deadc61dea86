"""The `qwen3_5_text` hybrid decoder as the engine runs it (MiniCPM-V 4.6's LM; Qwen3.5's too).

`config.layer_types` says which layers are Gated-DeltaNet linear attention (3 of every 4 in the
released models) and which are full attention. Full-attention layers keep the paged path (their
K/V in the block pool). Linear-attention layers keep a per-sequence state instead: their module
becomes `PackedGatedDeltaNet`, the same module (parameters, names, checkpoint keys) with a
forward over the packed step that reads and writes the sequences' state slots
(`llm_service.hybrid.gated_deltanet`). Faces built on this decoder declare those layers through
`state_layers`, so the engine gives every running sequence a slot.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from llm_service.families.base import LanguageModelModules, LMFace
from llm_service.hybrid.gated_deltanet import causal_conv1d, gated_delta_rule
from llm_service.hybrid.state_cache import StateBatch, StateSpec

LINEAR_ATTENTION = "linear_attention"


class PackedGatedDeltaNet(Qwen3_5GatedDeltaNet):
    """`Qwen3_5GatedDeltaNet` over the engine's packed step: `hidden_states` `(1, T, hidden)` holds
    every scheduled sequence's rows; the step's `StateBatch` arrives as the `state_batch` keyword
    (without it, the `transformers` forward runs unchanged)."""

    def forward(self, hidden_states: torch.Tensor, cache_params=None, attention_mask=None, **kwargs) -> torch.Tensor:
        states: StateBatch | None = kwargs.get("state_batch")
        if states is None:
            return super().forward(hidden_states, cache_params, attention_mask, **kwargs)
        x = hidden_states[0]
        rows = x.shape[0]
        mixed_qkv = causal_conv1d(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                  states.pool.conv[self.layer_idx], states, ACT2FN[self.activation])
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query, key = (t.reshape(rows, -1, self.head_k_dim) for t in (query, key))
        value = value.reshape(rows, -1, self.head_v_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * torch.nn.functional.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = gated_delta_rule(query, key, value, g, beta, states.pool.recurrent[self.layer_idx], states)
        z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
        out = self.norm(out.reshape(-1, self.head_v_dim), z).reshape(rows, -1)
        return self.out_proj(out).unsqueeze(0)


def state_layers(text_config) -> tuple[StateSpec, ...]:
    """A `StateSpec` per linear-attention layer: conv window `(2 * key dim + value dim, kernel - 1)`,
    recurrent state `(value heads, key head dim, value head dim)`."""
    c = text_config
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    return tuple(StateSpec(i, (channels, c.linear_conv_kernel_dim - 1), shape)
                 for i, t in enumerate(c.layer_types[:c.num_hidden_layers]) if t == LINEAR_ATTENTION)


class HybridLMFace(LMFace):
    """A face on this decoder (`Qwen3_5TextModel` unless a subclass says otherwise): its
    linear-attention layers declared (`state_layers`) and run on the packed step."""

    def decoder_class(self) -> type:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

        return Qwen3_5TextModel

    def state_layers(self) -> tuple[StateSpec, ...]:
        return state_layers(self.config.text_config)

    def build(self, dtype: torch.dtype) -> LanguageModelModules:
        modules = super().build(dtype)
        for layer in modules.decoder.layers:
            if layer.block_type == LINEAR_ATTENTION:
                layer.linear_attn.__class__ = PackedGatedDeltaNet  # same module and weights, packed forward
        return modules
