"""The language model alone: decoder, embedding table and lm_head read from the checkpoint."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from llm_service.families.base import LMFace
from mmserve.checkpoint import load_config, load_weights, read_config, resolve_dtype
from mmserve.families import face_class, family_of

logger = logging.getLogger(__name__)


class LanguageModel:
    """Loads only the language-model tensors of `model_dir` (decoder, embedding table, lm_head)."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "cpu"):
        from transformers import GenerationConfig

        start = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.model_type = family_of(model_dir)
        self.dtype = resolve_dtype(dtype, read_config(model_dir))
        self.device = torch.device(device)
        config = load_config(model_dir)
        self.text_config = config.text_config
        self.face: LMFace = face_class("llm_service.families", self.model_type, "LM_FACE")(config)
        with torch.device(self.device):  # built where it runs, without initial values
            modules = self.face.build(self.dtype)
        self.load_report = load_weights(modules, model_dir, self.face.rename, convert=modules.convert,
                                 optional=modules.tied_keys())
        self.modules = modules.to(self.device).eval().requires_grad_(False)
        self.keys_read = self.load_report.keys_read
        try:
            gen = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            gen = GenerationConfig()
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.text_config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.generation_config = gen
        logger.info(
            "language model of %s loaded: %s; %.1fM params, %s on %s, %.1fs in all",
            self.model_dir.name, self.load_report.summary(), self.num_parameters / 1e6, self.dtype, self.device,
            time.perf_counter() - start,
        )

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.modules.parameters())

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)
