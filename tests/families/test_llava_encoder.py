"""LLaVA encoder math == transformers' own `LlavaModel.get_image_features` (float64)."""

import io

import pytest
import torch
from PIL import Image

from encoder_service.families.llava import LlavaVisionEncoder, feature_select, image_token_count, rename
from mmserve.checkpoint import load_weights
from tests.support.media_factory import image_bytes

TOWERS = {
    "clip": ("CLIPVisionConfig", dict(projection_dim=16)),
    "siglip": ("SiglipVisionConfig", dict(vision_use_head=True)),
}


def _llava(tower: str, layer, strategy: str, depth: int = 4, seed: int = 0):
    """A small random LlavaForConditionalGeneration (float64) of any tower / feature select."""
    import transformers

    config_cls, extra = TOWERS[tower]
    vision = getattr(transformers, config_cls)(
        hidden_size=16, intermediate_size=32, num_hidden_layers=depth, num_attention_heads=2,
        image_size=42, patch_size=14, **extra,
    )
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=63,
        vision_feature_layer=layer, vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(config).to(torch.float64).eval()


def _reference(model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=pixel_values)
    return torch.stack(list(out.pooler_output))


def _encoder(model_dir, dtype=torch.float64) -> tuple[LlavaVisionEncoder, tuple[str, ...]]:
    from transformers import AutoConfig

    encoder = LlavaVisionEncoder(AutoConfig.from_pretrained(model_dir), dtype)
    loaded = load_weights(encoder, model_dir, encoder.checkpoint_rename())
    return encoder.eval(), loaded.keys_read


def _pixels(model, batch: int = 3, seed: int = 0) -> torch.Tensor:
    size = model.config.vision_config.image_size
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize(
    ("tower", "layer", "strategy"),
    [
        ("clip", -2, "default"),
        ("clip", -1, "full"),
        ("clip", [-3, -1], "default"),
        ("clip", [2, 0], "full"),
        ("siglip", -1, "full"),
        ("siglip", -2, "default"),
        ("siglip", [-1, -4], "full"),
    ],
)
def test_feature_select_equals_get_image_features(tmp_path, tower, layer, strategy):
    model = _llava(tower, layer, strategy)
    model.save_pretrained(tmp_path)
    encoder, _ = _encoder(tmp_path)
    pixels = _pixels(model)
    with torch.inference_mode():
        ours = encoder(pixels)
    expected = _reference(model, pixels)
    assert ours.shape == expected.shape == (3, image_token_count(model.config), 32)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-10)


def test_tower_is_built_and_read_only_up_to_the_deepest_selected_layer(tmp_path):
    model = _llava("clip", [-4, -3], "default", depth=4)
    model.save_pretrained(tmp_path)
    encoder, keys_read = _encoder(tmp_path)
    # -3 of 4 layers is hidden_states[2], the output of layer index 1: two layers.
    assert feature_select(model.config).hidden_state_indices == (1, 2)
    assert len(encoder.layers) == 2 < len(model.model.vision_tower.encoder.layers)
    assert not [k for k in keys_read if ".layers.2." in k or ".layers.3." in k or "post_layernorm" in k]
    assert any(".layers.1." in k for k in keys_read)
    pixels = _pixels(model)
    with torch.inference_mode():
        torch.testing.assert_close(encoder(pixels), _reference(model, pixels), rtol=1e-10, atol=1e-10)


def test_tiny_checkpoints_match_and_load_truncated(llava_models):
    from transformers import AutoModelForImageTextToText

    for family, path in llava_models.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64).eval()
        encoder, keys_read = _encoder(path)
        full_depth = model.config.vision_config.num_hidden_layers
        # llava: layer -2 of 4 -> 3 layers; llava_siglip: layer -1 of 3 -> all 3.
        assert len(encoder.layers) == {"llava": full_depth - 1, "llava_siglip": full_depth}[family]
        assert all(rename(k) is not None for k in keys_read)
        assert not any("language_model" in k or "post_layernorm" in k for k in keys_read)
        pixels = _pixels(model, batch=2, seed=1)
        with torch.inference_mode():
            torch.testing.assert_close(encoder(pixels), _reference(model, pixels), rtol=1e-10, atol=1e-10)


