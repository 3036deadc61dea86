"""LM face of Qwen3-VL-MoE: Qwen3-VL's (interleaved M-RoPE, DeepStack) with the sparse decoder.

Every sparse layer's experts run on the engine's experts path (`llm_service.model.experts`, bound by
the model runner); the router (softmax, top-k renormalised) is `transformers`' own.

Checkpoint layouts of the experts: the published checkpoints (Qwen/Qwen3-VL-30B-A3B-*) hold
`mlp.experts.gate_up_proj` `(E, H, 2I)` and `mlp.experts.down_proj` `(E, I, H)`, transposed
against `transformers`' modules (`(E, 2I, H)`, `(E, H, I)`), as its `qwen3_vl_moe` conversion
mapping says; `save_pretrained` writes the modules' layout. Both load: a tensor is transposed when
its shape is the published one. The quantized releases (Qwen3-VL-30B-A3B-Instruct-FP8) store one
projection per expert instead (`mlp.experts.<j>.gate_proj.weight` + `weight_scale_inv`, `up_proj`,
`down_proj`), each written into its slice of the stacked tensors as it is read
(`experts.PerExpertLoader`); their attention projections, quantized too, become the engine's
`Linear` (`engine_linears`), the router (`mlp.gate`) stays as stored.
"""

from __future__ import annotations

import torch

from llm_service.families.base import LanguageModelModules
from llm_service.families.qwen3_vl import Qwen3VLLMFace
from llm_service.model import experts

_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_AS_STORED = "@stored"  # suffix of an experts tensor waiting for its layout check


class Qwen3VLMoeLanguageModel(LanguageModelModules):
    engine_linears = r"decoder\.layers\.\d+\.self_attn\.[qkvo]_proj"  # `quantized.quantize_modules`

    def __init__(self, decoder, lm_head, tied: bool):
        super().__init__(decoder, lm_head, tied)
        self.per_expert = experts.PerExpertLoader(self)

    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        made = self.per_expert(waiting)
        for key in [k for k in waiting if k.endswith(_AS_STORED)]:
            name = key[: -len(_AS_STORED)]
            tensor, shape = waiting.pop(key), self.full_shape(name)
            made[name] = tensor if tuple(tensor.shape) == shape else tensor.transpose(1, 2)
        return made


class Qwen3VLMoeLMFace(Qwen3VLLMFace):
    modules_class = Qwen3VLMoeLanguageModel

    def rename(self, key: str) -> str | None:
        name = super().rename(key)
        return name + _AS_STORED if name is not None and name.endswith(_EXPERTS) else name

    def decoder_class(self) -> type:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextModel

        return Qwen3VLMoeTextModel


LM_FACE = Qwen3VLMoeLMFace
