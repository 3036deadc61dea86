"""Pixels stay uint8 until the device: the faces' `pixel_values` (the checkpoint's processor run in
`forward`, on the tower's device, over the decoded uint8 frames) equal what the `transformers`
processor makes of the decoded image or frames, and the pool queues 3 bytes a pixel.

Tolerance: exact (`torch.equal`) on CPU: the same torchvision ops run on the same uint8 tensor.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from encoder_service.families.base import image_uint8
from mmserve.inputs.media import MediaItem, MediaKind, decode_image
from tests.families.test_encoder_equivalence import encoder
from tests.support.media_factory import image_bytes, video_frames

CPU = torch.device("cpu")
# odd sizes, an upscaled small one, a wide one, a JPEG whose EXIF orientation swaps its sides
IMAGES = [image_bytes(37, 53, 1), image_bytes(20, 24, 2), image_bytes(64, 300, 3), image_bytes(130, 90, 4),
          image_bytes(48, 80, 5, fmt="JPEG", exif_orientation=6)]


@pytest.fixture(scope="module")
def image_models(tiny_models, qwen3_dir, llava_models, step3_dir, minicpmv_dir) -> dict[str, str]:
    return {**tiny_models, "qwen3_vl": qwen3_dir, **llava_models, "step3p7": step3_dir, "minicpmv4_6": minicpmv_dir}


def _face(model_dir: str):
    return encoder(model_dir, "float32").face


def _prepared(face, item: MediaItem):
    return face.preprocess(item, None)


def _expected_images(model_dir: str, data: list[bytes]) -> tuple[torch.Tensor, ...]:
    """The processor's own output for the decoded images (PIL, as `transformers` users pass them)."""
    processor = AutoProcessor.from_pretrained(model_dir).image_processor
    out = processor(images=[decode_image(d) for d in data], return_tensors="pt")
    if "num_local_patches" in out:  # Step3: (crops, global views), as the face returns them
        size = processor.patch_size
        return out.get("pixel_values_local", torch.empty(0, 3, size, size)), out["pixel_values"]
    return (out["pixel_values"],)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_siglip", "step3p7",
                                  "minicpmv4_6"])
def test_image_pixels_equal_the_processors(image_models, name):
    face = _face(image_models[name])
    for data in IMAGES:
        got = face.pixel_values([_prepared(face, MediaItem(MediaKind.IMAGE, (data,)))], CPU)
        got = got if isinstance(got, tuple) else (got,)
        want = _expected_images(image_models[name], [data])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and g.shape == w.shape and torch.equal(g, w), (name, g.shape)


@pytest.mark.parametrize("name", ["llava", "step3p7"])
def test_a_batch_of_images_runs_one_processor_call_equal_to_the_processors(image_models, name):
    """LLaVA and Step3 process a whole batch in one call (mixed sizes): the same as one by one."""
    face = _face(image_models[name])
    got = face.pixel_values([_prepared(face, MediaItem(MediaKind.IMAGE, (d,))) for d in IMAGES], CPU)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got, _expected_images(image_models[name], IMAGES)):
        assert torch.equal(g, w)


def test_split_step3_pieces_take_their_own_views(image_models):
    face = _face(image_models["step3p7"])
    prepared = _prepared(face, MediaItem(MediaKind.IMAGE, (image_bytes(200, 200, 7),)))
    crops, global_view = face.pixel_values([prepared], CPU)
    pieces = face.split(prepared, face.crop_tokens * 3, "tokens")
    assert len(pieces) > 2 and all(p.tensors[0] is prepared.tensors[0] for p in pieces)  # the same uint8 image
    views = [face.pixel_values([p], CPU) for p in pieces]
    assert torch.equal(torch.cat([v[0] for v in views]), crops)
    assert torch.equal(torch.cat([v[1] for v in views]), global_view)