def test_transformers_skips_post_layernorm_where_the_vllm_rule_applies_it(tmp_path):
    """The class is the reference: layer -1 is the pre-norm last hidden state (vLLM's generic rule
    would apply `post_layernorm` here); this shows the two rules give different features."""
    model = _llava("siglip", -1, "full")
    pixels = _pixels(model)
    tower = model.model.vision_tower
    with torch.inference_mode():
        last = tower(pixels, output_hidden_states=True).hidden_states[-1]
        normed = model.model.multi_modal_projector(tower.post_layernorm(last))
        torch.testing.assert_close(_reference(model, pixels), model.model.multi_modal_projector(last))
        assert not torch.allclose(normed, _reference(model, pixels))


@pytest.mark.parametrize("layout", ["transformers4", "in_memory5"])
def test_other_checkpoint_layouts_load_the_same_tensors(tmp_path, layout):
    from safetensors.torch import load_file, save_file

    model = _llava("clip", -2, "default")
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    if layout == "transformers4":  # hub llava-*-hf: the tower under `vision_model.`
        renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in saved.items()}
    else:  # LlavaForConditionalGeneration.state_dict() of transformers 5
        renamed = dict(model.state_dict())
    assert set(renamed) != set(saved)
    (tmp_path / layout).mkdir()
    save_file({k: v.contiguous() for k, v in renamed.items()}, tmp_path / layout / "model.safetensors")
    (tmp_path / layout / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    encoder, _ = _encoder(tmp_path / layout)
    reference, _ = _encoder(tmp_path / "saved")
    pixels = _pixels(model)
    with torch.inference_mode():
        assert torch.equal(encoder(pixels), reference(pixels))


def test_every_image_costs_the_same_as_the_processor_expands(llava_models):
    from transformers import AutoConfig, AutoProcessor

    for family, path in llava_models.items():
        processor = AutoProcessor.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        count = image_token_count(config)
        assert count == {"llava": 36, "llava_siglip": 25}[family]
        images = [Image.open(io.BytesIO(image_bytes(h, w, seed=h))) for h, w in [(20, 300), (84, 84), (500, 130)]]
        out = processor(text=["<image> a <image> b <image>"], images=images, return_tensors="pt")
        assert (out["input_ids"] == config.image_token_id).sum().item() == 3 * count
        size = config.vision_config.image_size
        assert tuple(out["pixel_values"].shape) == (3, 3, size, size)
        encoder, _ = _encoder(path)
        with torch.inference_mode():
            assert encoder(out["pixel_values"].to(torch.float64)).shape[1] == count


def test_out_of_range_feature_layer_is_rejected():
    model = _llava("clip", -2, "default", depth=2)
    model.config.vision_feature_layer = -4
    with pytest.raises(ValueError, match="outside a tower of 2 layers"):
        feature_select(model.config)


def test_batched_rows_equal_one_image_at_a_time(llava_models):
    for path in llava_models.values():
        encoder, _ = _encoder(path)
        size = encoder.embeddings.config.image_size
        pixels = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        with torch.inference_mode():
            batched = encoder(pixels)
            for i in range(3):
                torch.testing.assert_close(batched[i], encoder(pixels[i:i + 1])[0], rtol=1e-12, atol=1e-12)


def test_clip_processor_center_crops_and_siglip_processor_squeezes(llava_models):
    """Both give a fixed size whatever the input; CLIP (llava-1.5) resizes the shortest edge and
    crops the center, so the ends of a wide image never reach the tower; SigLIP resizes the whole
    image to the square."""
    from transformers import AutoProcessor

    wide = Image.new("RGB", (300, 100), (200, 30, 30))
    other_ends = wide.copy()
    other_ends.paste((30, 200, 30), (0, 0, 40, 100))
    other_ends.paste((30, 30, 200), (260, 0, 300, 100))
    for family, path in llava_models.items():
        image_processor = AutoProcessor.from_pretrained(path).image_processor
        a, b = (image_processor(images=[im], return_tensors="pt")["pixel_values"] for im in (wide, other_ends))
        assert a.shape[-2:] == b.shape[-2:] == image_processor(images=[Image.new("RGB", (7, 900))])["pixel_values"][0].shape[-2:]
        assert torch.equal(a, b) == (family == "llava")
