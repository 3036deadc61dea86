"""LLaVA's text decoder, built from the config and loaded with renamed tensors, == the monolithic model."""

import torch

from llm_service.families.llava import LlavaLMFace, decoder_class, rename
from mmserve.checkpoint import load_weights


def test_decoder_class_is_the_text_configs_base_model(llava_models):
    from transformers import AutoConfig, LlamaModel, Qwen2Model

    classes = {f: decoder_class(AutoConfig.from_pretrained(p)) for f, p in llava_models.items()}
    assert classes == {"llava": LlamaModel, "llava_siglip": Qwen2Model}


def test_rename_covers_every_layout():
    for key in ("model.language_model.layers.0.mlp.up_proj.weight", "language_model.model.layers.0.mlp.up_proj.weight"):
        assert rename(key) == "decoder.layers.0.mlp.up_proj.weight"
    assert rename("lm_head.weight") == rename("language_model.lm_head.weight") == "lm_head.weight"
    for key in ("vision_tower.encoder.layers.0.mlp.fc1.weight", "model.multi_modal_projector.linear_1.weight",
                "vision_tower.vision_model.post_layernorm.weight"):
        assert rename(key) is None


def test_decoder_and_lm_head_reproduce_the_monolithic_logits(llava_models):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    for family, path in llava_models.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64).eval()
        face = LlavaLMFace(model.config)
        modules = face.build(torch.float64)
        loaded = load_weights(modules, path, rename, optional=modules.tied_keys())
        assert modules.tied == (family == "llava_siglip")
        assert modules.tied == (modules.lm_head.weight is modules.decoder.embed_tokens.weight)
        assert not [k for k in loaded.keys_read if "vision" in k or "projector" in k]

        processor = AutoProcessor.from_pretrained(path)
        chat = [{"role": "user", "content": [{"type": "text", "text": "Tell me about the sky and the sea."}]}]
        ids = processor(text=[processor.apply_chat_template(chat, add_generation_prompt=True)], return_tensors="pt")
        input_ids = ids["input_ids"]
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        with torch.inference_mode():
            expected = model(input_ids=input_ids).logits
            decoder = modules.decoder
            hidden = decoder(inputs_embeds=decoder.embed_tokens(input_ids), position_ids=positions).last_hidden_state
            torch.testing.assert_close(modules.lm_head(hidden), expected, rtol=1e-10, atol=1e-10)
