"""Encoder CUDA graphs by token budget (`encoder_service.vit_graphs`).

On CPU the graphs' padded forward runs uncaptured: a batch padded to its budget (an extra
attention segment, Qwen2.5-VL's windows too) gives every real item the eager tower's output, in
float64. On a GPU (marked `gpu`): captured graphs replay several item mixes of one budget within
bf16 tolerance of the eager tower."""

from __future__ import annotations

import pytest
import torch

from encoder_service.vit_graphs import TowerGraphs, budget_ladder
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.media_factory import image_bytes, video_frames

QWEN = ("qwen2_vl", "qwen2_5_vl")


def test_the_ladder_doubles_to_the_pools_budget_in_whole_merge_blocks():
    assert budget_ladder(5000, 4) == [1024, 2048, 4096, 5000]
    assert budget_ladder(1000, 4) == [1000] and budget_ladder(1001, 4) == [1004]
    assert budget_ladder(16384 * 4, 4)[-1] == 65536 and all(b % 4 == 0 for b in budget_ladder(9999, 4))


def _encoder(model_dir: str, dtype: str, device: str = "cpu"):
    from encoder_service.runtime import VisionEncoder

    return VisionEncoder(model_dir, dtype=dtype, device=device)


def _batch(encoder, seed: int = 0) -> list:
    """Two images of other sizes and a 4-frame video, prepared as the pool prepares them."""
    items = [MediaItem(MediaKind.IMAGE, (image_bytes(56 + 28 * seed, 84, seed),)),
             MediaItem(MediaKind.IMAGE, (image_bytes(112, 56, seed + 1),)),
             MediaItem(MediaKind.VIDEO, tuple(video_frames(4, 56, 84, seed + 2)), fps=2.0)]
    return [encoder.preprocess(encoder.plan(item)) for item in items]


@pytest.mark.parametrize("family", QWEN)
def test_a_padded_batch_gives_every_item_the_eager_output(tiny_models, family):
    encoder = _encoder(tiny_models[family], "float64")
    prepared = _batch(encoder)
    eager = encoder.forward(prepared)
    assert "uncaptured" in encoder.capture_graphs(max_cost=2048, unit="tokens", capture=False)
    graphs = encoder.face.graphs
    grids = [p.layout for p in prepared]
    layout = graphs.layout(grids)
    assert layout is not None and layout.budget > layout.patches  # padded: one segment more
    assert graphs.windowed == (family == "qwen2_5_vl")
    padded = encoder.forward(prepared)
    assert graphs.runs == 1  # the batch ran through the graphs' buffers, not the eager tower
    for want, got in zip(eager, padded, strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", QWEN)
def test_a_full_budget_and_too_many_segments(tiny_models, family):
    encoder = _encoder(tiny_models[family], "float64")
    prepared = _batch(encoder, seed=1)
    grids = [p.layout for p in prepared]
    patches = sum(t * h * w for t, h, w in grids)
    pixels = encoder.face.pixel_values(prepared, torch.device("cpu")).to(torch.float64)
    want = encoder.tower(pixels, grid_thw=torch.tensor(grids)).pooler_output
    exact, _ = TowerGraphs.capture(encoder.tower, [patches], pixels.shape[1], capture=False)
    assert exact.layout(grids).budget == patches  # no padding rows: only zero-length segments
    torch.testing.assert_close(exact.run(pixels, grids), want, rtol=0, atol=1e-10)
    few, _ = TowerGraphs.capture(encoder.tower, [4 * patches], pixels.shape[1], capture=False, max_segments=2)
    assert few.layout(grids) is None and few.run(pixels, grids) is None  # 1 + 1 + 2 segments: eager
    assert few.layout(grids[:1]) is not None
    assert exact.layout(grids + grids[:1]) is None  # more patches than the largest budget


def test_the_patch_cap_bounds_the_ladder_and_a_larger_batch_runs_eager(tiny_models):
    encoder = _encoder(tiny_models["qwen2_vl"], "float64")
    prepared = _batch(encoder, seed=2)
    patches = sum(t * h * w for t, h, w in (p.layout for p in prepared))
    eager = encoder.forward(prepared)
    encoder.capture_graphs(max_cost=2048, unit="tokens", capture=False, max_patches=patches // 2)
    graphs = encoder.face.graphs
    assert graphs.budgets[-1] <= patches // 2 + 3 and graphs.layout([p.layout for p in prepared]) is None
    assert all(torch.equal(got[0], want[0]) for got, want in zip(encoder.forward(prepared), eager, strict=True))
    assert graphs.runs == 0  # over the cap: the eager tower ran


def test_families_without_graphs_say_so(qwen3_dir):
    encoder = _encoder(qwen3_dir, "float32")
    assert "no CUDA graphs" in encoder.capture_graphs(max_cost=1024, unit="tokens")
    assert encoder.face.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", QWEN)
def test_captured_graphs_replay_item_mixes_within_bf16_tolerance(tiny_models, family):
    encoder = _encoder(tiny_models[family], "bfloat16", "cuda")
    mixes = [_batch(encoder, seed) for seed in range(3)]
    eager = [encoder.forward(prepared) for prepared in mixes]
    what = encoder.capture_graphs(max_cost=2048, unit="tokens")
    assert encoder.face.graphs is not None, what
    budgets = {encoder.face.graphs.layout([p.layout for p in prepared]).budget for prepared in mixes}
    assert len(budgets) == 1  # several mixes in one graph
    for prepared, want in zip(mixes, eager, strict=True):
        got = encoder.forward(prepared)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a[0].float(), b[0].float(), rtol=2e-2, atol=2e-2)
    assert encoder.face.graphs.runs == len(mixes)
