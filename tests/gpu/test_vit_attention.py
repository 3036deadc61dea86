"""Packed ViT attention: one attention call per layer per batch, equal to the towers' per-segment loop."""

import pytest
import torch
from transformers import AttentionInterface

from encoder_service import VisionEncoder
from encoder_service.vit_attention import VIT_ATTN_IMPLEMENTATION, grouped_sdpa, packed_attention
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.media_factory import image_bytes, video_frames

pytestmark = pytest.mark.kernel


def _items() -> list[MediaItem]:
    return [MediaItem(MediaKind.IMAGE, (image_bytes(56, 84, 1),)),
            MediaItem(MediaKind.IMAGE, (image_bytes(112, 56, 2),)),
            MediaItem(MediaKind.VIDEO, tuple(video_frames(4, 56, 56, 3)), fps=2.0)]


def _depth(encoder: VisionEncoder) -> int:
    return len(encoder.tower.blocks)


def test_one_attention_call_per_layer_per_batch(model_dir):
    encoder = VisionEncoder(model_dir, dtype="float32")
    calls = []

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return packed_attention(module, query, *args, **kwargs)

    AttentionInterface.register(VIT_ATTN_IMPLEMENTATION, counting)
    try:
        prepared = [encoder.preprocess(encoder.plan(item)) for item in _items()]
        encoder.forward(prepared)
    finally:
        AttentionInterface.register(VIT_ATTN_IMPLEMENTATION, packed_attention)
    assert len(calls) == _depth(encoder)  # 3 items (4 segments: the video has 2 frames in time), one call per layer
    assert set(calls) == {sum(p.num_patches for p in prepared)}  # each call covers the whole batch


def test_packed_equals_the_towers_per_segment_loop(model_dir):
    encoder = VisionEncoder(model_dir, dtype="float64")
    prepared = [encoder.preprocess(encoder.plan(item)) for item in _items()]
    packed = encoder.forward(prepared)
    encoder.tower.config._attn_implementation = "sdpa"  # transformers' own loop over cu_seqlens segments
    looped = encoder.forward(prepared)
    for p, lp in zip(packed, looped):
        torch.testing.assert_close(p[0], lp[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("lengths", [[7, 1, 30, 12, 7, 30], [16, 16, 16], [9]])
def test_grouped_sdpa_equals_one_call_per_segment(lengths):
    gen = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), 3, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    out = grouped_sdpa(q, k, v, torch.tensor(lengths), 0.35)
    expected = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                                         scale=0.35).transpose(0, 1)
        for qs, ks, vs in zip(*(torch.split(t, lengths) for t in (q, k, v)))
    ])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_packed_vit_makes_one_kernel_call_per_layer(model_dir, dtype, monkeypatch):
    """bf16: torch's varlen flash attention (where this torch has it); float32: the Triton kernel."""
    import mmserve.kernels.triton_attention as kernel
    from encoder_service.vit_attention import _torch_varlen

    encoder = VisionEncoder(model_dir, dtype=dtype, device="cuda")
    calls = {"triton": 0, "torch": 0}
    original = kernel.varlen_attention
    monkeypatch.setattr(kernel, "varlen_attention",
                        lambda *a, **k: calls.__setitem__("triton", calls["triton"] + 1) or original(*a, **k))
    prepared = [encoder.preprocess(encoder.plan(item)) for item in _items()]
    flash = _torch_varlen(torch.empty(1, 1, 16, dtype=getattr(torch, dtype), device="cuda"))  # None for float32
    if flash is not None:
        from torch.nn.attention import varlen

        monkeypatch.setattr(varlen, "varlen_attn",
                            lambda *a, **k: calls.__setitem__("torch", calls["torch"] + 1) or flash(*a, **k))
    packed = encoder.forward(prepared)
    expected = {"torch": _depth(encoder), "triton": 0} if flash is not None else {"torch": 0, "triton": _depth(encoder)}
    assert calls == expected
    encoder.tower.config._attn_implementation = "sdpa"
    tol = 5e-2 if dtype == "bfloat16" else 1e-4
    for p, lp in zip(packed, encoder.forward(prepared)):
        torch.testing.assert_close(p[0].float(), lp[0].float(), rtol=tol, atol=tol)
