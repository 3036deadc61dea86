"""Tiny Qwen3-VL-MoE (`qwen3_vl_moe`): Qwen3-VL's tiny checkpoint with every decoder MLP a sparse
block as in Qwen/Qwen3-VL-30B-A3B-Instruct (softmax router, top-k renormalised, no shared expert):
16 experts of width 48, 4 per token. The experts are saved in transformers' layout, `gate_up_proj`
`(E, 2I, H)` and `down_proj` `(E, H, I)`; 2I and I differ from H so the published transposed
layout, which the LM face reads too, cannot be confused with it.
"""

from __future__ import annotations

from mmserve.tiny import qwen3_vl

VARIANTS: dict[str, str] = {}

NUM_EXPERTS = 16
EXPERTS_PER_TOKEN = 4
MOE_INTERMEDIATE_SIZE = 48


def config(tokenizer):
    from transformers import Qwen3VLMoeConfig

    return qwen3_vl.config(tokenizer, Qwen3VLMoeConfig, num_experts=NUM_EXPERTS,
                           num_experts_per_tok=EXPERTS_PER_TOKEN, moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
                           decoder_sparse_step=1, mlp_only_layers=[])


def build(name: str, seed: int):
    return qwen3_vl.build(name, seed, config)
