"""The tiny LLaVA checkpoints: stock Auto classes load them in the imitated shapes, they are
image-sensitive (deterministic: tests/families/test_tiny_model.py)."""

import pytest
import torch

from mmserve.tiny import LLAVA_CHAT_TEMPLATE, LLAVA_FAMILIES, LLAVA_IMAGE_TOKEN, LLAVA_QWEN_CHAT_TEMPLATE
from tests.support.cases import image, image_question
from tests.support.reference import load_reference, reference_generate

SHAPES = {
    # family: (tower model_type, LM model_type, feature layer, strategy, tied lm_head, template)
    "llava": ("clip_vision_model", "llama", -2, "default", False, LLAVA_CHAT_TEMPLATE),
    "llava_siglip": ("siglip_vision_model", "qwen2", -1, "full", True, LLAVA_QWEN_CHAT_TEMPLATE),
}


@pytest.fixture(params=LLAVA_FAMILIES)
def llava_dir(request, llava_models) -> tuple[str, str]:
    return request.param, llava_models[request.param]


def test_loads_with_auto_classes_in_the_imitated_shape(llava_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    family, path = llava_dir
    tower, lm, layer, strategy, tied, template = SHAPES[family]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    config = model.config
    assert config.model_type == "llava"
    assert (config.vision_config.model_type, config.text_config.model_type) == (tower, lm)
    assert (config.vision_feature_layer, config.vision_feature_select_strategy) == (layer, strategy)
    assert config.image_token_id == processor.tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN)
    assert processor.image_token == LLAVA_IMAGE_TOKEN
    assert processor.chat_template == template
    assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tied
    grid = config.vision_config.image_size // config.vision_config.patch_size
    assert config.image_seq_length == grid * grid


def test_chat_template_places_the_image_like_the_imitated_checkpoint(llava_models):
    from transformers import AutoProcessor

    chat = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    render = {
        f: AutoProcessor.from_pretrained(llava_models[f]).apply_chat_template(chat, add_generation_prompt=True)
        for f in LLAVA_FAMILIES
    }
    assert render["llava"] == "USER: <image>\nHi ASSISTANT:"
    assert render["llava_siglip"] == "<|im_start|>user\n<image>\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_llava_tokenizer_prepends_bos_like_llama(llava_models):
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(llava_models["llava"])
    qwen = AutoTokenizer.from_pretrained(llava_models["llava_siglip"])
    assert llama("USER: hi").input_ids[0] == llama.bos_token_id
    assert qwen("USER: hi").input_ids == qwen("USER: hi", add_special_tokens=False).input_ids


def test_greedy_tokens_depend_on_the_image(llava_dir):
    _, path = llava_dir
    first = reference_generate(path, image_question(image(64, 96, 1)), 12)
    second = reference_generate(path, image_question(image(80, 50, 2)), 12)
    assert len(first) == len(second) == 12
    assert first != second


def test_greedy_tokens_depend_on_the_image_embeddings(llava_dir):
    _, path = llava_dir
    prompt = image_question(image(64, 96, 1))
    with_image = reference_generate(path, prompt, 12)
    _, model = load_reference(path)
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    try:
        zeroed = reference_generate(path, prompt, 12)
    finally:
        hook.remove()
    assert with_image != zeroed