# -- videos ----------------------------------------------------------------------------------------
def _expected_video(model_dir: str, frames: list[bytes]) -> torch.Tensor:
    processor = AutoProcessor.from_pretrained(model_dir).video_processor
    out = processor(videos=[[decode_image(f) for f in frames]], do_sample_frames=False, return_tensors="pt")
    return out["pixel_values_videos"]


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "minicpmv4_6"])
@pytest.mark.parametrize("shape", [(4, 56, 84), (5, 37, 61), (8, 128, 160)])
def test_video_pixels_equal_the_processors(image_models, name, shape):
    frames = video_frames(*shape, seed=sum(shape))
    face = _face(image_models[name])
    prepared = _prepared(face, MediaItem(MediaKind.VIDEO, tuple(frames), fps=2.0))
    got = face.pixel_values([prepared], CPU)
    want = _expected_video(image_models[name], frames)
    want = want[:1] if name == "minicpmv4_6" else want  # MiniCPM-V packs a video's views in one row
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_split_video_pieces_are_frames_sized_as_the_whole_video(image_models, name):
    """Pieces of whole temporal patches (the last one short: 7 frames) give the whole video's patches
    in order. For Qwen3-VL the size depends on the frame count (8 frames of 128x160 are scaled down,
    2 alone would not be), so a piece is resized to the whole video's planned size."""
    face = _face(image_models[name])
    prepared = _prepared(face, MediaItem(MediaKind.VIDEO, tuple(video_frames(7, 128, 160, 3)), fps=2.0))
    assert prepared.tensors[0].dtype == torch.uint8 and prepared.tensors[0].shape == (7, 3, 128, 160)
    whole = face.pixel_values([prepared], CPU)
    per_patch = prepared.num_tokens // prepared.layout[0]
    pieces = face.split(prepared, per_patch, "tokens")
    assert [p.tensors[0].shape[0] for p in pieces] == [2, 2, 2, 1]
    assert all(p.layout[1:] == prepared.layout[1:] for p in pieces)
    assert torch.equal(torch.cat([face.pixel_values([p], CPU) for p in pieces]), whole)
    assert torch.equal(face.pixel_values(pieces, CPU), whole)  # one batch of all pieces
    if name == "qwen3_vl":  # the case the planned size is for: two frames alone would be sized larger
        alone = _prepared(face, MediaItem(MediaKind.VIDEO, tuple(video_frames(2, 128, 160, 3)), fps=2.0))
        assert alone.layout[1:] != prepared.layout[1:]


# -- queued bytes ----------------------------------------------------------------------------------
def _with_image_max_pixels(model_dir: str, dest, max_pixels: int) -> str:
    """A copy of the checkpoint whose image processor keeps up to `max_pixels` pixels."""
    shutil.copytree(model_dir, dest)
    path = dest / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"]["size"]["longest_edge"] = max_pixels
    path.write_text(json.dumps(config))
    return str(dest)


def test_a_1024_image_queues_as_uint8_not_float32_patches(tiny_models, tmp_path):
    """Qwen2-VL at full size (max_pixels as a 1024^2 image needs): the pool's queue counts 3 bytes
    a pixel, ~3.1 MB, where the float32 patches are ~25.8 MB."""
    from transformers import AutoConfig

    from encoder_service.families.qwen2_vl import QwenVLEncoderFace

    model_dir = _with_image_max_pixels(tiny_models["qwen2_vl"], tmp_path / "qwen2_vl", 2 * 1024 * 1024)
    face = QwenVLEncoderFace(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32)
    prepared = face.preprocess(MediaItem(MediaKind.IMAGE, (image_bytes(1024, 1024, 0, fmt="JPEG"),)), None)
    assert prepared.tensors[0].dtype == torch.uint8
    assert prepared.num_bytes == 3 * 1024 * 1024  # ~3.1 MB
    patches = face.pixel_values([prepared], CPU)
    assert prepared.layout == (1, 74, 74) and patches.shape == (74 * 74, 3 * 2 * 14 * 14)
    assert patches.numel() * patches.element_size() == 25_759_104  # what the queue held before: ~25.8 MB


def test_image_uint8_applies_exif_orientation():
    data = image_bytes(48, 80, 5, fmt="JPEG", exif_orientation=6)  # rotated 90 degrees: 80 high, 48 wide
    pixels = image_uint8(data)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 80, 48) and pixels.is_contiguous()
    assert torch.equal(pixels, torch.from_numpy(np.array(decode_image(data))).permute(2, 0, 1))
