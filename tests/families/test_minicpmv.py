"""MiniCPM-V 4.6 (`minicpmv4_6`): tiny checkpoint, router face == the processor's input_ids (images
with slices, several images numbered by `<image_id>`, videos of pre-extracted frames), encoder face
== the in-tree model's features, the LM loaded with its linear-attention layers as state layers
(served end to end: tests/families/test_equivalence_runtime.py, tests/unit/test_hybrid_engine.py,
tests/serve/test_family_serve.py)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.families import router_face
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.cases import family_cases
from tests.support.media_factory import image_bytes, video_frames
from tests.support.reference import _pil, load_reference


def _processor_ids(model_dir, images=(), video=None) -> list[int]:
    processor, _ = load_reference(model_dir)
    kwargs = {}
    text = processor.image_token * len(images)
    if images:
        kwargs["images"] = [_pil(b) for b in images]
    if video is not None:
        text += processor.video_token
        frames = [_pil(f) for f in video]
        kwargs.update(videos=[frames], do_sample_frames=False,
                      video_metadata=[{"total_num_frames": len(frames), "fps": 2.0,
                                       "frames_indices": list(range(len(frames)))}])
    return processor(text=[text], return_tensors="pt", **kwargs)["input_ids"][0].tolist()


def _image_sizes():
    return st.tuples(st.integers(12, 240), st.integers(12, 240))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(_image_sizes(), min_size=1, max_size=3), seed=st.integers(0, 3))
def test_router_expansion_equals_processor_input_ids(minicpmv_dir, sizes, seed):
    images = [image_bytes(h, w, seed + k) for k, (h, w) in enumerate(sizes)]
    expansions = router_face(minicpmv_dir).expand_all([MediaItem(MediaKind.IMAGE, (b,)) for b in images], 1 << 24)
    ids = _processor_ids(minicpmv_dir, images)
    assert [t for e in expansions for t in e.token_ids] == ids
    processor, _ = load_reference(minicpmv_dir)
    assert sum(e.cost for e in expansions) == sum(t == processor.image_token_id for t in ids)
    assert [t == processor.image_token_id for e in expansions for t in e.token_ids] == [
        b for e in expansions for b in e.is_embed]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.integers(1, 3), size=_image_sizes(), seed=st.integers(0, 3))
def test_router_expands_videos_of_pre_extracted_frames_like_the_processor(minicpmv_dir, frames, size, seed):
    video = video_frames(frames, size[0], size[1], seed)
    image = image_bytes(90, 200, seed)
    face = router_face(minicpmv_dir)
    expansions = face.expand_all([MediaItem(MediaKind.IMAGE, (image,)), MediaItem(MediaKind.VIDEO, tuple(video))],
                                 1 << 24)
    assert [t for e in expansions for t in e.token_ids] == _processor_ids(minicpmv_dir, [image], video)


def test_image_ids_number_images_in_prompt_order(minicpmv_dir):
    face = router_face(minicpmv_dir)
    images = [MediaItem(MediaKind.IMAGE, (image_bytes(60, 60, k),)) for k in range(12)]
    expansions = face.expand_all(images, 1 << 24)
    assert [t for e in expansions for t in e.token_ids] == _processor_ids(minicpmv_dir, [i.frames[0] for i in images])
    assert expansions[0].token_ids != expansions[11].token_ids  # <image_id>0 vs <image_id>11
    big = face.expand(MediaItem(MediaKind.IMAGE, (image_bytes(200, 200, 0),)), 1 << 24).layout
    assert big.frames[0].rows * big.frames[0].cols >= 3


def test_llm_loads_only_the_lm_and_declares_its_linear_attention_layers(minicpmv_dir):
    from llm_service.model.language_model import LanguageModel

    model = LanguageModel(minicpmv_dir, dtype="float32")
    types = model.text_config.layer_types
    assert types == ["linear_attention"] * 3 + ["full_attention"]  # the real 3:1 mix
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    assert [s.layer_idx for s in model.face.state_layers()] == linear
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in model.keys_read)


def _features(model_dir, item: MediaItem) -> torch.Tensor:
    processor, model = load_reference(model_dir)
    with torch.inference_mode():
        if item.kind is MediaKind.IMAGE:
            x = processor.image_processor(images=[_pil(item.frames[0])], return_tensors="pt")
            out = model.model.get_image_features(x["pixel_values"].to(torch.float64), x["target_sizes"])
        else:
            frames = [_pil(f) for f in item.frames]
            meta = [{"total_num_frames": len(frames), "fps": 2.0, "frames_indices": list(range(len(frames)))}]
            x = processor.video_processor(videos=[frames], do_sample_frames=False, video_metadata=meta,
                                          return_tensors="pt")
            out = model.model.get_video_features(x["pixel_values_videos"][:1].to(torch.float64),
                                                 x["target_sizes_videos"])
    return torch.cat(list(out.pooler_output))


ITEMS = (
    MediaItem(MediaKind.IMAGE, (image_bytes(200, 200, 0),)),
    MediaItem(MediaKind.IMAGE, (image_bytes(40, 60, 1),)),
    MediaItem(MediaKind.IMAGE, (image_bytes(90, 220, 2),)),
    MediaItem(MediaKind.VIDEO, tuple(video_frames(3, 150, 120, 3))),
)


def test_encoder_equals_in_tree_features_and_split_views_concatenate(minicpmv_dir):
    from tests.families.test_encoder_equivalence import encoder

    enc = encoder(minicpmv_dir, "float64")
    planned = [enc.plan(item) for item in ITEMS]
    got = [e.rows for e in enc.encode(planned)]
    for item, plan, rows in zip(ITEMS, planned, got):
        expected = _features(minicpmv_dir, item)
        assert rows.shape[0] == plan.cost == expected.shape[0]
        torch.testing.assert_close(rows, expected, rtol=0, atol=1e-10)
    prepared = enc.preprocess(planned[0])
    assert prepared.layout >= 4  # source view + slices
    for budget in (1, 10, prepared.num_tokens):
        pieces = enc.split(prepared, budget, "tokens")
        assert sum(p.num_tokens for p in pieces) == prepared.num_tokens
        assert len(pieces) > 1 or budget >= prepared.num_tokens
        rows = torch.cat([parts[0] for piece in pieces for parts in enc.forward([piece])])
        torch.testing.assert_close(rows, got[0], rtol=0, atol=1e-10)


def test_pooled_views_split_across_batches_equal_whole_items(minicpmv_dir):
    import asyncio

    from encoder_service.batching import BatchConfig
    from tests.families.test_encoder_equivalence import CountingEncoder, encoder, pooled

    enc = CountingEncoder(encoder(minicpmv_dir, "float64"))
    expected = [_features(minicpmv_dir, item) for item in ITEMS]
    got = asyncio.run(pooled(enc, list(ITEMS), BatchConfig(max_batch_tokens=12, batch_wait_ms=30), per_request=2))
    assert sum(enc.forward_sizes) > len(ITEMS)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)


def test_tiny_loads_with_auto_classes_and_is_image_sensitive(minicpmv_dir):
    from tests.support.cases import image, image_question
    from tests.support.reference import reference_generate

    processor, model = load_reference(minicpmv_dir)
    assert model.config.text_config.model_type == "qwen3_5_text"
    assert {"linear_attention", "full_attention"} == set(model.config.text_config.layer_types)
    assert processor.image_token_id == model.config.image_token_id
    first = reference_generate(minicpmv_dir, image_question(image(64, 180, 1)), 12)
    second = reference_generate(minicpmv_dir, image_question(image(150, 90, 2)), 12)
    assert first != second
    hook = model.model.merger.register_forward_hook(lambda m, a, out: [torch.zeros_like(o) for o in out])
    try:
        zeroed = reference_generate(minicpmv_dir, image_question(image(64, 180, 1)), 12)
    finally:
        hook.remove()
    assert first != zeroed


def test_cases_take_slices_and_a_long_prompt(minicpmv_dir):
    from tests.support.reference import reference_inputs

    cases = family_cases("minicpmv4_6")
    face = router_face(minicpmv_dir)
    layouts = [face.expand(MediaItem(MediaKind.IMAGE, (p["bytes"],)), 1 << 24).layout
               for p in cases["sliced_images"][0]["content"] if p["type"] == "image"]
    assert [(f.rows, f.cols) for lay in layouts for f in lay.frames] == [(2, 2), (1, 2), (0, 0)]
    assert reference_inputs(minicpmv_dir, cases["long_prompt"])["input_ids"].shape[1] > 2048
