"""Step3 (`step3p7`): tiny checkpoint, router face == the processor's input_ids."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.families import router_face
from mmserve.media import MediaItem, MediaKind
from tests.media_factory import image_bytes
from tests.reference import load_reference, reference_generate


@pytest.fixture(scope="session")
def step3_dir(tmp_path_factory) -> str:
    from mmserve.tiny import ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return str(ensure_tiny_model("step3p7", os.path.join(root, "step3p7")))


def _prompt(*images: bytes, text: str = "Describe the image.") -> list[dict]:
    content = [{"type": "image", "bytes": b} for b in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


def test_tiny_keeps_the_real_layer_mix(step3_dir):
    _, model = load_reference(step3_dir)
    text = model.config.text_config
    assert {"full_attention", "sliding_attention"} == set(text.layer_types)
    assert {"dense", "sparse"} == set(text.mlp_layer_types)
    assert text.sliding_window < 64
    heads = {t: model.model.language_model.layers[i].self_attn.num_heads for i, t in enumerate(text.layer_types)}
    assert heads["sliding_attention"] != heads["full_attention"]


def test_greedy_tokens_depend_on_the_image(step3_dir):
    first = reference_generate(step3_dir, _prompt(image_bytes(64, 180, 1)), 12)
    second = reference_generate(step3_dir, _prompt(image_bytes(150, 90, 2)), 12)
    assert first != second
    _, model = load_reference(step3_dir)
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        zeroed = reference_generate(step3_dir, _prompt(image_bytes(64, 180, 1)), 12)
    finally:
        hook.remove()
    assert first != zeroed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(height=st.integers(8, 260), width=st.integers(8, 260), seed=st.integers(0, 3))
def test_router_expansion_equals_processor_input_ids(step3_dir, height, width, seed):
    from tests.reference import _pil

    processor, _ = load_reference(step3_dir)
    data = image_bytes(height, width, seed)
    expansion = router_face(step3_dir).expand(MediaItem(MediaKind.IMAGE, (data,)), 1 << 24)
    ids = processor(text=["<im_patch>"], images=[_pil(data)], return_tensors="pt")["input_ids"][0].tolist()
    assert list(expansion.token_ids) == ids
    assert expansion.num_embeds == sum(t == processor.image_token_id for t in ids) == expansion.cost
    assert [t == processor.image_token_id for t in ids] == list(expansion.is_embed)


def test_large_images_give_many_crops_and_video_is_refused(step3_dir):
    from mmserve.errors import InvalidRequest

    face = router_face(step3_dir)
    big = face.expand(MediaItem(MediaKind.IMAGE, (image_bytes(200, 200, 0),)), 1 << 24).layout
    small = face.expand(MediaItem(MediaKind.IMAGE, (image_bytes(50, 50, 0),)), 1 << 24).layout
    assert big.num_crops >= 9 and small.num_crops == 0
    assert face.placeholder(MediaKind.VIDEO) is None
    with pytest.raises(InvalidRequest):
        face.expand(MediaItem(MediaKind.VIDEO, (image_bytes(50, 50, 0),) * 2), 1 << 24)
