"""MiniCPM-V 4.6 (`minicpmv4_6`): tiny checkpoint, router face == the processor's input_ids (images
with slices, several images numbered by `<image_id>`, videos of pre-extracted frames), encoder face
== the in-tree model's features, LLM startup refused (hybrid linear-attention LM)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmserve.families import router_face
from mmserve.media import MediaItem, MediaKind
from tests.media_factory import image_bytes, video_frames
from tests.reference import _pil, load_reference


@pytest.fixture(scope="session")
def minicpmv_dir(tmp_path_factory) -> str:
    from mmserve.tiny import ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return str(ensure_tiny_model("minicpmv4_6", os.path.join(root, "minicpmv4_6")))


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


def test_llm_startup_refuses_the_hybrid_linear_attention_lm(minicpmv_dir):
    from llm_service.model import LanguageModel

    with pytest.raises(ValueError, match="linear-attention layers"):
        LanguageModel(minicpmv_dir, dtype="float32")
