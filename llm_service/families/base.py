"""The LM face of a model family: its decoder, its checkpoint names, how media enter it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from llm_service.hybrid.state_cache import StateSpec
from llm_service.model.transfer import to_device
from mmserve.checkpoint import strip_prefix
from mmserve.inputs.positions import LinearPositions, PositionPlan


def decoder_key(key: str, prefixes: tuple[str, ...], lm_head_keys: tuple[str, ...] = ("lm_head.weight",)) -> str | None:
    """Checkpoint key -> `lm_head.weight` / `decoder.<key after the first of prefixes>` (None: neither)."""
    if key in lm_head_keys:
        return "lm_head.weight"
    name = strip_prefix(key, prefixes)
    return None if name is None else "decoder." + name


class LanguageModelModules(nn.Module):
    """Decoder stack (embeddings, layers, norm) + lm_head, named as the face's `rename` maps."""

    def __init__(self, decoder: nn.Module, lm_head: nn.Linear, tied: bool):
        super().__init__()
        self.decoder, self.lm_head, self.tied = decoder, lm_head, tied
        if tied:  # one tensor under both names; the checkpoint's lm_head.weight, if any, is not read
            self.lm_head.weight = decoder.embed_tokens.weight

    full_shapes: dict[str, tuple[int, ...]] = {}  # a tensor-parallel shard's: sharded key -> shape before the split
    # `transformers` `nn.Linear`s (a regular expression over module names) that a quantized
    # checkpoint's weights may turn into the engine's `layers.Linear` (`quantized.quantize_modules`)
    engine_linears: str | None = None

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter `name` in the whole model (a rank holds a part of some)."""
        return self.full_shapes.get(name) or tuple(self.get_parameter(name).shape)

    def tied_keys(self) -> frozenset[str]:
        """Module keys the loader leaves alone (tied to another tensor)."""
        return frozenset({"lm_head.weight"}) if self.tied else frozenset()

    def convert(self, waiting: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module tensors made from checkpoint tensors `rename` maps to names the modules do not
        have (a family's fused or split layout), removing those used from `waiting`; see
        `mmserve.checkpoint.load_weights`. None here."""
        return {}


class LMFace(ABC):
    """One family's language side, built from the checkpoint's `transformers` config (its modules
    a `modules_class`: one with a `convert` of the family's checkpoint layout)."""

    modules_class: type[LanguageModelModules] = LanguageModelModules

    def __init__(self, config):
        self.config = config

    @abstractmethod
    def rename(self, key: str) -> str | None:
        """Checkpoint key -> key in `LanguageModelModules` (None: not a language-model tensor)."""

    @abstractmethod
    def decoder_class(self) -> type[nn.Module]:
        """The `transformers` text decoder of `config.text_config`: what `build_decoder` makes,
        or, for a face that builds the engine's own decoder, its reference."""

    def build_decoder(self, dtype: torch.dtype) -> nn.Module:
        """The text decoder with uninitialised storage: `decoder_class`'s, unless the face owns one."""
        return self.decoder_class()._from_config(self.config.text_config, dtype=dtype)

    def build(self, dtype: torch.dtype) -> LanguageModelModules:
        """Decoder + lm_head with uninitialised storage on the current default device (the caller
        streams the weights in); a tied lm_head gets no storage of its own."""
        from transformers.initialization import no_init_weights

        text = self.config.text_config
        tied = any(getattr(c, "tie_word_embeddings", False) for c in (self.config, text))
        with no_init_weights():
            decoder = self.build_decoder(dtype)
            lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False, dtype=dtype,
                                device="meta" if tied else None)
        return self.modules_class(decoder, lm_head, tied)

    def text_positions(self) -> PositionPlan:
        """The plan of a prompt without media (requests that come without one); 1-D unless the
        family's positions have more rows (M-RoPE)."""
        return LinearPositions(rows=1)

    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """`(rows, T)` positions of one packed sequence -> the decoder's `position_ids`; 1-D:
        `(1, T)` is the decoder's `(batch=1, T)` as it is."""
        return positions

    def inject(self, embeds: torch.Tensor, media: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]) -> dict:
        """Write each item's rows (`parts[0]`) into the packed `embeds` `(T, hidden)` at its slot
        indices; return the extra keyword arguments of this forward's decoder call (families with
        per-layer features, e.g. Qwen3-VL DeepStack, pass their further parts there)."""
        for index, parts in media:
            embeds[to_device(index, embeds.device)] = to_device(parts[0], embeds.device).to(embeds.dtype)
        return {}

    def state_layers(self) -> tuple[StateSpec, ...]:
        """The decoder layers that keep a recurrent state per sequence instead of K/V (linear
        attention), with that state's shapes; () for a decoder of attention layers only.

        When there are any, the engine gives each running sequence a state slot (sized from the
        KV memory budget, CUDA graphs off; prefix caching through state snapshots), the KV pool
        covers only the other layers, and every forward passes the step's `StateBatch` to the
        decoder as the `state_batch` keyword: these layers must run the packed step from it (each
        sequence's rows continue the state of its slot, which starts at zeros or at a snapshot
        the engine copied in) and write the state back."""
        return ()
