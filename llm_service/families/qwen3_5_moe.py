"""LM face of Qwen3.5-MoE: Qwen3.5's (hybrid decoder, state layers, M-RoPE) with the sparse
decoder `Qwen3_5MoeTextModel`.

Every layer's MLP is a sparse block: `transformers`' softmax top-k router and its shared expert
(behind a sigmoid gate) as they are, the routed experts on the engine's experts path
(`llm_service.model.experts`, bound by the model runner onto the `(E, 2I, H)` / `(E, H, I)` experts
modules). The published checkpoints hold the experts in that layout (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`); a checkpoint with one tensor per expert (`mlp.experts.<j>.gate_proj`,
`up_proj`, `down_proj`, the layout `transformers` also reads for `qwen3_5_moe_text`) is stacked
into it on load.
"""

from __future__ import annotations

import re

import torch

from llm_service.families.base import LanguageModelModules
from llm_service.families.qwen3_5 import Qwen3_5LMFace

_PER_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3_5MoeLanguageModel(LanguageModelModules):
    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A layer's experts stacked once all its per-expert tensors have arrived."""
        made = {}
        for prefix in {m.group(1) for m in map(_PER_EXPERT.match, waiting) if m}:
            num_experts = self.get_parameter(prefix + ".down_proj").shape[0]
            names = {(j, part): f"{prefix}.{j}.{part}.weight"
                     for j in range(num_experts) for part in ("gate_proj", "up_proj", "down_proj")}
            if not all(n in waiting for n in names.values()):
                continue
            pop = {key: waiting.pop(name) for key, name in names.items()}
            made[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([pop[j, "gate_proj"], pop[j, "up_proj"]]) for j in range(num_experts)])
            made[prefix + ".down_proj"] = torch.stack([pop[j, "down_proj"] for j in range(num_experts)])
        return made


class Qwen3_5MoeLMFace(Qwen3_5LMFace):
    modules_class = Qwen3_5MoeLanguageModel

    def decoder_class(self) -> type:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel

        return Qwen3_5MoeTextModel


LM_FACE = Qwen3_5MoeLMFace
