"""The tiny Qwen3-VL checkpoint: stock Auto classes load it, and its greedy tokens depend on the
image, on the image embeddings and on the DeepStack features (deterministic:
tests/families/test_tiny_model.py)."""

import torch

from mmserve.tiny import QWEN3_CHAT_TEMPLATE, QWEN3_SPECIAL_TOKENS
from tests.support.cases import image, image_question, video
from tests.support.reference import load_reference, reference_generate, reference_inputs


def test_loads_with_auto_classes_in_the_qwen3_vl_shape(qwen3_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(qwen3_dir)
    model = AutoModelForImageTextToText.from_pretrained(qwen3_dir)
    config = model.config
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert processor.chat_template == QWEN3_CHAT_TEMPLATE
    assert len(config.vision_config.deepstack_visual_indexes) >= 1
    assert len(model.model.visual.deepstack_merger_list) == len(config.vision_config.deepstack_visual_indexes)
    assert config.text_config.rope_parameters["mrope_interleaved"] is True
    tok = processor.tokenizer
    assert all(len(tok(t, add_special_tokens=False).input_ids) == 1 for t in QWEN3_SPECIAL_TOKENS)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert processor.apply_chat_template(chat, add_generation_prompt=True) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_video_prompt_has_a_timestamp_per_temporal_group(qwen3_dir):
    processor, _ = load_reference(qwen3_dir)
    messages = [{"role": "user", "content": [video(5, 64, 64, 3, fps=2.0)]}]
    text = processor.tokenizer.decode(reference_inputs(qwen3_dir, messages)["input_ids"][0])
    assert [s for s in ("<0.2 seconds>", "<1.2 seconds>", "<2.0 seconds>") if s in text] == [
        "<0.2 seconds>", "<1.2 seconds>", "<2.0 seconds>"]


def test_greedy_tokens_depend_on_the_images(qwen3_dir):
    one = reference_generate(qwen3_dir, image_question(image(64, 96, 1)), 12)
    two = reference_generate(qwen3_dir, image_question(image(64, 96, 1), image(80, 50, 2)), 12)
    assert len(one) == len(two) == 12
    assert one != two


def _zeroed(qwen3_dir, modules, prompt) -> list[int]:
    hooks = [m.register_forward_hook(lambda m, args, out: torch.zeros_like(out)) for m in modules]
    try:
        return reference_generate(qwen3_dir, prompt, 12)
    finally:
        for h in hooks:
            h.remove()


def test_greedy_tokens_depend_on_the_embeddings_and_on_the_deepstack_features(qwen3_dir):
    prompt = image_question(image(64, 96, 1))
    with_image = reference_generate(qwen3_dir, prompt, 12)
    _, model = load_reference(qwen3_dir)
    visual = model.model.visual
    assert _zeroed(qwen3_dir, [visual.merger], prompt) != with_image
    assert _zeroed(qwen3_dir, list(visual.deepstack_merger_list), prompt) != with_image
