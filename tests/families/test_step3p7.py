"""Step3 (`step3p7`): tiny checkpoint, router face == the processor's input_ids, encoder face ==
the in-tree image features, the engine's per-layer windows. (Served == `transformers` monolithic
`generate`: tests/families/test_equivalence_runtime.py, tests/serve/test_family_serve.py; the CLI
builds it deterministically: tests/families/test_tiny_model.py.)"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.families import router_face
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.cases import image, image_question
from tests.support.media_factory import image_bytes
from tests.support.reference import load_reference, reference_generate


def test_tiny_keeps_the_real_layer_mix(step3_dir):
    _, model = load_reference(step3_dir)
    text = model.config.text_config
    assert {"full_attention", "sliding_attention"} == set(text.layer_types)
    assert {"dense", "sparse"} == set(text.mlp_layer_types)
    assert text.sliding_window < 64
    heads = {t: model.model.language_model.layers[i].self_attn.num_heads for i, t in enumerate(text.layer_types)}
    assert heads["sliding_attention"] != heads["full_attention"]


def test_greedy_tokens_depend_on_the_image(step3_dir):
    first = reference_generate(step3_dir, image_question(image(64, 180, 1)), 12)
    second = reference_generate(step3_dir, image_question(image(150, 90, 2)), 12)
    assert first != second
    _, model = load_reference(step3_dir)
    hook = model.model.multi_modal_projector.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    try:
        zeroed = reference_generate(step3_dir, image_question(image(64, 180, 1)), 12)
    finally:
        hook.remove()
    assert first != zeroed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(height=st.integers(8, 260), width=st.integers(8, 260), seed=st.integers(0, 3))
def test_router_expansion_equals_processor_input_ids(step3_dir, height, width, seed):
    from tests.support.reference import _pil

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


def _features(step3_dir, images: list[bytes]) -> list[torch.Tensor]:
    from tests.support.reference import _pil

    processor, model = load_reference(step3_dir)
    inputs = processor.image_processor(images=[_pil(b) for b in images], return_tensors="pt")
    with torch.inference_mode():
        out = model.model.get_image_features(
            pixel_values=inputs["pixel_values"].to(torch.float64),
            pixel_values_local=inputs["pixel_values_local"].to(torch.float64) if "pixel_values_local" in inputs else None,
            num_local_patches=inputs["num_local_patches"],
        )
    return list(out.pooler_output)


SIZES = ((200, 200), (50, 50), (60, 180), (130, 90))


def test_encoder_equals_in_tree_image_features_and_split_pieces_concatenate(step3_dir):
    from tests.families.test_encoder_equivalence import encoder

    enc = encoder(step3_dir, "float64")
    images = [image_bytes(h, w, k) for k, (h, w) in enumerate(SIZES)]
    expected = _features(step3_dir, images)
    items = [enc.plan(MediaItem(MediaKind.IMAGE, (b,))) for b in images]
    got = [e.rows for e in enc.encode(items)]
    assert [g.shape[0] for g in got] == [i.cost for i in items] == [e.shape[0] for e in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)
    prepared = enc.preprocess(items[0])  # 16 crops x 4 tokens + 16 global tokens
    for budget, sizes in ((4, [4] * 16 + [16]), (20, [20, 20, 20, 20]), (24, [24, 24, 16, 16]), (80, [80])):
        pieces = enc.split(prepared, budget, "tokens")
        assert [p.num_tokens for p in pieces] == sizes
        rows = torch.cat([parts[0] for piece in pieces for parts in enc.forward([piece])])
        torch.testing.assert_close(rows, expected[0], rtol=0, atol=1e-10)


def test_pooled_crops_split_across_batches_equal_whole_images(step3_dir):
    import asyncio

    from encoder_service.batching import BatchConfig
    from tests.families.test_encoder_equivalence import CountingEncoder, encoder, pooled

    enc = CountingEncoder(encoder(step3_dir, "float64"))
    images = [image_bytes(h, w, 10 + k) for k, (h, w) in enumerate(SIZES)]
    expected = _features(step3_dir, images)
    items = [MediaItem(MediaKind.IMAGE, (b,)) for b in images]
    got = asyncio.run(pooled(enc, items, BatchConfig(max_batch_tokens=24, batch_wait_ms=30), per_request=2))
    assert sum(enc.forward_sizes) > len(items)  # the large images went through in pieces
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)


def test_long_prompt_is_long(step3_dir):
    processor, model = load_reference(step3_dir)
    tokens = len(processor.tokenizer("the cat sat on the mat " * 12)["input_ids"])
    assert tokens > 3 * model.config.text_config.sliding_window


def test_engine_reads_each_layers_window(step3_dir):
    from llm_service.config import EngineConfig
    from llm_service.model.language_model import LanguageModel
    from llm_service.model.model_runner import ModelRunner

    model = LanguageModel(step3_dir, dtype="float32")
    text = model.text_config
    windows = ModelRunner(model, EngineConfig(num_kv_blocks=8)).windows
    assert windows == tuple(text.sliding_window if t == "sliding_attention" else None for t in text.layer_types)
    assert None in windows and text.sliding_window in windows  # the real mix: full and sliding layers
