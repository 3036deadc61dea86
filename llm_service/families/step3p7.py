"""LM face of Step3 (`model_type: step3p7`): `Step3p7TextModel` as it is (full and sliding-window
layers with their own head counts and RoPE theta, per-head gate, dense and MoE MLPs), 1-D positions.

Sliding-window layers need the paged engine's window masks (`llm_service.model.attention`, CPU SDPA
path); the engine refuses the model on a backend without them. `use_bidirectional_attention`
(a bidirectional window overlay) is not served.

Checkpoint layouts:
- hub (what `save_pretrained` writes): `model.{embed_tokens,layers,norm}.*`, MoE as
  `layers.N.moe.{gate.weight,router_bias,gate_proj.weight,up_proj.weight,down_proj.weight}` and
  `layers.N.share_expert.*`; converted here as transformers' `step3p7` conversion mapping does
  (renames; gate_proj and up_proj concatenated on dim 1 into `mlp.experts.gate_up_proj`). Trailing
  MTP layers (index >= num_hidden_layers) are not read.
- in memory: `model.language_model.*`, `lm_head.weight`.
"""

from __future__ import annotations

import re

import torch

from llm_service.families.base import LanguageModelModules, LMFace
from mmserve.checkpoint import strip_prefix

_HUB_MOE = (
    (r"\.moe\.gate\.weight$", ".mlp.gate.weight"),
    (r"\.moe\.router_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.moe\.down_proj\.weight$", ".mlp.experts.down_proj"),
    (r"\.moe\.gate_proj\.weight$", ".mlp.experts.gate_proj"),  # joined with up_proj on load
    (r"\.moe\.up_proj\.weight$", ".mlp.experts.up_proj"),
    (r"\.share_expert\.", ".mlp.shared_experts."),
)


def rename(key: str, num_layers: int) -> str | None:
    if key == "lm_head.weight":
        return key
    name = strip_prefix(key, ("model.language_model.", "model."))
    if name is None or name.startswith(("vision_model.", "multi_modal_projector.")):
        return None
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer and int(layer.group(1)) >= num_layers:
        return None  # MTP layers
    for pattern, target in _HUB_MOE:
        name = re.sub(pattern, target, name)
    return "decoder." + name


class Step3LanguageModel(LanguageModelModules):
    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hub layout: an MoE layer's gate_proj and up_proj (possibly in different shard files)
        become its `gate_up_proj` once both are read."""
        made = {}
        for key in [k for k in waiting if k.endswith(".mlp.experts.gate_proj")]:
            base = key[: -len("gate_proj")]
            if base + "up_proj" in waiting:
                made[base + "gate_up_proj"] = torch.cat([waiting.pop(key), waiting.pop(base + "up_proj")], dim=1)
        return made


class Step3LMFace(LMFace):
    modules_class = Step3LanguageModel

    def __init__(self, config):
        super().__init__(config)
        if getattr(config.text_config, "use_bidirectional_attention", False):
            raise ValueError("Step3 with use_bidirectional_attention is not supported by the paged engine")

    def rename(self, key: str) -> str | None:
        return rename(key, self.config.text_config.num_hidden_layers)

    def decoder_class(self) -> type:
        from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

        return Step3p7TextModel


LM_FACE = Step3LMFace
