"""The encoder runtime holds only vision weights, the LLM runtime only language-model weights.

Together they read every tensor of the checkpoint exactly once, and hold exactly the parameters of
the monolithic `transformers` model (same values).
"""

from __future__ import annotations

import functools

import torch

from llm_service.model import layers

VISION_NAMES = ("blocks.", "merger", "patch_embed")
DECODER_NAMES = ("embed_tokens", "lm_head", "layers.")


@functools.lru_cache(maxsize=4)
def _encoder(model_dir: str):
    from encoder_service import VisionEncoder

    return VisionEncoder(model_dir, dtype="float32")


@functools.lru_cache(maxsize=4)
def _llm(model_dir: str):
    from llm_service.model.language_model import LanguageModel

    return LanguageModel(model_dir, dtype="float32")


@functools.lru_cache(maxsize=4)
def _monolithic(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _checkpoint_keys(model_dir: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
        return set(f.keys())


def test_keys_read_split_the_checkpoint(model_dir):
    enc_keys, llm_keys = _encoder(model_dir).keys_read, _llm(model_dir).keys_read
    assert enc_keys and llm_keys
    assert all(k.startswith("visual.") for k in enc_keys), [k for k in enc_keys if not k.startswith("visual.")]
    assert not any(k.startswith("visual.") for k in llm_keys), [k for k in llm_keys if k.startswith("visual.")]
    # each key read once
    assert len(set(enc_keys)) == len(enc_keys)
    assert len(set(llm_keys)) == len(llm_keys)
    assert set(enc_keys).isdisjoint(llm_keys)
    assert set(enc_keys) | set(llm_keys) == _checkpoint_keys(model_dir)
    assert "lm_head.weight" in llm_keys


def test_parameter_counts_add_up_to_the_monolithic_model(model_dir):
    mono = _monolithic(model_dir)
    assert not mono.config.tie_word_embeddings  # tiny checkpoints: lm_head is its own tensor
    mono_count = sum(p.numel() for p in mono.parameters())
    enc, llm = _encoder(model_dir), _llm(model_dir)
    assert enc.num_parameters == sum(p.numel() for p in mono.model.visual.parameters())
    assert enc.num_parameters + llm.num_parameters == mono_count


def test_no_cross_parameters(model_dir):
    enc_names = [n for n, _ in _encoder(model_dir).tower.named_parameters()]
    llm_names = [n for n, _ in _llm(model_dir).modules.named_parameters()]
    assert enc_names and llm_names
    assert any(n.startswith("blocks.") for n in enc_names)
    assert any("embed_tokens" in n for n in llm_names) and any("lm_head" in n for n in llm_names)
    assert not [n for n in enc_names if any(d in n for d in DECODER_NAMES)]
    assert not [n for n in llm_names if any(v in n for v in VISION_NAMES)]


def test_weights_equal_the_monolithic_model(model_dir):
    """Same tensors, not just the same shapes: the split runtimes load what `transformers` loads."""
    mono = _monolithic(model_dir)
    enc_params = dict(_encoder(model_dir).tower.named_parameters())
    mono_vis = dict(mono.model.visual.named_parameters())
    assert enc_params.keys() == mono_vis.keys()
    for name, p in enc_params.items():
        assert torch.equal(p, mono_vis[name]), name

    llm = _llm(model_dir).modules
    mono_dec = dict(mono.model.language_model.named_parameters())
    # the engine's own decoder packs q | k | v and gate | up (tests/unit/test_owned_layer.py checks the slices)
    mono_dec |= layers.pack_checkpoint_tensors(mono_dec)
    dec_params = dict(llm.decoder.named_parameters())
    assert dec_params.keys() == mono_dec.keys()
    for name, p in dec_params.items():
        assert torch.equal(p, mono_dec[name]), name
    assert torch.equal(llm.lm_head.weight, mono.lm_head.weight)
