"""Tiny Qwen3.5-MoE (`qwen3_5_moe`): Qwen3.5's tiny checkpoint with every decoder MLP a sparse block
as in Qwen/Qwen3.5-35B-A3B: a softmax router over 16 experts of width 48, 4 per token renormalised,
plus a shared expert of width 32 behind a sigmoid gate. The experts are saved in transformers'
layout (`gate_up_proj` `(E, 2I, H)`, `down_proj` `(E, H, I)`; 2I and I differ from H).
"""

from __future__ import annotations

from mmserve.tiny import qwen3_5
from mmserve.tiny.qwen3_vl_moe import EXPERTS_PER_TOKEN, MOE_INTERMEDIATE_SIZE, NUM_EXPERTS  # the same experts

VARIANTS: dict[str, str] = {}

SHARED_EXPERT_INTERMEDIATE_SIZE = 32


def config(tokenizer):
    from transformers import Qwen3_5MoeConfig

    return qwen3_5.config(tokenizer, Qwen3_5MoeConfig, num_experts=NUM_EXPERTS,
                          num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
                          shared_expert_intermediate_size=SHARED_EXPERT_INTERMEDIATE_SIZE)


def build(name: str, seed: int):
    return qwen3_5.build(name, seed, config)
