"""The language model alone: decoder, embedding table and lm_head read from the checkpoint."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from llm_service.families.base import LMFace
from llm_service.model import layers, quantized, tensor_parallel
from mmserve.checkpoint import load_config, load_weights, read_config, resolve_dtype, weight_bytes
from mmserve.families import face_class, family_of

logger = logging.getLogger(__name__)


def weight_split(model_dir: str | Path, dtype: str = "auto") -> tuple[int, int]:
    """(bytes of the language model's weights, bytes of the rest: vision tower and projector) in
    `dtype`, from the checkpoint's headers alone (nothing loaded): how a GPU is shared between them."""
    face = face_class("llm_service.families", family_of(model_dir), "LM_FACE")(load_config(model_dir))
    served = resolve_dtype(dtype, read_config(model_dir))
    lm = weight_bytes(model_dir, lambda key: face.rename(key) is not None, served)
    return lm, weight_bytes(model_dir, lambda key: face.rename(key) is None, served)


class LanguageModel:
    """Loads only the language-model tensors of `model_dir` (decoder, embedding table, lm_head)."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "cpu", tp=None):
        """`tp`: this process's `TPGroup` when the replica is tensor-parallel; it then holds its
        rank's shard (`llm_service.model.tensor_parallel`)."""
        from transformers import GenerationConfig

        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.model_type = family_of(model_dir)
        self.dtype = resolve_dtype(dtype, read_config(model_dir))
        self.device = torch.device(device)
        config = load_config(model_dir)
        self.text_config = config.text_config
        self.face: LMFace = face_class("llm_service.families", self.model_type, "LM_FACE")(config)
        self.tp = tp
        rename, take = self.face.rename, None
        self.quantization = fmt = quantized.read_format(model_dir)
        if fmt is not None and tp is not None:
            raise ValueError(f"{self.model_dir.name}: tensor-parallel serving of {fmt.name} checkpoints "
                             "is not supported yet")
        # built where it runs, without initial values; quantized or sharded, with parameters on meta until
        # each has its stored dtype or shard's shape (no full-precision or whole copy)
        with torch.device(self.device), tensor_parallel.parameters_on_meta() if fmt or tp else contextlib.nullcontext():
            modules = self.face.build(self.dtype)
        if fmt is not None:
            quantized.quantize_modules(modules, model_dir, rename, fmt, self.device)
        elif tp is not None:
            take = self._shard(modules, tp)
        self.load_report = load_weights(modules, model_dir, rename, convert=modules.convert,
                                        optional=modules.tied_keys(), take=take)
        self.modules = modules.to(self.device).eval().requires_grad_(False)
        self.keys_read = self.load_report.keys_read
        try:
            gen = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            gen = GenerationConfig()
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.text_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.generation_config = gen
        logger.info("language model of %s loaded: %s; %.1fM params, %s%s on %s, %.1fs in all", self.model_dir.name,
                    self.load_report.summary(), self.num_parameters / 1e6, self.dtype,
                    f" with {fmt.name} weights" if fmt else "", self.device, time.perf_counter() - start)

    def _shard(self, modules, tp):
        """This rank's storage of `modules` in their shard's shape (the embedding table and `lm_head`
        split by vocabulary); the loader's `take` (the shard of a tensor)."""
        plan = tensor_parallel.plan_shards(modules.decoder, tp.rank, tp.size, vocab=self.vocab_size)
        tensor_parallel.materialize(modules, plan, self.device)
        tensor_parallel.split_embedding(modules.decoder.embed_tokens, tp, self.vocab_size)
        tensor_parallel.install_all_reduces(modules.decoder, tp)
        return plan.take

    def state_layers(self):
        """The face's state layers, in the shapes this process holds (its rank's heads)."""
        specs = self.face.state_layers()
        return specs if self.tp is None else tensor_parallel.local_state_specs(specs, self.modules.decoder)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this process holds (its rank's under tensor parallelism)."""
        decoder = self.modules.decoder
        for layer in decoder.layers:
            if (attn := getattr(layer, "self_attn", None)) is not None:
                packed = getattr(attn, "qkv_proj", None)  # the engine's own layer: [q | k | v]
                k_proj = getattr(attn, "k_proj", None)  # `transformers`' (an engine `Linear` when quantized)
                k_rows = (packed.output_sizes[1] if packed is not None else k_proj.output_sizes[0]
                          if isinstance(k_proj, layers.Linear) else k_proj.weight.shape[0])
                return int(k_rows // attn.head_dim)
        return int(self.text_config.num_key_value_heads)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.modules.parameters())

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)
